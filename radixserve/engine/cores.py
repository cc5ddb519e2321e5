"""The CPU cores of one host, shared by the workers started together (`CoreBoard`).

`radixserve up` starts a prefill and a decode worker on the same cores. Split evenly,
each computes on half of them even while the other has nothing to do; given all of
them, both oversubscribe the cores the moment both compute. The board sits between:
a small shared file (``core_board``) with one slot per worker, holding until when that
worker says it is computing. Before each step a worker marks itself busy and computes on
``num_threads // (workers busy now)`` threads (at least one); when it runs out of work
it clears its slot, so the others get its cores from their next step on.

A slot is claimed with a POSIX record lock on its bytes, which the kernel drops when
the process dies, and a busy mark is a deadline rather than a flag, so a worker that
dies mid-step stops counting within `HOLD_S` (or twice its last step, if longer).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time

SLOTS = 256
SLOT = struct.Struct("d")  # the slot's busy-until, on the CLOCK_MONOTONIC clock
HOLD_S = 2.0  # a busy mark lasts this long (or twice the last step) unless renewed

_claimed: set[tuple[int, int]] = set()  # (inode, slot): record locks do not exclude one process
_claimed_lock = threading.Lock()


class BoardFullError(RuntimeError):
    pass


class CoreBoard:
    """One worker's slot on the board at ``path`` (created if missing)."""

    def __init__(self, path: str, num_threads: int) -> None:
        self.path = path
        self.num_threads = num_threads
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_size < SLOTS * SLOT.size:
                os.ftruncate(self._fd, SLOTS * SLOT.size)
            self._inode = os.fstat(self._fd).st_ino
            self.slot = self._claim()
            self._map = mmap.mmap(self._fd, SLOTS * SLOT.size)
        except BaseException:
            os.close(self._fd)
            raise
        self._offset = self.slot * SLOT.size

    def _claim(self) -> int:
        with _claimed_lock:
            for slot in range(SLOTS):
                if (self._inode, slot) in _claimed:
                    continue
                try:
                    fcntl.lockf(
                        self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, SLOT.size, slot * SLOT.size
                    )
                except OSError:
                    continue  # another live process holds it
                _claimed.add((self._inode, slot))
                return slot
        raise BoardFullError(
            f"every one of the {SLOTS} slots of the core board {self.path} is taken"
        )

    def busy_workers(self, now: float | None = None) -> int:
        """How many workers on the board are computing (their mark not yet expired)."""
        now = time.monotonic() if now is None else now
        return sum(1 for (until,) in SLOT.iter_unpack(self._map) if until > now)

    def acquire(self, last_step_s: float = 0.0) -> int:
        """Mark this worker busy; its share of the threads for the step it starts."""
        now = time.monotonic()
        SLOT.pack_into(self._map, self._offset, now + max(HOLD_S, 2 * last_step_s))
        return max(1, self.num_threads // max(1, self.busy_workers(now)))

    def release(self) -> None:
        """This worker has nothing to compute: the others may take its cores."""
        SLOT.pack_into(self._map, self._offset, 0.0)

    def close(self) -> None:
        if self._fd < 0:
            return
        self.release()
        self._map.close()
        with _claimed_lock:
            _claimed.discard((self._inode, self.slot))
        # drops the record lock (and, POSIX being POSIX, any other lock this process holds
        # on the file: two boards on one file in one process are for tests only)
        os.close(self._fd)
        self._fd = -1


def board_path(directory: str, name: str) -> str:
    """The board file for the cluster called ``name`` under ``directory``."""
    return os.path.join(directory, f"radixserve-cores-{name}")
