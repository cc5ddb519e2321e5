"""A small process supervisor: `radixserve up` runs the gateway and workers under it.

Each `ProcessSpec` becomes one OS process. `start()` spawns them in order, `poll()` does
one non-blocking supervision pass (reap, log, restart), `run()` loops `poll()` until
SIGINT/SIGTERM and then calls `stop()`, which shuts the children down.

Contracts:
  * Children get `os.environ` with `spec.env` on top, inherit stdout/stderr, and read
    stdin from /dev/null. With a `WarmServer`, a spec that runs one of its modules
    (``[sys.executable, "-m", module]``) is forked from it (`radixserve.launch.warm`)
    under the same contracts; if the server cannot fork it, it starts afresh.
  * Every child starts in its own session (`start_new_session=True`), so a Ctrl-C in the
    terminal reaches only the supervisor; the supervisor then stops the children itself,
    in reverse start order (the gateway stops taking requests before the workers go).
  * On Linux every child has PR_SET_PDEATHSIG=SIGTERM: if the supervisor dies, even by
    SIGKILL, its children get SIGTERM. The signal follows the *thread* that spawned the
    child, so call `start()`/`poll()`/`run()` from a thread that lives as long as the
    supervisor (the main thread in practice).
  * A child that exits on its own is restarted when `restart=True`, after a backoff that
    starts at `restart_backoff_s`, doubles per consecutive quick crash up to
    `max_backoff_s`, and resets once the child had lived more than 60 s. A child with
    `restart=False` stays down.
  * Fail fast: while `run()` waits for its `ready()` to pass the first time, a child
    that exits twice in a row with the same error (its exit code and what it said last
    on stderr: the exception of its last traceback, else its last line) is not
    restarted: `run()` stops everything and returns 1, the error in `failure`. A
    configuration error thus stops `radixserve up` with its message instead of a
    restart loop; once ready, every crash is restarted as above. Each child's stderr
    passes through the supervisor (a pipe and a thread per child, forwarded line by
    line to the supervisor's own stderr) so that its last lines are known.
  * `start()` raises `SupervisorError` naming the process whose command cannot be run,
    after stopping the processes it had already started.
  * `stop()` is idempotent: SIGTERM to each live child, a shared wait of at most
    `stop_timeout_s`, then SIGKILL to the process group of each straggler; every child
    is reaped, so none is left a zombie. A stopped supervisor restarts nothing.
  * The set changes at run time: `add(spec)` starts one more process; `retire(name,
    timeout_s)` sends it SIGTERM (a worker drains, then exits 0), never restarts it,
    SIGKILLs its group if it is still running after `timeout_s`, and forgets it once it
    has exited (its exit code stays in `retired`).
  * A spec's `sockets` (setting name -> `Listener`, `radixserve.launch.listeners`) are
    listening sockets the supervisor holds and the process inherits, the setting set to
    the descriptor's number: every incarnation of the process gets the same socket, so
    its port never changes. They are closed when the process is retired or the
    supervisor stops.
  * Signal handlers only set a flag. A Supervisor is not thread-safe and starts once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from radixserve.errors import RadixServeError
from radixserve.launch.deathsig import pdeathsig_preexec
from radixserve.launch.listeners import Listener
from radixserve.launch.stderr_tail import StderrTail
from radixserve.launch.warm import WarmProcess, WarmServer

logger = logging.getLogger(__name__)

_STABLE_AFTER_S = 60.0  # a child that lived this long resets its restart backoff
_POLL_INTERVAL_S = 0.1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SupervisorError(RadixServeError):
    """A supervised process cannot be started, or the supervisor is misused."""


@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process: a name for logs and `pid()`, and how to run it."""

    name: str  # e.g. "gateway", "prefill-0", "decode-0"
    argv: list[str]  # full command line, e.g. [sys.executable, "-m", "radixserve.cli", ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added on top of os.environ
    restart: bool = True  # restart it when it exits on its own
    #: listening sockets it inherits: setting (e.g. RADIXSERVE_KVSTORE_LISTEN_FD) -> socket
    sockets: Mapping[str, Listener] = field(default_factory=dict)

    def close_sockets(self) -> None:
        for listener in self.sockets.values():
            listener.close()


@dataclass
class _Child:
    """Mutable supervision state of one spec."""

    spec: ProcessSpec
    backoff_s: float  # delay before the next restart
    proc: subprocess.Popen[bytes] | WarmProcess | None = None  # None while down
    started_at: float = 0.0  # time.monotonic() of the last spawn
    num_restarts: int = 0
    restart_at: float | None = None  # time.monotonic() of a pending restart
    retire_by: float | None = None  # retiring: SIGKILL if still running at this time
    stderr: StderrTail | None = None  # the running incarnation's
    last_failure: tuple[int, str] | None = None  # (code, error) of its last exit before ready


def _describe_exit(returncode: int) -> str:
    """'code 3' or 'code -9 (signal SIGKILL)'."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"code {returncode} (signal {name})"


class Supervisor:
    """Starts, restarts and stops a fixed set of processes; see the module docstring."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        restart_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        warm: WarmServer | None = None,
    ) -> None:
        if not 0 < restart_backoff_s <= max_backoff_s:
            raise ValueError("need 0 < restart_backoff_s <= max_backoff_s")
        if stop_timeout_s < 0:
            raise ValueError("stop_timeout_s must be >= 0")
        self.restart_backoff_s = restart_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stop_timeout_s = stop_timeout_s
        self._warm = warm  # forks the processes that run one of its modules
        self._children: list[_Child] = []
        self._by_name: dict[str, _Child] = {}
        self._started = False
        self._stopped = False
        self._signal: int | None = None  # set by the signal handler, read by run()
        self._fail_fast = False  # run() before ready: the same error twice stops it
        self.failure: str | None = None  # why run() stopped failing fast
        self.retired: dict[str, int] = {}  # name -> exit code of each retired process
        for spec in specs:
            self.add(spec)

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Spawn every process in order; on failure stop the ones already started."""
        if self._started:
            raise SupervisorError("supervisor already started")
        self._started = True
        for child in self._children:
            try:
                self._spawn(child)
            except (OSError, subprocess.SubprocessError) as e:
                self.stop()
                raise SupervisorError(
                    f"cannot start process {child.spec.name!r} ({shlex.join(child.spec.argv)}): {e}"
                ) from e

    def add(self, spec: ProcessSpec) -> None:
        """Supervise one more process (started now if the others are), named uniquely."""
        if spec.name in self._by_name:
            raise ValueError(f"process names must be unique: {spec.name!r} is already supervised")
        if not spec.argv:
            raise ValueError("every ProcessSpec needs a non-empty argv")
        if self._stopped:
            raise SupervisorError("the supervisor is stopped")
        child = _Child(spec=spec, backoff_s=self.restart_backoff_s)
        self._children.append(child)
        self._by_name[spec.name] = child
        if self._started:
            try:
                self._spawn(child)
            except (OSError, subprocess.SubprocessError) as e:
                self._forget(child)
                raise SupervisorError(f"cannot start process {spec.name!r}: {e}") from e

    def retire(self, name: str, timeout_s: float) -> None:
        """SIGTERM ``name`` and never restart it; SIGKILL after ``timeout_s``; forgotten
        (exit code in `retired`) once it has exited."""
        child = self._child(name)
        if child.retire_by is not None:
            return
        child.retire_by = time.monotonic() + timeout_s
        child.restart_at = None
        if child.proc is not None and child.proc.poll() is None:
            logger.info("retiring %s (pid %d)", name, child.proc.pid)
            child.proc.send_signal(signal.SIGTERM)

    def names(self) -> list[str]:
        """Every supervised process, retiring ones included, in start order."""
        return [c.spec.name for c in self._children]

    def spec(self, name: str) -> ProcessSpec:
        return self._child(name).spec

    def retiring(self, name: str) -> bool:
        return self._child(name).retire_by is not None

    def _forget(self, child: _Child) -> None:
        self._children.remove(child)
        del self._by_name[child.spec.name]
        child.spec.close_sockets()

    def _poll_retiring(self, child: _Child, now: float) -> None:
        assert child.retire_by is not None
        proc = child.proc
        if proc is not None and proc.poll() is None:
            if now >= child.retire_by:
                logger.warning("%s still running past its drain; sending SIGKILL", child.spec.name)
                self._kill_group(proc)
                proc.wait()
            else:
                return
        code = proc.wait() if proc is not None else 0  # exited: its code at once
        logger.info("%s retired (%s)", child.spec.name, _describe_exit(code))
        self.retired[child.spec.name] = code
        self._forget(child)

    def poll(self) -> None:
        """One supervision pass: reap exited children, restart those whose backoff is up."""
        if self._stopped:
            return
        now = time.monotonic()
        for child in list(self._children):
            if child.retire_by is not None:
                self._poll_retiring(child, now)
                continue
            if child.proc is not None and (code := child.proc.poll()) is not None:
                self._on_exit(child, code, now)
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.num_restarts += 1
                try:
                    self._spawn(child)
                except (OSError, subprocess.SubprocessError) as e:
                    logger.error("cannot restart %s: %s", child.spec.name, e)
                    self._schedule_restart(child, now, lived_s=0.0)

    def run(
        self,
        ready: Callable[[], bool] | None = None,
        on_ready: Callable[[], None] | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> int:
        """Supervise until SIGINT (returns 130) or SIGTERM (returns 0); main thread only.

        `on_ready()` is called once, the first time `ready()` returns True (at once when
        `ready` is None); `on_poll()` after every supervision pass (it may `add` and
        `retire`). Returns 1 if every process is down and none will restart, or if a
        process exited twice with the same error before `ready()` passed (`failure`
        says which and why).
        """
        self._fail_fast = ready is not None
        if not self._started:
            self.start()
        self._signal = None
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        try:
            is_ready = False
            while self._signal is None:
                self.poll()
                if self.failure is not None:
                    logger.error("%s; stopping", self.failure)
                    return 1
                if on_poll is not None:
                    on_poll()
                if not is_ready and (ready is None or ready()):
                    is_ready = True
                    self._fail_fast = False
                    logger.info("processes ready")
                    if on_ready is not None:
                        on_ready()
                if not any(c.proc is not None or c.restart_at is not None for c in self._children):
                    logger.error("every process has exited and none will restart")
                    return 1
                time.sleep(_POLL_INTERVAL_S)
            logger.info("received %s; shutting down", signal.Signals(self._signal).name)
            return 130 if self._signal == signal.SIGINT else 0
        finally:
            self.stop()  # with our handlers still in place: a second Ctrl-C is ignored
            for sig, old in handlers.items():
                signal.signal(sig, old)

    def stop(self) -> None:
        """SIGTERM every live child (reverse order), wait, SIGKILL stragglers, reap all."""
        if self._stopped:
            return
        self._stopped = True
        live = [c for c in reversed(self._children) if c.proc is not None]
        for child in self._children:
            child.restart_at = None
        if live:
            logger.info("stopping %s", ", ".join(c.spec.name for c in live))
        for child in live:
            assert child.proc is not None
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in live:
            assert child.proc is not None
            try:
                code = child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) still running %gs after SIGTERM; sending SIGKILL",
                    child.spec.name,
                    child.proc.pid,
                    self.stop_timeout_s,
                )
                self._kill_group(child.proc)
                code = child.proc.wait()
            logger.info("%s stopped (%s)", child.spec.name, _describe_exit(code))
            child.proc = None
        for child in self._children:
            child.spec.close_sockets()
        if self._warm is not None:
            self._warm.close()

    # ---- queries ------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        """The pid of `name` if it is running, else None."""
        proc = self._child(name).proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    @property
    def restarts(self) -> dict[str, int]:
        """How many times each process has been restarted (a copy)."""
        return {c.spec.name: c.num_restarts for c in self._children}

    # ---- internals ----------------------------------------------------------------

    def _child(self, name: str) -> _Child:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no process named {name!r}") from None

    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        fds = {name: listener.fileno() for name, listener in spec.sockets.items()}
        env = {**os.environ, **spec.env, **{name: str(fd) for name, fd in fds.items()}}
        module = self._warm_module(spec.argv)
        read_fd, write_fd = os.pipe()  # the child's stderr (`StderrTail`)
        try:
            if module is not None:
                assert self._warm is not None
                try:
                    child.proc = self._warm.spawn(module, env, list(spec.argv), fds, write_fd)
                except OSError as e:
                    logger.warning("%s: warm start failed (%s); starting it afresh",
                                   spec.name, e)  # fmt: skip
                    module = None
            if module is None:
                child.proc = subprocess.Popen(
                    spec.argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stderr=write_fd,
                    start_new_session=True,
                    preexec_fn=pdeathsig_preexec(),
                    pass_fds=tuple(fds.values()),
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child has its copy: its exit ends the tail
        child.stderr = StderrTail(read_fd, spec.name)
        child.started_at = time.monotonic()
        assert child.proc is not None
        logger.info("started %s (pid %d%s): %s", spec.name, child.proc.pid,
                    ", warm" if module else "", shlex.join(spec.argv))  # fmt: skip

    def _warm_module(self, argv: Sequence[str]) -> str | None:
        """The module ``argv`` runs (``python -m module``) when the warm server runs it."""
        if self._warm is None or len(argv) != 3 or argv[:2] != [sys.executable, "-m"]:
            return None
        return argv[2] if argv[2] in self._warm.modules else None

    def _on_exit(self, child: _Child, returncode: int, now: float) -> None:
        child.proc = None
        how = _describe_exit(returncode)
        if self._fail_fast and child.spec.restart and child.stderr is not None:
            failure = (returncode, child.stderr.error())
            if failure == child.last_failure:  # twice in a row, before ever ready
                self.failure = (f"{child.spec.name} exited with {how} twice before the "
                                f"cluster was ready: {failure[1] or 'no message'}")  # fmt: skip
                return
            child.last_failure = failure
        if not child.spec.restart:
            logger.warning(
                "%s exited with %s; not restarting (restart=False)", child.spec.name, how
            )
            return
        delay = self._schedule_restart(child, now, lived_s=now - child.started_at)
        logger.warning(
            "%s exited with %s; restarting in %gs (restart #%d)",
            child.spec.name,
            how,
            delay,
            child.num_restarts + 1,
        )

    def _schedule_restart(self, child: _Child, now: float, lived_s: float) -> float:
        """Set the restart time of `child` and grow its backoff; returns the delay."""
        if lived_s > _STABLE_AFTER_S:
            child.backoff_s = self.restart_backoff_s
        delay = child.backoff_s
        child.backoff_s = min(2 * delay, self.max_backoff_s)
        child.restart_at = now + delay
        return delay

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes] | WarmProcess) -> None:
        """SIGKILL the child and its process group (it leads one: start_new_session=True)."""
        # The pid is not reaped yet, so it cannot have been reused. The group can be empty
        # if the child moved to another one: then only the kill below reaches it.
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum  # only a flag: run() does the work
