"""Reading a Hugging Face model directory's safetensors (its config and tokenizer:
`hf_config`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.families.registry import by_name
from radixserve.model.hf_config import read_hf_dir, read_json
from radixserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class SafetensorsWeights:
    """Lazy access to the tensors of a directory's `*.safetensors` files. With
    ``norm_offset`` (Gemma, whose norms multiply by 1 + w) a norm's weight is read as
    1 + w, in float32: the model's norms all multiply by their weight, as GGUF files of
    Gemma store it."""

    def __init__(self, root: Path, norm_offset: bool = False) -> None:
        self.path = root
        self._norm_offset = norm_offset
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{root} holds no *.safetensors files")
        self._handles = {}
        self._where: dict[str, Any] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
                keys = list(handle.keys())
            except Exception as exc:  # safetensors raises SafetensorError, OSError...
                raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc
            self._handles[file] = handle
            for key in keys:
                self._where[key] = (file, handle)

    def names(self) -> set[str]:
        return set(self._where)

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored (KeyError if absent)."""
        file, handle = self._where[name]
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read tensor {name}: {exc}") from exc
        if self._norm_offset and name.endswith("norm.weight"):
            return tensor.float() + 1.0
        return tensor


def load_hf_dir(root: Path) -> tuple[ModelConfig, Tokenizer, SafetensorsWeights]:
    """Config, tokenizer and lazy weights of the Hugging Face directory `root`.

    Raises ModelLoadError (naming the offending path) when config.json, tokenizer.json or
    the safetensors are missing, unreadable or unsupported.
    """
    config, tokenizer, cfg = read_hf_dir(root)
    index = root / "model.safetensors.index.json"
    weights = SafetensorsWeights(root, norm_offset=by_name(config.architecture).norm_offset)
    if "tie_word_embeddings" not in cfg and "lm_head.weight" not in weights.names():
        logger.warning("%s: no tie_word_embeddings and no lm_head.weight; tying them", root)
        config = dataclasses.replace(config, tie_word_embeddings=True)
    if index.is_file():
        missing = set(read_json(index).get("weight_map", {})) - weights.names()
        if missing:
            raise ModelLoadError(f"{index} lists tensors in no file, e.g. {sorted(missing)[0]}")
    logger.info("HF checkpoint %s: %s", root, config)
    return config, tokenizer, weights
