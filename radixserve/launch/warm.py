"""Warm starts: the worker processes forked from one that has imported torch already.

A worker's own start is short (a small model loads in a fraction of a second), but every
``python -m radixserve.services.decode`` first imports torch and the engine: about 1.5 s
of CPU per process, paid again by every restart after a crash and by every worker a pool
adds. `WarmServer` pays it once per supervisor: it runs ``python -m
radixserve.launch.warm``, a process that imports the modules it is given and then only
forks; each child becomes one ``python -m <module>``, exactly as a fresh process would
run it (its own environment, session and argv, stdin from /dev/null, its command line
rewritten to the one it stands for so ``ps`` and ``/proc/<pid>/cmdline`` show it).

The server imports and never runs anything: no thread pool is started before a fork
(torch starts its own on a child's first operation, with that child's thread count).
The supervisor drives it with one JSON message each way: ``{"module", "env", "args",
"fds", "stderr"}`` on a Unix ``SOCK_SEQPACKET`` socket, with the listening sockets the
child inherits (`radixserve.launch.listeners`) attached as ``SCM_RIGHTS`` (``fds`` names
the setting each one's number goes in) and, when ``stderr`` is true, after them the
descriptor the child's stderr goes to (the supervisor reads it: `Supervisor`'s fail
fast), answered by ``{"pid"}`` on a pipe, and
``{"exit": pid, "code"}`` when the server reaps a child (the code as
`subprocess.Popen.returncode` gives it). Children get SIGTERM when the
server dies and the server when the supervisor does (PR_SET_PDEATHSIG), so the chain
`Supervisor` documents holds; a server that dies is restarted by the next spawn.

Only Linux (fork after import is what the server is for; elsewhere `Supervisor` starts
fresh processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import json
import os
import queue
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

from radixserve.launch.deathsig import die_with_parent, pdeathsig_preexec, prctl

_REAP_INTERVAL_S = 0.05  # how often the server reaps its children
_SPAWN_TIMEOUT_S = 60.0  # the server answers a fork at once; the first waits for imports
_MAX_REQUEST_BYTES = 1 << 20  # one request: the child's environment and command line
_MAX_FDS = 16  # sockets one child inherits


def available() -> bool:
    """Whether warm starts work on this platform."""
    return sys.platform == "linux"


class WarmProcess:
    """A child of the server, with the part of `subprocess.Popen`'s interface the
    supervisor uses (its exit code arrives from the server, which reaps it)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped yet, so the pid is still this child's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmServer:
    """The supervisor's side: starts the server on first use, forks children through it."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)  # imported by the server, and the ones it may run
        self._proc: subprocess.Popen[bytes] | None = None
        self._to: socket.socket | None = None
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        self._children: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits read before their spawn registered them

    def spawn(
        self,
        module: str,
        env: Mapping[str, str],
        args: list[str],
        fds: Mapping[str, int] | None = None,
        stderr: int | None = None,
    ) -> WarmProcess:
        """Fork ``python -m module`` with exactly ``env`` (``args``: its command line),
        inheriting the descriptors ``fds`` (setting -> descriptor here: in the child the
        setting holds its number there), its stderr ``stderr`` (None: the server's)."""
        if module not in self.modules:
            raise ValueError(f"{module} is not one of the warm server's modules")
        passed = [*(fds or {}).values(), *([] if stderr is None else [stderr])]
        if len(passed) > _MAX_FDS:
            raise ValueError(f"a warm child inherits at most {_MAX_FDS} descriptors")
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        assert self._to is not None
        request = {"module": module, "env": dict(env), "args": args, "fds": list(fds or {}),
                   "stderr": stderr is not None}  # fmt: skip
        data = json.dumps(request).encode()
        try:
            socket.send_fds(self._to, [data], passed)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # not sent; the server and its children are fine
                raise OSError(f"the request to fork {module} is too large for the warm-start "
                              f"server ({len(data)} bytes)") from exc  # fmt: skip
            self.close()
            raise OSError(f"the warm-start server did not fork {module}: {exc}") from exc
        try:
            reply = self._replies.get(timeout=_SPAWN_TIMEOUT_S)
        except queue.Empty as exc:
            self.close()
            raise OSError(f"the warm-start server did not fork {module}: {exc}") from exc
        if "error" in reply:
            raise OSError(f"the warm-start server cannot run {module}: {reply['error']}")
        child = WarmProcess(int(reply["pid"]), args)
        with self._lock:
            self._children[child.pid] = child
            if child.pid in self._early:
                child._exit(self._early.pop(child.pid))
        return child

    def close(self) -> None:
        """Stop the server (its remaining children get SIGTERM)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._to is not None:
            with contextlib.suppress(OSError):
                self._to.close()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def _start(self) -> None:
        requests, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        to_server = server_end.detach()  # the server reads its requests there
        from_server, to_supervisor = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __name__,
                    str(to_server),
                    str(to_supervisor),
                    *self.modules,
                ],  # fmt: skip
                pass_fds=(to_server, to_supervisor),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(signal.SIGKILL),
            )
        finally:
            os.close(to_server)
            os.close(to_supervisor)
        self._to = requests
        self._replies = queue.Queue()
        reader = threading.Thread(
            target=self._read, args=(os.fdopen(from_server, "rb"),), daemon=True,
            name="warm-start",
        )  # fmt: skip
        reader.start()

    def _read(self, pipe: IO[bytes]) -> None:
        """The server's replies and exit notices; at its end, every child is gone too."""
        with pipe:
            for line in pipe:
                message = json.loads(line)
                if "exit" in message:
                    self._on_exit(int(message["exit"]), int(message["code"]))
                else:
                    self._replies.put(message)
        with self._lock:  # the server died: PR_SET_PDEATHSIG has sent its children SIGTERM
            live = [c for c in self._children.values() if c.returncode is None]
        for child in live:
            child.kill()
            self._on_exit(child.pid, -signal.SIGKILL)

    def _on_exit(self, pid: int, code: int) -> None:
        with self._lock:
            child = self._children.pop(pid, None)
            if child is None:
                self._early[pid] = code
        if child is not None:
            child._exit(code)


# ---- the server process ------------------------------------------------------------


def _set_cmdline(args: Sequence[str]) -> None:
    """Rewrite this process's command line in place (the kernel's argument area, whose
    bounds /proc/self/stat gives), cut to its size: what ``ps`` shows."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    data = ("\0".join(args).encode() + b"\0")[: end - start - 1]
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


def _child(
    request: dict[str, Any], fds: Sequence[int], server_pid: int, stderr: int | None
) -> None:
    """In the forked child: become ``python -m module`` and run it (closing the server's
    descriptors ``fds``, writing its stderr to ``stderr`` when given); never returns."""
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        if stderr is not None:
            os.dup2(stderr, 2)
            os.close(stderr)
        os.setsid()
        die_with_parent(server_pid)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        _set_cmdline(request["args"])
        sys.argv = [request["module"], *request["args"][3:]]  # [0]: the module's file, next
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(read_fd: int, write_fd: int, modules: Sequence[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    prctl()  # loaded before any fork
    out = os.fdopen(write_fd, "wb", buffering=0)
    requests = socket.socket(fileno=read_fd)  # SOCK_SEQPACKET: one message a request
    server_pid = os.getpid()

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message).encode() + b"\n")

    while True:
        while True:  # reap
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([read_fd], [], [], _REAP_INTERVAL_S)
        if not ready:
            continue
        data, fds, flags, _ = socket.recv_fds(requests, _MAX_REQUEST_BYTES, _MAX_FDS)
        if not data:
            return  # the supervisor closed its end, or died
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                send({"error": "the request was cut (too large, or too many sockets)"})
                continue
            send(_fork(json.loads(data), fds, modules, (read_fd, write_fd), server_pid))
        finally:
            for fd in fds:  # the child has its copies
                os.close(fd)


def _fork(
    request: dict[str, Any],
    fds: list[int],
    modules: Sequence[str],
    own: Sequence[int],
    server_pid: int,
) -> dict[str, Any]:
    """Fork the child ``request`` asks for, with the descriptors ``fds`` received with it;
    the answer to send."""
    if request["module"] not in modules:
        return {"error": f"{request['module']} is not one of {', '.join(modules)}"}
    names = request.get("fds", [])
    stderr = fds[-1] if request.get("stderr") and fds else None
    expected = len(names) + bool(request.get("stderr"))
    if expected != len(fds):
        return {"error": f"expected {expected} descriptors, received {len(fds)}"}
    request["env"].update({name: str(fd) for name, fd in zip(names, fds)})
    pid = os.fork()
    if pid == 0:
        _child(request, own, server_pid, stderr)
    return {"pid": pid}


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
