"""Model families: one module per family (`family.Family`: its architecture names,
config fields, tensor names, norm offset, GGUF quirks), found by `registry`. A new
family is one module here naming its ``FAMILY``; the decoder (`radixserve.model.llama`)
holds only the math."""
