"""`radixserve bench --scenario peer`: radixserve against llama.cpp on the same GGUF file,
the same cores and the same requests, in one run.

Servers, each started fresh per mode and stopped when its run ends (`peer_servers.py`
for the peers):

- **radixserve**: `radixserve up` as `make serve` starts it (`LocalCluster` with the
  default `ClusterConfig`: kvstore, 1 prefill + 1 decode worker, NIXL, the cores shared
  between the workers by who computes; default engine settings). Busted: ``RADIXSERVE_PREFIX_CACHE=false``.
- **llama-server** (``-np 4`` slots with continuous batching, ``-t``/``-tb`` = the
  machine's cores). Busted: ``cache_prompt: false`` in every request.
- **llama-cpp-python** (one sequence at a time, the same threads). It reuses the
  longest common prefix with the last prompt it evaluated and has no per-request
  switch, so busted: a unique prefix per request (``Request N.`` at the start of the
  system message; a few more prompt tokens, nothing after the template's first
  tokens shared).

Workloads, in this order on every deployment, after one untimed warm-up request:

1. **multi-turn**: the suite's multi-turn chat (`workload.build_multi_turn`, the suite's
   preset sizes), one conversation at a time; the server's own answer to each turn is
   appended to the history, as in a real chat (the cache-on run answers; the busted run
   of the same server replays those answers, so its prompts are the same). System
   prompt and user turns are identical on every server; answers are each server's own,
   of the same token count (greedy, ``ignore_eos``, fixed ``max_tokens``), so prompt
   lengths agree within re-tokenisation (printed per round and server).
2. **shared-prefix load**: like aiperf's ``--shared-system-prompt-length 1500``: a
   ~1,500-token shared system message (the suite's RAG text, `workload.build_rag`),
   60-token questions, 24 output tokens; the first request alone, the rest
   ``concurrency`` at a time (so all but the first find the prefix cached).

Every request streams /v1/chat/completions (each server applies the GGUF's chat
template itself), temperature 0, fixed ``max_tokens``, ``ignore_eos`` where the server
honours it. TTFT: request sent → first content chunk (client side); ITL: gaps between
content chunks. A request that fails (HTTP error, broken stream, timeout) is counted
as an error, not measured. Results: `peer_report.py`.

Before the first server starts, with none running, the bench process measures the
rates of radixserve's compute floor (`compute_floor.py`: the GEMM on `FLOOR_ROWS` rows,
the native attention on those rows over the cached tokens of a conversation's first
and last cached turn), for the report's cached turns against their floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench import peer_servers as ps
from radixserve.bench.compute_floor import ComputeFloor, measure_compute_floor
from radixserve.bench.local_cluster import LocalCluster
from radixserve.bench.peer_options import (  # noqa: F401 - the bench CLI reads them here
    MODES,
    PEER_PRESETS,
    RADIXSERVE,
    SERVERS,
    WEIGHTS_NONE,
    Deployment,
    PeerOptions,
    PeerPreset,
    Target,
    TargetRun,
)
from radixserve.bench.report import Sample
from radixserve.bench.suite import BenchError, Client, Messages, run_multi_turn, run_rag
from radixserve.bench.workload import (
    MultiTurnSize,
    MultiTurnWorkload,
    RagWorkload,
    build_multi_turn,
    build_rag,
)
from radixserve.launch.cluster import ClusterConfig


class PeerClient(Client):
    """`Client` with the server's own request fields; a failure becomes an error sample,
    a stream without usage (llama-cpp-python's) a sample without token counts."""

    usage_required = False

    def __init__(self, http: httpx.AsyncClient, model: str, target: Target) -> None:
        super().__init__(http, model)
        self.target, self.sent = target, 0

    async def chat(self, messages: Messages, answer_tokens: int, round_: int) -> Sample:
        self.sent += 1
        if self.target.unique_prefix:
            head = messages[0]
            messages = [
                {**head, "content": f"Request {self.sent}. {head['content']}"},
                *messages[1:],
            ]
        body = {"messages": messages, "max_tokens": answer_tokens, **self.target.extra_body}
        try:
            return await self._stream("/v1/chat/completions", body, round_)
        except (BenchError, httpx.HTTPError, ValueError, KeyError) as exc:
            reason = f"{type(exc).__name__}: {exc}"[:300]
            return Sample(round_, 0, 0, 0, math.nan, text="", error=reason)


@dataclass(frozen=True)
class Workloads:
    multi_turn: MultiTurnWorkload
    load: RagWorkload


async def measure(
    url: str, target: Target, wl: Workloads, replay: list[list[str]] | None,
    options: PeerOptions,
) -> TargetRun:  # fmt: skip
    """Warm up, the multi-turn chat, the shared-prefix load, then (after everything timed)
    the prompt tokens the server counts for round 1's messages, unaltered."""
    timeout = httpx.Timeout(options.settings.request_timeout_s, connect=30.0)
    # A fresh connection per request: llama-server closes idle keep-alive connections
    # after 5 s, and a request sent on one as it closes fails ("Server disconnected").
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        models = (await http.get("/v1/models")).raise_for_status().json()["data"]
        client = PeerClient(http, models[0]["id"], target)
        warm = await client.chat([{"role": "user", "content": "Warm-up: say hi."}], 2, 0)
        if warm.error:
            raise BenchError(f"{target.server} failed the warm-up request: {warm.error}")
        total = sum(map(len, wl.multi_turn.conversations)) + len(wl.load.questions)
        desc = f"{target.server}, cache {target.mode}"
        with tqdm(total=total, desc=desc, unit="req", file=sys.stderr) as bar:
            mt = await run_multi_turn(client, wl.multi_turn, 1, replay, bar)
            load, _, _ = await run_rag(client, wl.load, options.preset.load.concurrency, bar)
        body = {"model": client.model, "messages": first_messages(wl.multi_turn),
                "max_tokens": 1, "temperature": 0}  # fmt: skip
        resp = await http.post("/v1/chat/completions", json=body)
        counted = resp.json().get("usage", {}).get("prompt_tokens") if resp.is_success else None
    return TargetRun(target, client.model, mt.run, mt.answers, load, counted)


def cluster_target(options: PeerOptions, mode: str) -> Target:
    """`radixserve up` with the `make serve` defaults; busted: the prefix cache off."""
    env = {"RADIXSERVE_MODEL": options.model}
    if mode == "busted":
        env["RADIXSERVE_PREFIX_CACHE"] = "false"
    if mode == WEIGHTS_NONE:  # the compute dtype instead of the GGUF's quantized weights
        env["RADIXSERVE_QUANTIZATION"] = "none"

    @contextlib.contextmanager
    def start() -> Iterator[Deployment]:
        config = ClusterConfig(port=0, engine_env=env)
        with LocalCluster(config) as cluster:
            yield Deployment(cluster.url, cluster_settings(config))

    busting = "RADIXSERVE_PREFIX_CACHE=false (a cluster with the prefix cache off)"
    return Target(
        RADIXSERVE, mode, start, {"ignore_eos": True}, False, busting if mode == "busted" else ""
    )


def cluster_settings(config: ClusterConfig) -> dict[str, Any]:
    """The processes `config` starts, their threads, and the engine settings every worker
    resolves from the environment (the defaults unless RADIXSERVE_* says otherwise)."""
    from radixserve.bench.local_cluster import threads_described
    from radixserve.engine.engine import resolve_device, resolve_dtype
    from radixserve.launch.cluster import cluster_specs
    from radixserve.settings import EngineSettings

    specs = cluster_specs(config)
    engine = EngineSettings(
        model=config.engine_env.get("RADIXSERVE_MODEL", "default"),
        prefix_cache=config.engine_env.get("RADIXSERVE_PREFIX_CACHE") != "false",
        quantization=config.engine_env.get("RADIXSERVE_QUANTIZATION", "auto"),
    )
    device = resolve_device(engine.device)
    return {
        "command": "radixserve up (the make serve defaults)",
        "processes": [s.name for s in specs],
        "transport": config.transport,
        "threads": threads_described(config),
        "device": str(device),
        "dtype": str(resolve_dtype(engine.dtype, device)).removeprefix("torch."),
        **engine.model_dump(
            include={
                "kv_cache_memory_gib",
                "page_size",
                "prefix_cache",
                "max_num_batched_tokens",
                "max_num_seqs",
                "quantization",
            }
        ),
    }


def peer_target(
    config: ps.PeerConfig, mode: str, options: PeerOptions, log_dir: Path, eos_ids: Sequence[int]
) -> Target:
    """llama-server busts with ``cache_prompt: false``, llama-cpp-python with a unique
    prefix. llama-cpp-python ignores ``ignore_eos``; a -100 bias on the end-of-sequence
    tokens does the same under greedy decoding."""

    @contextlib.contextmanager
    def start() -> Iterator[Deployment]:
        proc = ps.ServerProcess(config, options.settings.server_start_timeout_s, log_dir)
        with proc:
            command = " ".join(Path(a).name if "/" in a else a for a in config.argv)
            settings = {"command": command.replace("{port}", proc.url.rsplit(":", 1)[1]),
                        "argv": proc.argv, "log": str(proc.log_path)}  # fmt: skip
            if config.env:
                settings["env"] = config.env
            if proc.fell_back:
                settings["fallback"] = config.fallback_note
            yield Deployment(proc.url, settings)

    busted = mode == "busted"
    if config.name == ps.LLAMA_SERVER:
        body: dict[str, Any] = {"ignore_eos": True, **({"cache_prompt": False} if busted else {})}
        how = "cache_prompt: false in every request"
        return Target(config.name, mode, start, body, busting=how if busted else "")
    body = {"logit_bias": {str(i): -100 for i in eos_ids}}
    how = "a unique prefix per request ('Request N.' first in the system message)"
    return Target(config.name, mode, start, body, busted, how if busted else "")


def install_hint(venv: Path | None) -> str:
    where = venv or Path("/path/to/peer-venv")
    lines = "\n".join(f"  {c}" for c in ps.install_commands(where))
    return (
        f"to measure the llama.cpp peers, install them in a venv outside the repo:\n{lines}\n"
        f"then pass --peer-venv {where} (or set RADIXSERVE_BENCH_PEER_VENV={where}); "
        f"or build llama-server alone (no venv for it):\n{llama_server_hint()}"
    )


def llama_server_hint(root: Path = Path("/path/to/llama")) -> str:
    """How to build llama-server with CMake and point the benchmarks at it."""
    lines = "\n".join(f"  {c}" for c in ps.llama_server_build_commands(root))
    return f"{lines}\n(or pass --llama-server {root}/build/bin/llama-server)"


def find_peers(
    options: PeerOptions, model_path: Path
) -> tuple[list[ps.PeerConfig], dict[str, str]]:
    """The peers found in the venv, and the ones skipped with the reason."""
    venv = options.settings.peer_venv
    found: list[ps.PeerConfig] = []
    skipped: dict[str, str] = {}
    wanted = [name for name in ps.PEERS if name in options.servers]
    mt, load = options.preset.multi_turn, options.preset.load
    longest = mt.system_tokens + mt.rounds * (mt.user_tokens[1] + mt.answer_tokens[1] + 16)
    ctx = max(longest, load.doc_tokens_total + 256) + 128  # a whole conversation fits a slot
    if ps.LLAMA_SERVER in wanted:
        binary, why = ps.find_llama_server(options.settings)
        if binary is None:
            skipped[ps.LLAMA_SERVER] = why
        else:
            found.append(
                ps.llama_server_config(binary, model_path, options.threads, options.slots, ctx)
            )
    if ps.LLAMA_CPP_PYTHON in wanted:
        if venv is None:
            skipped[ps.LLAMA_CPP_PYTHON] = "no --peer-venv / RADIXSERVE_BENCH_PEER_VENV given"
        elif ps.has_llama_cpp_python(venv):
            found.append(ps.llama_cpp_python_config(venv, model_path, options.threads, ctx))
        else:
            skipped[ps.LLAMA_CPP_PYTHON] = f"llama-cpp-python[server] is not installed in {venv}"
    return [replace(c, env={**c.env, **options.peer_env}) for c in found], skipped


def build_workloads(options: PeerOptions, count: Callable[[str], int]) -> Workloads:
    return Workloads(
        build_multi_turn(options.preset.multi_turn, options.seed, count),
        build_rag(options.preset.load, options.seed, count),
    )


FLOOR_ROWS = (16, 32, 64, 128, 256)  # the rates' row counts: a cached turn's delta


def floor_prefix_lens(size: MultiTurnSize, first_prompt_tokens: int) -> tuple[int, int]:
    """About the cached tokens of a conversation's first cached turn (round 1's prompt
    and answer) and of its last (round 1's prompt and R − 1 turns of mean user message
    and answer)."""
    turn = statistics.fmean(size.user_tokens) + statistics.fmean(size.answer_tokens)
    first = first_prompt_tokens + size.answer_tokens[1]
    return first, max(first, round(first_prompt_tokens + (size.rounds - 1) * turn))


def measure_floor(
    options: PeerOptions, first_prompt_tokens: int
) -> tuple[ComputeFloor, dict[str, Any]]:
    prefix_lens = floor_prefix_lens(options.preset.multi_turn, first_prompt_tokens)
    print(f"peer: measuring the compute floor's rates (no server running) on {FLOOR_ROWS} "
          f"rows over {prefix_lens} cached tokens ...", file=sys.stderr)  # fmt: skip
    return measure_compute_floor(options.model, FLOOR_ROWS, prefix_lens)


def run_targets(
    targets: list[Target], wl: Workloads, options: PeerOptions,
    progress: Callable[[list[TargetRun], dict[str, str]], None] | None = None,
) -> tuple[list[TargetRun], dict[str, str]]:  # fmt: skip
    """Each target in turn (started, measured, stopped); one that cannot start or fails
    its warm-up is left out, with the reason (``"server mode": why``). ``progress`` is
    called after each target with what there is so far."""
    runs: list[TargetRun] = []
    failed: dict[str, str] = {}
    answers: dict[str, list[list[str]]] = {}  # each server's cache-on answers
    for target in targets:
        print(f"peer: starting {target.server}, cache {target.mode} ...", file=sys.stderr)
        try:
            with target.start() as deployment:
                run = asyncio.run(measure(deployment.url, target, wl, answers.get(target.server),
                                          options))  # fmt: skip
            run.settings = deployment.settings
            runs.append(run)
            if target.mode == "on":
                answers[target.server] = run.answers
        except (ps.ServerError, BenchError, TimeoutError, OSError, httpx.HTTPError) as exc:
            failed[f"{target.server} {target.mode}"] = str(exc)[:500]
            print(f"peer: {target.server} (cache {target.mode}) not measured: {exc}",
                  file=sys.stderr)  # fmt: skip
        if progress is not None:
            progress(runs, failed)
    return runs, failed


def run_peer_bench(options: PeerOptions) -> dict[str, Any]:
    """Run every server found, write the JSON (after each deployment, so a stopped run
    leaves what it measured), print the tables; the JSON document."""
    from radixserve.bench import peer_report
    from radixserve.model.checkpoint import load_checkpoint
    from radixserve.model.model_files import resolve_model_path

    model_path = resolve_model_path(options.model)
    if model_path.suffix != ".gguf":
        raise BenchError(f"--model {options.model}: llama.cpp needs a GGUF file, not {model_path}")
    tokenizer = load_checkpoint(options.model, progress=False).tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    wl = build_workloads(options, count)
    logs = ps.log_dir()
    peers, skipped = find_peers(options, model_path)
    if skipped:
        for name, reason in skipped.items():
            print(f"peer: skipping {name}: {reason}", file=sys.stderr)
        print(f"peer: {install_hint(options.settings.peer_venv)}", file=sys.stderr)
    targets = [cluster_target(options, m) for m in (*MODES, WEIGHTS_NONE)
               if RADIXSERVE in options.servers]  # fmt: skip
    eos = tokenizer.eos_token_ids
    targets += [peer_target(p, m, options, logs, eos) for p in peers for m in MODES]
    expected_prompt = len(tokenizer.encode_chat(first_messages(wl.multi_turn)))
    floor = measure_floor(options, expected_prompt) if RADIXSERVE in options.servers else None

    def document(runs: list[TargetRun], failed: dict[str, str]) -> dict[str, Any]:
        doc = peer_report.build_result(options, runs, skipped, peers, model_path,
                                       expected_prompt, floor)  # fmt: skip
        return {**doc, "not_measured": failed, "logs": str(logs)}

    def save(runs: list[TargetRun], failed: dict[str, str]) -> None:
        peer_report.write_json(document(runs, failed), options.out_path)

    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `with` blocks stop servers
    try:
        runs, failed = run_targets(targets, wl, options, save)
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc = document(runs, failed)
    peer_report.write(doc, options.out_path)
    return doc


def first_messages(wl: MultiTurnWorkload) -> Messages:
    """Conversation 1's round-1 messages (system prompt and first user turn)."""
    return [
        {"role": "system", "content": wl.system},
        {"role": "user", "content": wl.conversations[0][0].user},
    ]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
