"""Micro-benchmark: a disk-tier hit's load, the disk read and the worker's host -> device
read one after the other against overlapped (the kvstore's ``disk_read_overlap``).

In one process, over real sockets and transfer agents: a kvstore (`KVStoreService`)
with a host tier holding a bit more than one prefix over a disk tier in ``--dir`` (a
temporary directory on this machine's disk by default, removed afterwards), and a
worker's host-tier client (`HostTierClient`) over a real engine whose pool has the
default model's page geometry (random weights: nothing is computed; 720 KiB float32
pages). ``--prefixes`` prefixes of ``--tokens`` tokens are written to the disk tier
(the host pool filled with random pages, then flushed), and each is then loaded as a
worker does on a disk hit: lookup, lease, read into device pages (`HostTierClient.plan`
and `read`), release. Looked up round robin, each evicts the one before from host
memory, so every load reads its pages from disk.

The kvstore runs with ``disk_read_overlap`` off and on in turns (``--rounds`` of each,
a restart on the same directory between them), and the table gives per mode the median
of the loads' wall time (lookup to the last page on device) and the ratio. Run
``python bench/disk_promotion.py [--tokens 4096] [--prefixes 6] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import zmq.asyncio

from radixserve.bench.random_checkpoint import random_checkpoint
from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.cache.page_proof import chain_proofs
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.model.model_files import open_model
from radixserve.runtime.host_tier import HostTierClient
from radixserve.runtime.links import LinkIdentity, LinkSet
from radixserve.runtime.settings import WorkerSettings
from radixserve.services.kvstore.disk_pool import DiskPool
from radixserve.services.kvstore.service import KVStoreService
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.settings import EngineSettings
from radixserve.transfer import BACKENDS, create_agent

PAGE = 16


def engine_of(model: str, num_pages: int) -> AsyncEngine:
    """An engine of ``model``'s geometry with random weights and ``num_pages`` pages."""
    config = dataclasses.replace(open_model(model).config, vocab_size=512)
    page_bytes = 2 * config.num_layers * PAGE * config.num_kv_heads * config.head_dim * 4
    settings = EngineSettings(device="cpu", dtype="float32", quantization="none",
                              kv_cache_memory_gib=(num_pages + 8) * page_bytes / (1 << 30),
                              page_size=PAGE)  # fmt: skip
    return AsyncEngine(Engine(settings, random_checkpoint(config)))


@contextlib.asynccontextmanager
async def kvstore(settings: KVStoreSettings) -> AsyncIterator[KVStoreService]:
    service = KVStoreService(settings)
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    try:
        while not service.serving:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 120)


@contextlib.asynccontextmanager
async def client_of(
    engine: AsyncEngine, address: str, transport: str
) -> AsyncIterator[HostTierClient]:
    """A worker's host-tier client linked to the kvstore at ``address`` (attached)."""
    info = engine.info
    context = zmq.asyncio.Context()
    agent = create_agent(transport, "w1", info.kv, info.geometry)
    settings = WorkerSettings(transfer_backend=transport, host_spill_buffer_mib=1,
                              host_load_min_tokens=0, host_lookup_timeout_s=60.0)  # fmt: skip
    client = HostTierClient("w1", 1, settings, engine, agent, set())
    me = LinkIdentity("w1", "decode", 1, interval_s=0.2, peer_timeout_s=60.0)
    links = LinkSet(context, [address], me, on_message=client.on_message,
                    on_up=client.on_up, on_down=client.on_down)  # fmt: skip
    links.start()
    try:
        while not client.attached:
            await asyncio.sleep(0.01)
        yield client
    finally:
        await links.close()
        await client.close()
        agent.close()
        context.term()


async def fill(
    service: KVStoreService, prompts: list[list[int]], prefixes: list[list[int]], namespace: bytes
) -> None:
    """Random pages for every prefix's hashes (with the tokens they are hashed from),
    written through the host tier to disk."""
    host, disk = service.host, disk_tier(service)
    assert host is not None and host.index is not None and host.kv is not None
    for prompt, hashes in zip(prompts, prefixes):
        proofs = chain_proofs(namespace, None, prompt[: len(hashes) * PAGE], hashes)
        reserved = host.index.reserve(hashes)  # evicts the prefix before: towards the disk
        for _, page in reserved:
            host.kv[:, :, page].normal_()
        host.index.commit([hashes[i] for i, _ in reserved], [proofs[i] for i, _ in reserved])
        while not disk.idle:  # the evicted prefix written before the next evicts this one
            await asyncio.sleep(0.01)
    await disk.flush(host.stored_pages())


def disk_tier(service: KVStoreService) -> DiskPool:
    (disk,) = service.tiers[1:]
    assert isinstance(disk, DiskPool)
    return disk


async def load(client: HostTierClient, rid: str, tokens: list[int], hashes: list[int]) -> float:
    """One disk hit as a worker loads it: the seconds from lookup to the pages on device."""
    start = time.perf_counter()
    planned = await client.plan(rid, tokens, hashes)
    assert planned is not None, "the kvstore leased nothing"
    plan, lease = planned
    try:
        assert lease.disk_pages == plan.num_pages == len(hashes), (lease.disk_pages, plan)
        assert await client.read(lease, tuple(range(plan.num_pages))), "the read failed"
    finally:
        client.release(lease)
    return time.perf_counter() - start


async def released(service: KVStoreService) -> None:
    """Wait until no host-tier lease is held (a worker's release is a message)."""
    assert service.host is not None and service.host.index is not None
    while service.host.index.num_leases:
        await asyncio.sleep(0.001)


async def run(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    pages = args.tokens // PAGE
    engine = engine_of(args.model, pages)
    namespace = hash_namespace("disk-promotion-bench")
    prompts = [[1000 * (i + 1) + t for t in range(args.tokens + 1)] for i in range(args.prefixes)]
    prefixes = [page_hashes(p, PAGE, namespace)[:pages] for p in prompts]
    page_bytes = engine.info.geometry.page_bytes
    common = {"host": "127.0.0.1", "port": 0, "transfer_backend": args.transport,
              "host_capacity_gib": 1.25 * pages * page_bytes / (1 << 30),
              "disk_tier_dir": root, "disk_flush_s": 600, "disk_tier_gib": 2 * args.prefixes * pages * page_bytes / (1 << 30)}  # fmt: skip
    times: dict[str, list[float]] = {"sequential": [], "overlapped": []}
    try:
        for r in range(2 * args.rounds):
            overlap = r % 2 == 1
            settings = KVStoreSettings(**common, disk_read_overlap=overlap)
            async with (
                kvstore(settings) as service,
                client_of(engine, service.address, args.transport) as client,
            ):
                while not disk_tier(service).ready:  # the rebuild from the files
                    await asyncio.sleep(0.01)
                if r == 0:
                    await fill(service, prompts, prefixes, namespace)
                await load(client, "warm-up", prompts[0], prefixes[0])  # connects the agents
                for i in range(1, args.prefixes):
                    await released(service)  # the lease before: its pages may be evicted
                    seconds = await load(client, f"r{r}-{i}", prompts[i], prefixes[i])
                    times["overlapped" if overlap else "sequential"].append(seconds)
    finally:
        engine.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where the disk tier's files go (default: a tmp dir)")
    parser.add_argument("--model", default="default", help="whose page geometry (default)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per prefix")
    parser.add_argument("--prefixes", type=int, default=6, help="prefixes (at least 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    parser.add_argument("--transport", choices=BACKENDS, default="nixl")
    args = parser.parse_args(argv)
    if args.prefixes < 2 or args.tokens < PAGE or args.rounds < 1:
        parser.error("need --prefixes >= 2, --tokens >= 16 and --rounds >= 1")
    root = Path(tempfile.mkdtemp(prefix="radixserve-promotion-", dir=args.dir))
    try:
        times = asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p50 = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
    print(f"disk-tier load of a {args.tokens}-token prefix ({args.tokens // PAGE} pages), "
          f"{args.transport}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| disk read, then device read | overlapped | overlapped / sequential |")
    print("|---|---|---|")
    print(f"| {p50['sequential']:.0f} ms (n={len(times['sequential'])}) | "
          f"{p50['overlapped']:.0f} ms (n={len(times['overlapped'])}) | "
          f"{p50['overlapped'] / p50['sequential']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
