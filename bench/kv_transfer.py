"""Micro-benchmark: moving N KV pages between two processes vs a plain memcpy.

An owner process holds a pool filled with a checkable pattern; this process reads N
scattered pages (every layer, K and V) with a transfer backend, verifies every byte,
and reports GB/s next to a `torch` memcpy of the same number of bytes measured in the
same run. Run ``python bench/kv_transfer.py`` to print both backends' figures for a
SmolLM2-135M-shaped pool (30 layers, 3 KV heads, head_dim 64, page 16, fp32).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.transfer import BACKENDS, PoolCompat, TransferError, create_agent  # noqa: E402

logger = logging.getLogger(__name__)

SMOLLM2_SHAPE = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "page_size": 16}


def _pool(shape: dict[str, int], num_pages: int) -> tuple[KVPool, PoolCompat]:
    pool = KVPool(
        shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], shape["page_size"],
        num_pages, torch.float32, torch.device("cpu"),
    )  # fmt: skip
    return pool, PoolCompat.of(pool.kv, "bench")


def _pattern(num_regions: int, num_pages: int, page_elems: int) -> torch.Tensor:
    """(R, P, E) values: region/page id plus a small per-element ramp (all exact)."""
    ids = torch.arange(num_regions * num_pages, dtype=torch.float32).view(num_regions, -1, 1)
    return ids * 8 + (torch.arange(page_elems, dtype=torch.float32) % 7).view(1, 1, -1)


def _owner_main(conn: Connection, backend: str, shape: dict[str, int], num_pages: int) -> None:
    """Owner process: fill a pool with `_pattern`, serve it until told to stop."""
    pool, compat = _pool(shape, num_pages)
    regions, elems = pool.kv.shape[0] * 2, pool.kv[0, 0, 0].numel()
    pool.kv.view(regions, num_pages, elems).copy_(_pattern(regions, num_pages, elems))
    agent = create_agent(backend, "bench-owner", pool.kv, compat)
    conn.send(agent.metadata())
    try:
        while not conn.poll(0.0002):  # serve until told to stop
            agent.serve_reads()
    finally:
        agent.close()


def _verify(kv: torch.Tensor, remote: list[int], local: list[int], remote_pages: int) -> None:
    regions, elems = kv.shape[0] * 2, kv[0, 0, 0].numel()
    got = kv.view(regions, kv.shape[2], elems)[:, local]
    want = _pattern(regions, remote_pages, elems)[:, remote]
    if not torch.equal(got, want):
        raise TransferError("benchmark transfer delivered wrong page contents")


def _memcpy_seconds(num_bytes: int, repeats: int) -> list[float]:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times[1:]


def measure_transfer(
    backend: str,
    num_pages: int,
    shape: dict[str, int] | None = None,
    repeats: int = 5,
    scattered: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Read `num_pages` pages from a second process `repeats` times; GB/s vs memcpy.

    Pages are chosen at random from pools of 2 * `num_pages` (or taken consecutively
    when `scattered` is False). Every transfer is verified before it is counted.
    """
    shape = dict(shape or SMOLLM2_SHAPE)
    pool_pages = 2 * num_pages
    rng = random.Random(seed)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner_main, args=(child, backend, shape, pool_pages))
    owner.start()
    pool, compat = _pool(shape, pool_pages)
    agent = create_agent(backend, "bench-reader", pool.kv, compat, default_timeout_s=60.0)
    try:
        if not parent.poll(120):
            raise TransferError("benchmark owner process did not start")
        agent.add_peer("bench-owner", 1, parent.recv())
        times = []
        for i in range(repeats + 1):  # the first read warms connections up
            ids = list(range(pool_pages))
            remote = rng.sample(ids, num_pages) if scattered else ids[:num_pages]
            local = rng.sample(ids, num_pages) if scattered else ids[num_pages:]
            pool.kv.zero_()
            start = time.perf_counter()
            agent.wait(agent.read_pages("bench-owner", remote, local))
            if i:
                times.append(time.perf_counter() - start)
            _verify(pool.kv, remote, local, pool_pages)
    finally:
        agent.close()
        parent.send("stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    num_bytes = num_pages * PoolCompat.of(pool.kv, "bench").page_bytes
    memcpy = _memcpy_seconds(num_bytes, repeats)
    gbps = num_bytes / min(times) / 1e9
    memcpy_gbps = num_bytes / min(memcpy) / 1e9
    return {
        "backend": backend,
        "num_pages": num_pages,
        "scattered": scattered,
        "bytes": num_bytes,
        "descriptors": num_pages * shape["num_layers"] * 2,
        "transfer_ms_best": min(times) * 1e3,
        "transfer_ms_median": statistics.median(times) * 1e3,
        "gbps": gbps,
        "memcpy_gbps": memcpy_gbps,
        "fraction_of_memcpy": gbps / memcpy_gbps,
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    for backend in BACKENDS:
        for scattered in (True, False):
            try:
                result = measure_transfer(backend, 256, scattered=scattered)
            except TransferError as exc:
                print(f"{backend}: unavailable ({exc})")
                continue
            print(json.dumps(result))


if __name__ == "__main__":
    main()
