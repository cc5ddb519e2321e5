"""`radixserve bench --scenario decode`: decode inter-token latency with B concurrent
greedy streams, each at a context of C tokens, radixserve against llama-server on the
same GGUF file, each beside the memory floor of its step.

Servers, one after the other (never both at once: they would share the cores):

- **radixserve**: `radixserve up` with the `make serve` defaults (`LocalCluster`: kvstore,
  1 prefill + 1 decode worker, the cores shared), ``--model``, ``--kv-cache-gib`` and
  ``--log-level`` applied; one cluster for every cell.
- **llama-server** (``--llama-server`` / ``RADIXSERVE_BENCH_LLAMA_SERVER``, or the peer
  venv's; skipped with the reason and the build recipe when neither is there): restarted
  per batch size with ``-np B`` slots of the largest context measured at B, ``-t``/``-tb``
  = ``--peer-threads`` (default: the machine's cores).

A cell (B, C): B prompts of ``C - T`` tokens (T = ``--decode-tokens``), so a stream's
context runs from ``C - T`` to C while it decodes. Each prompt is seeded text
(`synthetic_ids`) distinct per cell and stream: no stream can reuse another's KV, and the
same B prompts go to both servers. Per cell, untimed: one short warm-up request, then
every prompt once with ``max_tokens: 1`` (all at once), so its KV is in the server's
cache. Timed: the B streams at once, greedy, ``ignore_eos``, ``max_tokens: T``; each
finds its own prompt cached (both servers keep a prompt's KV: radixserve's radix cache,
llama-server's slot picked by prompt similarity) and starts decoding within a step of the
others, so the gaps measure decode steps of B sequences, not prefill chunks between them.

Per stream, the gaps between its content chunks after the first, counted while all B
streams decode (from the last stream's first chunk to the first stream's last); ITL p50
and p90 over all those gaps, and the mean of the streams' means, which the ratio and the
floor comparison use (chunks that arrive in bursts make gaps near 0 and a p50 below the
pace a stream keeps); tokens/s: every stream's completion tokens over the timed wall
(first sent to last chunk). The client is the suite's
(`Client`: httpx, streamed ``/v1/completions`` with the prompt as token ids) for both.

The floor (`memory_floor`): each step reads the weights as the server holds them
(radixserve: the loaded model's bytes, int4/int8 matrices with their scales and the
bfloat16 embedding/LM head; llama-server: the GGUF's tensor bytes) and the KV of B
contexts of ``C - T/2`` tokens on average (layers x 2 x KV heads x head dim x 2 bytes),
over the copy bandwidth measured at the start of the run.

A cell is skipped, with its reason printed and recorded, when C is past the model's
context, when B x (C - T) prompt tokens exceed ``--prefill-budget-tokens``, or (per
server) when B x C tokens of KV do not fit the server's KV pool or B is past the
sequences it runs at once. Results: `decode_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench import peer_servers as ps
from radixserve.bench.decode_cells import (
    LLAMA_SLOT_MARGIN,
    RADIXSERVE,
    WARMUP_IDS_SEED,
    Cell,
    CellRun,
    DecodeOptions,
    Outcome,
    Served,
    System,
)
from radixserve.bench.memory_floor import kv_bytes_per_token
from radixserve.bench.peer_options import Deployment
from radixserve.bench.report import Sample
from radixserve.bench.suite import BenchError, Client
from radixserve.bench.synthetic import synthetic_ids


def skip_reason(served: Served, cell: Cell, budget: int) -> str | None:
    """Why ``cell`` is not run on a server holding ``served`` (None: it is run)."""
    b, c, p = cell.batch, cell.context, cell.prompt_tokens
    if c > served.max_context:
        return f"context {c} is past the model's {served.max_context} tokens"
    if b * p > budget:
        return (f"prefill of {b} x {p} = {b * p:,} tokens is over the budget of {budget:,} "
                "(--prefill-budget-tokens)")  # fmt: skip
    if served.max_streams is not None and b > served.max_streams:
        return f"{b} streams is past the {served.max_streams} sequences the server runs at once"
    if served.pool_tokens is not None:
        needed = b * -(-c // served.page_size) * served.page_size
        if needed > served.pool_tokens:
            return (f"KV of {b} x {c} tokens ({needed:,} with pages) does not fit the KV pool "
                    f"of {served.pool_tokens:,} tokens (--kv-cache-gib)")  # fmt: skip
    return None


def cell_prompts(tokenizer: Any, cell: Cell, seed: int) -> list[list[int]]:
    """The B prompts of ``cell``: ``C - T`` token ids each, seeded per cell and stream."""
    base = ((seed * 100_003 + cell.context) * 1_009 + cell.batch) * 1_000
    return [synthetic_ids(tokenizer, cell.prompt_tokens, base + i) for i in range(cell.batch)]


class DecodeClient(Client):
    """The suite's streaming client on ``/v1/completions`` (token-id prompts); llama-server
    may send no usage, then its tokens are counted as content chunks."""

    usage_required = False

    async def complete(self, prompt_ids: list[int], max_tokens: int,
                       extra: dict[str, Any]) -> tuple[float, Sample]:  # fmt: skip
        """One greedy stream: when it was sent (perf_counter seconds) and its sample."""
        sent = time.perf_counter()
        body = {"prompt": prompt_ids, "max_tokens": max_tokens, **extra}
        return sent, await self._stream("/v1/completions", body, 0)


async def measure_cell(url: str, system: System, cell: Cell, prompts: list[list[int]],
                       tokenizer: Any, timeout_s: float) -> CellRun:  # fmt: skip
    """Warm up, prime every prompt (one token each, all at once), then the timed streams."""
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    # a fresh connection per request: llama-server closes idle keep-alive ones after 5 s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        models = (await http.get("/v1/models")).raise_for_status().json()["data"]
        client = DecodeClient(http, models[0]["id"])
        extra = {"ignore_eos": True, **system.extra_body}
        await client.complete(synthetic_ids(tokenizer, 16, WARMUP_IDS_SEED), 2, extra)
        primed = await asyncio.gather(*(client.complete(p, 1, extra) for p in prompts))
        streams = await asyncio.gather(
            *(client.complete(p, cell.decode_tokens, extra) for p in prompts)
        )
    return CellRun(list(streams), [s for _, s in primed])


def radixserve_system(options: DecodeOptions) -> System:
    """`radixserve up` with the defaults and ``options.engine_env``; what its workers hold,
    from the same settings loaded here (weights) and the pool they size."""
    from radixserve.bench.local_cluster import LocalCluster
    from radixserve.bench.peer import cluster_settings
    from radixserve.launch.cluster import ClusterConfig

    env = {"RADIXSERVE_MODEL": options.model, **options.engine_env}

    @contextlib.contextmanager
    def start(batch: int, context: int) -> Iterator[Deployment]:
        config = ClusterConfig(port=0, engine_env=env)
        with LocalCluster(config) as cluster:
            yield Deployment(cluster.url, cluster_settings(config))

    return System(RADIXSERVE, radixserve_served(env), start, restart_per_batch=False)


def radixserve_served(env: dict[str, str]) -> Served:
    """`Served` of an engine built from ``RADIXSERVE_*`` settings ``env`` (as a worker
    resolves them), its pool sized as the worker sizes it."""
    from radixserve.cache.kv_pool import KVPool
    from radixserve.engine.engine import Engine
    from radixserve.settings import EngineSettings

    given: dict[str, Any] = {k.removeprefix("RADIXSERVE_").lower(): v for k, v in env.items()}
    settings = EngineSettings(
        **{k: v for k, v in given.items() if k in EngineSettings.model_fields}
    )
    small = settings.model_copy(update={"kv_cache_memory_gib": 0.01, "load_progress": False})
    engine = Engine(small)  # the pool is sized below, not allocated here
    pages = KVPool.num_pages_for_budget(engine.config, settings.page_size, engine.dtype,
                                        int(settings.kv_cache_memory_gib * (1 << 30)))  # fmt: skip
    served = served_by(engine, pages * settings.page_size)
    del engine
    gc.collect()
    return served


def served_by(engine: Any, pool_tokens: int) -> Served:
    """`Served` of a loaded `Engine` whose KV pool holds ``pool_tokens``."""
    c = engine.config
    dtype = str(engine.dtype).removeprefix("torch.")
    return Served(
        weights=f"{engine.quantization}, {dtype}: the loaded model's bytes",
        weight_bytes=engine.model.weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, engine.dtype.itemsize
        ),  # fmt: skip
        max_context=engine.max_model_len,
        pool_tokens=pool_tokens,
        page_size=engine.page_size,
        max_streams=engine.settings.max_num_seqs,
    )


def llama_server_system(options: DecodeOptions, binary: Path, model_path: Path,
                        log_dir: Path) -> System:  # fmt: skip
    """llama-server on the GGUF, ``-np B`` slots of the largest context at B; its floor
    reads the GGUF's tensors as stored (llama.cpp's KV: float16)."""
    from radixserve.bench.memory_floor import gguf_tensor_bytes
    from radixserve.model.model_files import open_model

    c = open_model(str(model_path)).config

    @contextlib.contextmanager
    def start(batch: int, context: int) -> Iterator[Deployment]:
        config = ps.llama_server_config(binary, model_path, options.threads, batch,
                                        context + LLAMA_SLOT_MARGIN)  # fmt: skip
        config = replace(config, env={**config.env, **options.peer_env})
        proc = ps.ServerProcess(config, options.settings.server_start_timeout_s, log_dir)
        with proc:
            settings = {"argv": proc.argv, "log": str(proc.log_path), "env": config.env}
            if proc.fell_back:
                settings["fallback"] = config.fallback_note
            yield Deployment(proc.url, settings)

    served = Served(
        weights="the GGUF's tensor bytes",
        weight_bytes=gguf_tensor_bytes(model_path),
        kv_bytes_per_token=kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 2),
        max_context=c.max_position_embeddings,
    )
    return System(ps.LLAMA_SERVER, served, start, restart_per_batch=True,
                  extra_body={"cache_prompt": True})  # fmt: skip


def grid(options: DecodeOptions) -> list[Cell]:
    return [Cell(b, c, options.decode_tokens) for c in options.contexts for b in options.batches]


def run_system(system: System, cells: list[Cell], options: DecodeOptions, tokenizer: Any,
               record: Callable[[System, Cell, Outcome, dict[str, Any]], None]) -> None:  # fmt: skip
    """Every cell of ``cells`` on ``system``: skipped with the reason, or measured (one
    start per batch size where the server is restarted per batch); ``record`` is told
    each outcome and the deployment's settings."""
    runnable: list[Cell] = []
    for cell in cells:
        why = skip_reason(system.served, cell, options.prefill_budget_tokens)
        if why is None:
            runnable.append(cell)
        else:
            print(f"decode: {system.name} B={cell.batch} C={cell.context}: skipped: {why}",
                  file=sys.stderr)  # fmt: skip
            record(system, cell, Outcome("skipped", why), {})
    groups = ([[c for c in runnable if c.batch == b] for b in options.batches]
              if system.restart_per_batch else [runnable])  # fmt: skip
    for group in (g for g in groups if g):
        batch, context = max(c.batch for c in group), max(c.context for c in group)
        print(f"decode: starting {system.name} (B up to {batch}, C up to {context}) ...",
              file=sys.stderr)  # fmt: skip
        try:
            with system.start(batch, context) as deployment:
                for cell in group:
                    outcome = _run_cell(deployment.url, system, cell, options, tokenizer)
                    record(system, cell, outcome, deployment.settings)
        except (ps.ServerError, TimeoutError, OSError) as exc:
            reason = f"{system.name} did not start: {exc}"[:500]
            print(f"decode: {reason}", file=sys.stderr)
            for cell in group:
                record(system, cell, Outcome("failed", reason), {})


def _run_cell(url: str, system: System, cell: Cell, options: DecodeOptions,
              tokenizer: Any) -> Outcome:  # fmt: skip
    prompts = cell_prompts(tokenizer, cell, options.seed)
    print(f"decode: {system.name} B={cell.batch} C={cell.context}: {cell.batch} stream(s) "
          f"of {cell.prompt_tokens} prompt + {cell.decode_tokens} tokens ...", file=sys.stderr)  # fmt: skip
    start = time.perf_counter()
    try:
        run = asyncio.run(measure_cell(url, system, cell, prompts, tokenizer,
                                       options.settings.request_timeout_s))  # fmt: skip
    except (BenchError, httpx.HTTPError, ValueError, KeyError) as exc:
        reason = f"{type(exc).__name__}: {exc}"[:500]
        print(f"decode: {system.name} B={cell.batch} C={cell.context}: failed: {reason}",
              file=sys.stderr)  # fmt: skip
        return Outcome("failed", reason)
    print(f"decode: {system.name} B={cell.batch} C={cell.context}: done in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
    return Outcome("measured", run=run)


def run_decode_bench(options: DecodeOptions, systems: Sequence[System] | None = None,
                     not_run: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Measure every cell on every server (by default radixserve up and, when there is
    one, llama-server), write the JSON after each cell, then the table and the plot; the
    JSON document. ``systems`` and ``not_run`` (server: why) replace the defaults."""
    from radixserve.bench import decode_report as report
    from radixserve.bench.memory_floor import copy_gbs
    from radixserve.model.model_files import open_model, resolve_model_path

    model_path = resolve_model_path(options.model)
    tokenizer = open_model(options.model).tokenizer
    if systems is None:
        systems, not_run = default_systems(options, model_path)
    for name, why in (not_run or {}).items():
        print(f"decode: skipping {name}: {why}", file=sys.stderr)
    gbs = copy_gbs()
    print(f"decode: copy bandwidth {gbs:.1f} GB/s (read + write)", file=sys.stderr)
    doc = report.new_document(options, grid(options), model_path, systems, not_run or {}, gbs)
    cells = grid(options)

    def record(system: System, cell: Cell, outcome: Outcome, deployment: dict[str, Any]) -> None:
        report.add_outcome(doc, system, cell, outcome, deployment)
        report.write_json(doc, options.out_path)

    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `with` blocks stop servers
    try:
        for system in systems:
            run_system(system, cells, options, tokenizer, record)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report.finish(doc, options.out_path)
    return doc


def default_systems(options: DecodeOptions,
                    model_path: Path) -> tuple[list[System], dict[str, str]]:  # fmt: skip
    """radixserve up, and llama-server where one is found (else: why not)."""
    systems = [radixserve_system(options)]
    if model_path.suffix != ".gguf":
        return systems, {ps.LLAMA_SERVER: f"it needs a GGUF file, not {model_path}"}
    binary, why = ps.find_llama_server(options.settings)
    if binary is None:
        return systems, {ps.LLAMA_SERVER: why}
    systems.append(llama_server_system(options, binary, model_path, ps.log_dir()))
    return systems, {}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
