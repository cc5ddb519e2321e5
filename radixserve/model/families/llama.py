"""Llama 2 and 3 (SmolLM2 too): the decoder with none of its options on."""

from __future__ import annotations

from radixserve.model.families.family import Family, PreTokenizer

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = PreTokenizer(split=LLAMA3_SPLIT, ignore_merges=True)
_LLAMA3_MERGED = PreTokenizer(split=LLAMA3_SPLIT)  # Llama 3's split, merges kept


class Llama(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    gguf_archs = ("llama",)
    gguf_permuted_qk = True  # llama.cpp's converter interleaves Q/K's rotary pairs
    pre_tokenizers = {
        **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), _LLAMA3),
        **dict.fromkeys(("smaug-bpe", "falcon3"), _LLAMA3_MERGED),
        "smollm": PreTokenizer(digits=True),  # SmolLM's: every digit, then GPT-2's regex
    }


FAMILY = Llama()
