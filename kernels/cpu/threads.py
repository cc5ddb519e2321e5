"""The thread pool the native CPU kernels split their work on.

A call's work is a range of independent items (column blocks of a GEMM, attention rows);
each item is computed whole by one thread, so how they are split never changes a bit of
the output. Small calls run in the caller: handing work to another thread costs about
30 µs, a decode step's GEMM call a few.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


def run_split(call: Callable[[int, int], None], items: int, parallel: bool) -> None:
    """call(begin, end) over items [0, items): in this thread, or in up to torch's number
    of threads contiguous ranges, the first in the caller."""
    parts = min(torch.get_num_threads(), items) if parallel else 1
    bounds = [items * i // parts for i in range(parts + 1)]
    _run([(call, bounds[i], bounds[i + 1]) for i in range(parts)])


def run_strided(call: Callable[[int, int], None], items: int, parallel: bool) -> None:
    """call(first, step) covering items [0, items) as first, first + step, ...: in this
    thread (0, 1), or one such stride per thread of up to torch's number, the first in
    the caller; for items whose cost grows along the range (attention rows), which
    contiguous ranges would split unevenly."""
    parts = min(torch.get_num_threads(), items) if parallel else 1
    _run([(call, i, parts) for i in range(parts)])


def _run(calls: list[tuple[Callable[[int, int], None], int, int]]) -> None:
    """Each (call, a, b) as call(a, b): the first in this thread, the others on the pool."""
    others = [_pool().submit(call, a, b) for call, a, b in calls[1:]]
    call, a, b = calls[0]
    call(a, b)
    for future in others:
        future.result()


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()),
                              thread_name_prefix="native-kernels")  # fmt: skip
