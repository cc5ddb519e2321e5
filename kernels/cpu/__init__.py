"""The torch kernel set: the plain-torch references, with a faster CPU implementation
where one exists (same signature and result; off the CPU each falls back to its
reference)."""

from dataclasses import replace

from radixserve.kernels.cpu.decode_attention import decode_attention
from radixserve.kernels.reference import OPS as REFERENCE_OPS

OPS = replace(REFERENCE_OPS, decode_attention=decode_attention)

__all__ = ["OPS"]
