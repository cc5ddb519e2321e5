"""A PEFT LoRA adapter read from its directory (``adapter_config.json`` and
``adapter_model.safetensors``), checked against the base model and mapped onto this
project's fused projections.

A LoRA adapter changes a projection W (out, in) to W + scaling * B @ A, with A (r, in),
B (out, r) and scaling = lora_alpha / r (lora_alpha / sqrt(r) with ``use_rslora``). The
model fuses q/k/v into one ``qkv`` matrix (rows q | k | v) and gate/up into ``gate_up``
(rows gate | up) (`radixserve.model.layout.weight_layout`), so an adapter's q_proj update
is added to the qkv output's first q_size columns, its k_proj update to the next kv_size,
and so on: each adapted projection is a *segment* (model weight, first output column,
width) of one fused output. The adapter's tensors are kept here on the host, in the
model's dtype; `radixserve.model.lora_manager` copies them into device slots.

What the adapter's numbers depend on is its ``fingerprint``: SHA-256 over the settings
that change the math (rank, alpha, rsLoRA, the targets) and every tensor's name, dtype,
shape and bytes. Two directories holding the same adapter share KV pages; two adapters
never do (the fingerprint is the ``adapter`` field of the page namespace's
`radixserve.model.identity.ModelIdentity`).

Refused, each by name: DoRA (``use_dora``), ``fan_in_fan_out``, trained biases
(``bias``, ``lora_bias``), ``modules_to_save``, per-module ranks or alphas
(``rank_pattern``, ``alpha_pattern``), trainable token rows, parameter targets, targets
other than the seven projections, and experts of mixture-of-experts layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.layout import weight_layout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the projections an adapter may target (a layer's attention and dense MLP)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FINGERPRINT_DOMAIN = b"radixserve.lora.v1"
# base_model.model.<module>.lora_A[.<adapter name>].weight
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
# config fields whose non-default value changes the math in a way not implemented here:
# field → (the values that are fine, what it is)
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": ((False, None), "DoRA (weight-decomposed LoRA)"),
    "fan_in_fan_out": ((False, None), "fan_in_fan_out (Conv1D-style weights)"),
    "bias": (("none", None), "trained biases"),
    "lora_bias": ((False, None), "trained LoRA biases"),
    "modules_to_save": (((), [], None), "modules_to_save (fully trained modules)"),
    "rank_pattern": (({}, None), "rank_pattern (per-module ranks)"),
    "alpha_pattern": (({}, None), "alpha_pattern (per-module alphas)"),
    "trainable_token_indices": (((), [], {}, None), "trainable token rows"),
    "target_parameters": (((), [], None), "target_parameters (parameter targets)"),
    "use_qalora": ((False, None), "QA-LoRA"),
    "alora_invocation_tokens": (((), [], None), "activated LoRA (alora_invocation_tokens)"),
}


@dataclass(frozen=True)
class Segment:
    """Where a checkpoint projection's output lies in the model's fused output: model
    weight ``key`` ("layers.3.qkv"), its columns [start, start + width), and its input
    width."""

    layer: int
    key: str  # the model weight, "layers.3.qkv"
    start: int
    width: int
    in_features: int


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its tensors by the base projection's checkpoint name
    ("model.layers.3.self_attn.q_proj.weight") as (A (r, in), B (out, r)) on the host."""

    name: str
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]  # of PROJECTIONS
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    fingerprint: str  # "sha256:<hex>"

    @property
    def size_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def segments(config: ModelConfig) -> dict[str, Segment]:
    """Checkpoint name of every projection an adapter may target → its `Segment`
    (experts excluded: `load_adapter` refuses them)."""
    out = {}
    for key, pieces in weight_layout(config).items():
        kind = key.split(".")[-1]
        if not key.startswith("layers.") or kind not in ("qkv", "o_proj", "gate_up", "down"):
            continue
        layer = int(key.split(".")[1])
        for name, start, (rows, cols) in pieces:
            out[name] = Segment(layer, key, start, rows, cols)
    return out


def load_adapter(
    name: str, path: str | Path, config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read, check and map the PEFT adapter at ``path`` for a base model of ``config``;
    its tensors in ``dtype``. ModelLoadError naming the file, field or tensor otherwise."""
    root = Path(path)
    settings = _read_config(root)
    rank, alpha = settings["r"], settings["lora_alpha"]
    if rank > max_rank:
        raise ModelLoadError(
            f"adapter {name!r} has rank r={rank}, over max_lora_rank={max_rank}; raise "
            "max_lora_rank (--max-lora-rank) to serve it"
        )
    rslora = bool(settings.get("use_rslora") or False)
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    weights = _read_tensors(root, config, rank, dtype)
    targets = tuple(p for p in PROJECTIONS if any(n.endswith(f".{p}.weight") for n in weights))
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    math_settings = {"r": rank, "lora_alpha": alpha, "use_rslora": rslora, "targets": targets}
    digest.update(json.dumps(math_settings, sort_keys=True).encode())
    for module in sorted(weights):
        for part, tensor in zip("AB", weights[module]):
            header = f"{module}:{part}:{tensor.dtype}:{tuple(tensor.shape)}".encode()
            digest.update(len(header).to_bytes(4, "big") + header)
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return LoraAdapter(name, root, rank, scaling, targets, weights, "sha256:" + digest.hexdigest())


def _read_config(root: Path) -> dict[str, Any]:
    """adapter_config.json, checked: a LoRA adapter of positive rank whose options are all
    implemented here."""
    file = root / CONFIG_FILE
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{root} is not a PEFT adapter directory: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file} is not readable JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelLoadError(f"{file}: peft_type {kind!r} is not supported (only LORA)")
    for field, (fine, what) in _REFUSED.items():
        value = settings.get(field)
        if value not in fine:
            raise ModelLoadError(f"{file}: {what} is not supported ({field}={value!r})")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelLoadError(f"{file}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ModelLoadError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    settings["lora_alpha"] = float(alpha)
    targets = settings.get("target_modules")
    if isinstance(targets, list | tuple):  # a regex string is checked tensor by tensor
        other = sorted(str(t) for t in targets if t not in PROJECTIONS)
        if other:
            raise ModelLoadError(
                f"{file}: target_modules {other} are not supported (only {', '.join(PROJECTIONS)})"
            )
    return settings


def _read_tensors(
    root: Path, config: ModelConfig, rank: int, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's A and B by base checkpoint name, each shape checked against the base
    projection (and the rank)."""
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise ModelLoadError(f"{root} has no {WEIGHTS_FILE} (adapter_model.bin is not read)")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises SafetensorError, OSError...
        raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc
    where = segments(config)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise ModelLoadError(f"{file}: tensor {key!r} is not a LoRA A or B matrix "
                                 "(DoRA magnitudes, biases and embeddings are not supported)")  # fmt: skip
        module = match["module"]
        if ".experts." in module:
            raise ModelLoadError(f"{file}: tensor {key!r} targets an expert of a mixture-of-"
                                 "experts layer; adapters on experts are not supported")  # fmt: skip
        base = module + ".weight"
        if base not in where:
            raise ModelLoadError(f"{file}: tensor {key!r} targets {module!r}, which is not one "
                                 f"of this {config.architecture} model's projections "
                                 f"({', '.join(PROJECTIONS)})")  # fmt: skip
        seg = where[base]
        want = (rank, seg.in_features) if match["ab"] == "A" else (seg.width, rank)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {want} (r={rank}, base {base} is "
                                 f"({seg.width}, {seg.in_features}))")  # fmt: skip
        parts.setdefault(base, {})[match["ab"]] = tensor.to(dtype)
    out = {}
    for base, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"{file}: {base.removesuffix('.weight')} has lora_{''.join(ab)} "
                                 "without its other half")  # fmt: skip
        out[base] = (ab["A"].contiguous(), ab["B"].contiguous())
    if not out:
        raise ModelLoadError(f"{file} holds no LoRA tensors")
    return out
