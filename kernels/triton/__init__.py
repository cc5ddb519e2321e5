"""Triton kernels, one module per op, each with its reference's signature.

Under TRITON_INTERPRET=1 (set before the first import) they run in Triton's CPU
interpreter on CPU tensors — how the tests check them here; otherwise they take CUDA
tensors. `INTERPRETED` records which, for this process.
"""

from radixserve.kernels.ops import KernelOps
from radixserve.kernels.triton.checks import INTERPRETED
from radixserve.kernels.triton.decode_attention import decode_attention
from radixserve.kernels.triton.extend_attention import extend_attention
from radixserve.kernels.triton.fused_moe import fused_moe
from radixserve.kernels.triton.lora import lora_apply
from radixserve.kernels.triton.pack_pages import pack_pages, unpack_pages
from radixserve.kernels.triton.rmsnorm import rmsnorm
from radixserve.kernels.triton.rope import rope
from radixserve.kernels.triton.silu_and_mul import silu_and_mul
from radixserve.kernels.triton.store_kv import store_kv

OPS = KernelOps(
    name="triton",
    store_kv=store_kv,
    extend_attention=extend_attention,
    decode_attention=decode_attention,
    pack_pages=pack_pages,
    unpack_pages=unpack_pages,
    rmsnorm=rmsnorm,
    rope=rope,
    silu_and_mul=silu_and_mul,
    fused_moe=fused_moe,
    lora_apply=lora_apply,
)

__all__ = ["INTERPRETED", "OPS"]
