"""Plain-torch reference kernels: the specification every fast kernel is tested against."""

from radixserve.kernels.ops import KernelOps
from radixserve.kernels.reference.decode_attention import decode_attention
from radixserve.kernels.reference.extend_attention import extend_attention
from radixserve.kernels.reference.fused_moe import fused_moe
from radixserve.kernels.reference.lora import lora_apply
from radixserve.kernels.reference.pack_pages import pack_pages, unpack_pages
from radixserve.kernels.reference.rmsnorm import rmsnorm
from radixserve.kernels.reference.rope import rope
from radixserve.kernels.reference.silu_and_mul import silu_and_mul
from radixserve.kernels.reference.store_kv import store_kv

OPS = KernelOps(
    name="torch",
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

__all__ = ["OPS"]
