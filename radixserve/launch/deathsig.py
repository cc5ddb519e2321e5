"""Children that die with their parent (Linux's PR_SET_PDEATHSIG), for the supervisor,
its warm-start server and the benchmarks' peer servers."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@functools.lru_cache(maxsize=1)
def prctl() -> Callable[..., int]:
    """libc's prctl, loaded in the parent so the forked child does no dlopen."""
    fn = ctypes.CDLL(None, use_errno=True).prctl
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """In a forked child: get ``sig`` when the parent dies; exit at once if it already
    has (it died before the call: nobody to serve). Call `prctl()` before forking, so the child does no dlopen."""
    if prctl()(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def pdeathsig_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn making the child get ``sig`` when this process dies (Linux only)."""
    if sys.platform != "linux":
        return None
    prctl()
    parent_pid = os.getpid()
    return lambda: die_with_parent(parent_pid, sig)
