"""``python -m radixserve.engine.tp_rank``: rank 1..N-1 of a worker's tensor-parallel
group, started by its rank 0 (`radixserve.engine.tp_group.TPGroup`) with the engine's
settings, its rank and the port of the group's store in the environment. It loads its
shard of the model and of the KV pool, then runs every step rank 0 sends until told to
stop."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from radixserve.engine.device import resolve_device, resolve_dtype
from radixserve.engine.model_shard import ModelShard, copy_page
from radixserve.engine.tp_group import (
    ENV_PORT,
    ENV_RANK,
    ENV_SETTINGS,
    HEADER_LEN,
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
from radixserve.settings import EngineSettings

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
    serve(shard, device)
    dist.destroy_process_group()
    return 0


@torch.inference_mode()
def serve(shard: ModelShard, device: torch.device) -> None:
    """Run rank 0's steps until it says stop."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    pool = shard.kv_pool
    while True:
        dist.broadcast(header, src=0)
        op = int(header[0])
        if op == OP_STOP:
            return
        if op == OP_COPY_PAGE:
            copy_page(pool, int(header[1]), int(header[2]))
            continue
        assert op == OP_FORWARD, f"unknown tensor-parallel op {op}"
        host = torch.empty(int(header[1]), dtype=torch.int64)
        dist.broadcast(host, src=0)
        fb = forward_batch_of(PackedStep.from_header(header[2:].tolist(), host), device)
        shard.model(fb.input_ids, fb.positions, pool.layers, fb.attn, fb.logits_indices)


if __name__ == "__main__":
    sys.exit(main())
