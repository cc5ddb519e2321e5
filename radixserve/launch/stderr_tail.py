"""A supervised child's stderr: forwarded to the supervisor's own, its last lines kept to
tell why the child exited (`last_error`: the exception of its last traceback, else its last
line)."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
from collections.abc import Sequence

_TAIL_LINES = 64  # stderr lines kept per child, to tell why it exited
_ERROR_LINES = 8  # most lines of one error (pydantic's span a few)
_TAIL_WAIT_S = 1.0  # after an exit, for the last of its stderr to be read
_LOG_TIME = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.,]+ ")  # a log record's time


class StderrTail:
    """A child's stderr: read from a pipe on a thread, forwarded to this process's stderr
    (fd 2) line by line, the last lines kept."""

    def __init__(self, read_fd: int, name: str) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._pipe = os.fdopen(read_fd, "rb")
        self._thread = threading.Thread(target=self._read, name=f"stderr-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._pipe:
            for line in self._pipe:
                with contextlib.suppress(OSError):
                    os.write(2, line)
                self.lines.append(line.decode(errors="replace").rstrip())

    def error(self) -> str:
        """What the child said last about why it stopped (see `last_error`), once its
        stderr is read to the end (or `_TAIL_WAIT_S` passed: a descendant holds it)."""
        self._thread.join(_TAIL_WAIT_S)
        return last_error(list(self.lines))


def last_error(lines: Sequence[str]) -> str:
    """The exception of the last traceback in ``lines`` (the lines after its frames),
    else the last non-empty line without a log record's time; "" if none."""
    lines = [line for line in lines if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            rest = lines[i + 1 :]
            first = next((k for k, line in enumerate(rest) if not line.startswith(" ")), 0)
            return "\n".join(rest[first : first + _ERROR_LINES])
    return _LOG_TIME.sub("", lines[-1]) if lines else ""
