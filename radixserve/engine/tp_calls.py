"""The calls rank 0 makes of its tensor-parallel ranks 1..N-1 (`TPGroup.call`): one
dataclass per call, tagged by its ``OP``, and their encoding (a JSON object, `encode` and
`decode`). Each rank runs a call's handler (`radixserve.engine.tp_rank.HANDLERS`). Rank 0
starts its ranks from its own installation, so both ends always know the same calls."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar, get_args


@dataclass(frozen=True)
class StartAgent:
    """Start this rank's KV transfer agent (named ``<name>.tp<rank>``) on rank 0's transfer
    network, driven by rank 0's `GroupAgent` at ``endpoint`` (`transfer.rank_agent.serve_rank`)."""

    OP: ClassVar[str] = "start_agent"
    backend: str
    name: str
    endpoint: str
    timeout_s: float
    nixl_progress_thread: bool
    bind_host: str
    advertise_host: str | None
    port_min: int
    port_max: int
    secret: str | None
    identity: str = ""  # rank 0's model identity digest (`Engine.start_rank_agents`)


@dataclass(frozen=True)
class MapSpillBuffer:
    """Map rank 0's host-tier spill buffer: the file at ``path``, of ``shape`` and ``dtype``
    (a torch dtype's name, e.g. ``"bfloat16"``)."""

    OP: ClassVar[str] = "map_spill_buffer"
    path: str
    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class Spill:
    """Copy this rank's heads of pages ``page_ids`` into ``slots`` of the spill buffer."""

    OP: ClassVar[str] = "spill"
    page_ids: list[int]
    slots: list[int]


TPCall = StartAgent | MapSpillBuffer | Spill
CALLS: dict[str, type[TPCall]] = {cls.OP: cls for cls in get_args(TPCall)}


def encode(call: TPCall) -> bytes:
    if CALLS.get(getattr(call, "OP", "")) is not type(call):
        raise TypeError(f"{type(call).__name__} is not a tensor-parallel call ({', '.join(CALLS)})")
    return json.dumps({"op": call.OP, **dataclasses.asdict(call)}).encode()


def decode(data: bytes) -> TPCall:
    """The call ``data`` encodes; ValueError naming it if it is unknown or malformed."""
    fields = json.loads(data)
    op = fields.pop("op", None)
    cls = CALLS.get(op)
    if cls is None:
        raise ValueError(f"unknown tensor-parallel call {op!r} (known: {', '.join(CALLS)})")
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"malformed tensor-parallel call {op!r}: {exc}") from None
