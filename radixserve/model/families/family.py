"""What a model family declares: `Family`, the base every family module's ``FAMILY``
is an instance of. A family is the decoder of `radixserve.model.llama` with some of its
options on; this says which, how its checkpoints name them and how its configs spell
them. No torch here: the gateway reads configs without it.

The contract: `hf_fields` and `gguf_fields` return only the `ModelConfig` fields that
the family sets beyond the common ones (`hf_config.parse_config`, `gguf_config`),
raising `ModelLoadError` naming a field the decoder does not implement; the tensor
names (`TensorNames`) are those of the family's Hugging Face checkpoints, the GGUF
loader serving GGUF tensors under them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.errors import ModelLoadError


@dataclass(frozen=True)
class TensorNames:
    """A family's checkpoint names where they differ between families.

    ``norms``: the layer's norm weights, model weight ("post_norm") → checkpoint name
    under ``model.layers.N.``; ``moe_block`` and ``experts`` (gate, up, down): a
    mixture-of-experts layer's router ``{moe_block}.gate`` and expert e's projections
    ``{moe_block}.experts.{e}.{name}``; ``gguf_blocks``: llama.cpp's block tensor names
    whose meaning differs in this family (GGUF part → checkpoint name)."""

    norms: Mapping[str, str] = field(
        default_factory=lambda: {
            "input_norm": "input_layernorm",
            "post_norm": "post_attention_layernorm",
        }
    )
    moe_block: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    gguf_blocks: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PreTokenizer:
    """How a GGUF vocabulary (its ``tokenizer.ggml.pre``) splits text before byte-level
    BPE, as the model's own tokenizer.json does: ``split``, a regex whose matches are
    the words (None: GPT-2's); ``digits``, every digit a word of its own first;
    ``nfc``, text normalised to NFC first; ``ignore_merges``, a word that is in the
    vocabulary is one token whatever the merges say."""

    split: str | None = None
    digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False


class Family:
    """One model family. Subclass it in a module of `radixserve.model.families` and
    name an instance ``FAMILY`` there: the registry finds it by its names."""

    name: str = ""  # ModelConfig.architecture
    hf_architectures: tuple[str, ...] = ()  # config.json's "architectures" it reads
    # llama.cpp's general.architecture values it reads; several families may share one,
    # told apart by `experts` (a GGUF "llama" file with experts is Mixtral)
    gguf_archs: tuple[str, ...] = ()
    experts: bool = False
    activations: tuple[str, ...] = ("silu",)  # the MLP activation's names in its configs
    tie_by_default: bool = False  # tie_word_embeddings when config.json does not say
    attention_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    # its checkpoints' norms multiply by 1 + w (Gemma): read as 1 + w from safetensors
    # (GGUF files store 1 + w already), so every norm of the decoder is the same op
    norm_offset: bool = False
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows
    names: TensorNames = TensorNames()
    # its GGUF vocabularies' pre-tokenizers, by ``tokenizer.ggml.pre``
    pre_tokenizers: Mapping[str, PreTokenizer] = {}

    def hf_fields(self, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
        """Its ModelConfig fields from config.json beyond the common ones."""
        return {}

    def rope_config(self, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
        """The part of config.json its global layers' RoPE is read from (`rope_theta`
        and `rope_scaling`, or `rope_parameters`): all of it but where the family's
        configs say it another way."""
        return cfg

    def gguf_fields(self, meta: Mapping[str, Any], shape: GGUFShape) -> dict[str, Any]:
        """Its ModelConfig fields from GGUF metadata beyond the common ones."""
        return {}

    def refuse_unsupported(self, cfg: Mapping[str, Any]) -> None:
        """ModelLoadError (`refuse`) for a config.json field of this family whose value
        the decoder does not implement."""


def refuse(cfg: Mapping[str, Any], key: str, what: str) -> None:
    """ModelLoadError naming the config field ``key``, its value and what it needs."""
    raise ModelLoadError(f"{key}={cfg[key]!r} is not supported ({what})")


@dataclass(frozen=True)
class GGUFShape:
    """What a GGUF family reads its fields with: the file's arch (its metadata keys'
    prefix) and the common fields already read."""

    arch: str
    layers: int
    hidden: int
    heads: int
    head_dim: int
