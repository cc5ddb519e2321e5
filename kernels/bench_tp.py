"""The tensor-parallel section of the kernels' benchmark (`radixserve.kernels.bench`):
all-reduce bandwidth over the GPUs of one machine, against the link's own copy rate.

A tensor-parallel step all-reduces its hidden states twice per layer (after o and after
down): a decode step's rows (batch x hidden) and a prefill chunk's (tokens x hidden).
Each size is timed on N ranks (NCCL, one process per GPU, all the machine's GPUs up to
8) as bus bandwidth, ``2 (N - 1) / N x bytes / time`` (what each link carries), beside the
GPU 0 -> GPU 1 copy rate measured here. Skipped, with a row saying so, on one GPU;
``--dry-run`` runs it on two CPU ranks over gloo at tiny sizes so that it cannot rot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 20


def _rank(
    rank: int, size: int, port: int, sizes: list[int], dtype: torch.dtype, cuda: bool, out
) -> None:
    """One rank: join (the caller serves the store on ``port``), time an all-reduce of
    each size; rank 0 reports µs per size."""
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size)
    try:
        times = []
        for numel in sizes:
            x = torch.ones(numel, dtype=dtype, device=device)
            dist.all_reduce(x)  # warm-up: connections, buffers
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(REPS):
                dist.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / REPS * 1e6)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def link_gbps(numel: int, dtype: torch.dtype) -> float:
    """GPU 0 -> GPU 1 copy rate (GB/s) of ``numel`` elements: the link's ceiling."""
    src = torch.ones(numel, dtype=dtype, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        dst.copy_(src)
    torch.cuda.synchronize()
    return src.nbytes * REPS / (time.perf_counter() - t0) / 1e9


@dataclass(frozen=True)
class AllReduce:
    rows: int  # of the hidden states all-reduced
    ranks: int
    bytes: int
    us: float
    bus_gbps: float
    link_gbps: float | None  # GPU 0 -> GPU 1 copy rate (None on CPU)


def measure_all_reduce(
    device: torch.device, dtype: torch.dtype, hidden: int, rows: list[int]
) -> list[AllReduce] | str:
    """An all-reduce of ``rows`` x ``hidden`` for each of ``rows`` on every GPU (up to 8;
    on CPU two gloo ranks), or why it was skipped."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        return f"skipped: {gpus} GPU here (tensor parallelism needs two or more)"
    size = min(gpus, 8) if gpus else 2
    sizes = [r * hidden for r in rows]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port: any
    procs = [ctx.Process(target=_rank, args=(r, size, store.port, sizes, dtype, gpus > 0, out))
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"all-reduce ranks exited with {[p.exitcode for p in procs]}")
    times = out.get()
    element = torch.empty((), dtype=dtype).element_size()
    link = link_gbps(max(sizes), dtype) if gpus else None
    return [
        AllReduce(r, size, n * element, us, 2 * (size - 1) / size * n * element / us / 1e3, link)
        for r, n, us in zip(rows, sizes, times)
    ]


def rows_of(found: list[AllReduce] | str, hidden: int, num: Callable[[float], str]) -> list[dict]:
    """The benchmark table's rows (`bench.Row` fields but the section) of a measurement."""
    if isinstance(found, str):
        return [{"case": "all-reduce", "achieved": found}]
    rows = []
    for m in found:
        link = f" (link {num(m.link_gbps)} GB/s)" if m.link_gbps else ""
        rows.append({
            "case": f"all-reduce {m.rows} x {hidden} over {m.ranks} ranks", "reference_us": m.us,
            "achieved": f"{num(m.bus_gbps)} GB/s bus{link}",
            "of_ceiling": m.bus_gbps / m.link_gbps if m.link_gbps else None,
            "extra": asdict(m),
        })  # fmt: skip
    return rows
