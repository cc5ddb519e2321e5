"""The torch kernel set: the plain-torch references, with a faster CPU implementation
where one exists (same signature and result; off the CPU each falls back to its
reference). Attention, extend and decode alike, is the native batch-invariant kernel
(`attention.py`) where it is built; the batched LoRA matmul is `lora.py`'s native kernel
(the reference's bits)."""

from dataclasses import replace

from radixserve.kernels.cpu.attention import decode_attention, extend_attention
from radixserve.kernels.cpu.lora import lora_apply
from radixserve.kernels.reference import OPS as REFERENCE_OPS

OPS = replace(
    REFERENCE_OPS,
    extend_attention=extend_attention,
    decode_attention=decode_attention,
    lora_apply=lora_apply,
)

__all__ = ["OPS"]
