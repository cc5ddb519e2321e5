"""``python -m radixserve.engine.tp_rank``: rank 1..N-1 of a worker's tensor-parallel
group, started by its rank 0 (`radixserve.engine.tp_group.TPGroup`) with the engine's
settings, its rank and the port of the group's store in the environment. It loads its
shard of the model and of the KV pool, then runs every step rank 0 sends until told to
stop, and the calls of a worker (`radixserve.engine.tp_calls`, each run by its handler in
`HANDLERS`): start this rank's KV transfer agent, which rank 0's `GroupAgent` drives, and
copy this rank's heads of spilled pages into the host tier's buffer, shared with rank 0
through a file."""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from radixserve.engine.device import resolve_device, resolve_dtype
from radixserve.engine.model_shard import ModelShard, copy_out, copy_page
from radixserve.engine.tp_calls import MapSpillBuffer, Spill, StartAgent, decode
from radixserve.engine.tp_group import (
    ENV_PORT,
    ENV_RANK,
    ENV_SETTINGS,
    HEADER_LEN,
    OP_CALL,
    OP_COPY_PAGE,
    OP_FORWARD,
    OP_STOP,
    join,
    rank_device,
    rendezvous,
    report_ready,
    threads_per_rank,
)
from radixserve.logging import setup_logging
from radixserve.model.checkpoint import load_checkpoint
from radixserve.model.forward_batch import PackedStep, forward_batch_of
from radixserve.model.tp import TPShard
from radixserve.protocol.security import keys_from
from radixserve.settings import EngineSettings
from radixserve.transfer import PoolCompat, TransferNetwork, create_agent
from radixserve.transfer.rank_agent import serve_rank

logger = logging.getLogger("radixserve.engine.tp_rank")


def _exit_with_parent() -> None:
    """Exit if rank 0's process is gone (a kill -9 leaves nobody to tell us)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="radixserve-tp-parent", daemon=True).start()


def main() -> int:
    setup_logging()
    _exit_with_parent()
    settings = EngineSettings.model_validate_json(os.environ[ENV_SETTINGS])
    rank, size = int(os.environ[ENV_RANK]), settings.tp
    device = rank_device(resolve_device(settings.device), rank)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(settings))
    comm = join(rank, size, rendezvous(rank, size, int(os.environ[ENV_PORT])), device)
    shard: ModelShard | None = None
    try:
        checkpoint = load_checkpoint(settings.model, progress=False)
        config = checkpoint.config
        dtype = resolve_dtype(settings.dtype, device)
        shard = ModelShard.build(settings, checkpoint, device, dtype,
                                 config.max_model_len(settings.max_model_len),
                                 TPShard(rank, size), comm)  # fmt: skip
    except Exception:
        logger.exception("tensor-parallel rank %d could not load the model", rank)
    report_ready(shard is not None, shard.kv_pool.num_pages if shard else 0, size)
    if shard is None:
        return 1
    serve(shard, device, PoolCompat.of(shard.kv_pool.kv, config.name, config.num_kv_heads))
    dist.destroy_process_group()
    return 0


class RankState:
    """What a rank's calls set up: its shard, its pool's compat, the host tier's buffer."""

    def __init__(self, shard: ModelShard, compat: PoolCompat) -> None:
        self.shard, self.compat = shard, compat
        self.spill_buffer: torch.Tensor | None = None


def _start_agent(state: RankState, call: StartAgent) -> None:
    """This rank's KV transfer agent, driven by rank 0's `GroupAgent`."""
    network = TransferNetwork(call.bind_host, call.advertise_host, call.port_min,
                              call.port_max, keys_from(call.secret))  # fmt: skip
    shard = state.shard.kv_shard
    compat = replace(state.compat, identity=call.identity)  # rank 0's
    agent = create_agent(call.backend, f"{call.name}.tp{shard.rank}", state.shard.kv_pool.kv,
                         compat, call.timeout_s, call.nixl_progress_thread, network, shard)  # fmt: skip
    serve_rank(agent, call.endpoint, shard.rank)


def _map_spill_buffer(state: RankState, call: MapSpillBuffer) -> None:
    state.spill_buffer = torch.from_file(call.path, shared=True, size=math.prod(call.shape),
                                         dtype=getattr(torch, call.dtype)).view(call.shape)  # fmt: skip


def _spill(state: RankState, call: Spill) -> None:
    assert state.spill_buffer is not None, "spill before map_spill_buffer"
    copy_out(state.shard.kv_pool, state.shard.kv_shard, call.page_ids, state.spill_buffer,
             call.slots)  # fmt: skip


#: each `radixserve.engine.tp_calls.TPCall`'s handler, the same on every rank
HANDLERS: dict[type, Callable[[RankState, Any], None]] = {
    StartAgent: _start_agent, MapSpillBuffer: _map_spill_buffer, Spill: _spill,
}  # fmt: skip


@torch.inference_mode()
def serve(shard: ModelShard, device: torch.device, compat: PoolCompat) -> None:
    """Run rank 0's steps and calls until it says stop."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    pool = shard.kv_pool
    state = RankState(shard, compat)
    while True:
        dist.broadcast(header, src=0)
        op = int(header[0])
        if op == OP_STOP:
            return
        if op == OP_COPY_PAGE:
            copy_page(pool, int(header[1]), int(header[2]))
            continue
        if op == OP_CALL:
            data = torch.empty(int(header[1]), dtype=torch.uint8)
            dist.broadcast(data, src=0)
            failed = torch.zeros(1, dtype=torch.int64)
            try:
                call = decode(bytes(data.numpy()))
                HANDLERS[type(call)](state, call)
            except Exception:
                logger.exception("tensor-parallel rank %d: call failed", shard.kv_shard.rank)
                failed += 1
            dist.all_reduce(failed)
            continue
        assert op == OP_FORWARD, f"unknown tensor-parallel op {op}"
        host = torch.empty(int(header[1]), dtype=torch.int64)
        dist.broadcast(host, src=0)
        fb = forward_batch_of(PackedStep.from_header(header[2:].tolist(), host), device)
        shard.model(fb.input_ids, fb.positions, pool.layers, fb.attn, fb.logits_indices)


if __name__ == "__main__":
    sys.exit(main())
