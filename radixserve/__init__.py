"""radixserve: LLM serving with a radix-indexed, tiered KV cache."""

__version__ = "0.1.0"
