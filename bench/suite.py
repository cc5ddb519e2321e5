"""`radixserve bench --scenario multi-turn|rag|all`: the founding table (DESIGN.md §1)
on a real cluster, prefix cache on vs off in one invocation.

A, multi-turn support chat: conversations share a system prompt; each runs ``rounds``
user turns, and the model's real answer to each turn is appended to its history.
``concurrency`` conversations run at once. B, RAG: documents shared in the system
message, one short question per user, ``concurrency`` users in flight. Sizes: the
`quick` and `seed` presets of `workload.py`. Greedy answers of exactly the drawn length
(``min_tokens = max_tokens``).

How a run goes, per deployment (cache on, then off, each a fresh `LocalCluster` of
``--prefill`` and ``--decode`` workers; every selected scenario runs on it in turn):

1. one untimed warm-up request on an unrelated prompt (the engine's first-call costs);
2. the scenario's first request (conversation 1 round 1; user 1) is sent alone and the
   others start when it has been answered: it computes the shared prefix once, as the
   first request after a deploy would. Every request counts;
3. the cache-off run replays the cache-on run's answers as history, so both send the
   same prompts (checked: same prompt tokens per round);
4. on the cache-on cluster, the floor: the last round's uncached delta of each request
   (its prompt tokens past ``cached_tokens``, re-tokenised here with the same chat
   template) sent alone as a token-id completion of one token, one after another on the
   quiet cluster. ``floor_ms`` is the median TTFT of those that hit no cache; it is the
   cost of computing the delta tokens alone, through the same path. The summary gives
   the last round's cached TTFT p50 against it (target: within 1.3×).

TTFT: request sent → first SSE event carrying content. ITL: gaps between content
events. Token counts: the server's ``usage`` (``stream_options.include_usage``);
computed = prompt − cached. Prefill FLOPs: see `report.py` (Kaplan et al.'s 2N +
2·L·d_attn·context per token, over the computed positions). QPS: requests of the
scenario ÷ its wall time under the concurrency used.

JSON (``--out``): per scenario an object with ``scenario``, ``preset``, ``machine``,
``model``, ``settings``, ``rounds`` (one entry per round; RAG has one, round 1) and
``summary``. Each round has ``round``, ``on`` and ``off``: ``ttft_ms`` {mean, p50, p90},
``prefill_computed_tokens``, ``cached_tokens``, ``itl_ms`` {mean, p90}, plus
``prompt_tokens``, ``requests`` and ``prefill_gflops`` (sums over the round's requests).
``summary``: ``ttft_cut_pct`` (last round, means), ``prefill_compute_cut_pct`` (FLOPs of
the whole scenario), ``qps_on``, ``qps_off``, ``qps_gain``, ``floor_ms``, plus
``cached_ttft_ms``, ``cached_ttft_vs_floor`` and ``founding`` (the founding table's row
it compares with). With ``--scenario all`` the file holds ``{"scenarios": [A, B]}``.
PNG plots go beside the JSON: ``<out stem>-<scenario>-ttft.png`` and ``-prefill.png``.

``--url``: the same workload against any OpenAI-compatible server (it must accept
``min_tokens`` and report usage with ``cached_tokens``). Its cache cannot be switched
off from here, so it runs once, as "on"; every ``off`` is null and so are the cuts and
``qps_off``/``qps_gain``. Lengths, the floor's token ids and FLOPs use the local
``--model``'s tokenizer and shape (default SmolLM2-135M), so point it at a server of the
same model for exact figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.local_cluster import LocalCluster, threads_described
from radixserve.bench.report import (
    FLOPS_FORMULA,
    ModelShape,
    Sample,
    ScenarioRun,
    build_result,
    markdown,
    write_plots,
)
from radixserve.bench.workload import (
    MultiTurnWorkload,
    Preset,
    RagWorkload,
    build_multi_turn,
    build_rag,
)
from radixserve.errors import RadixServeError
from radixserve.launch.cluster import ClusterConfig

SCENARIOS = ("multi-turn", "rag")
FLOOR_REQUESTS = 8  # at most this many delta-alone requests make the floor
Messages = list[dict[str, str]]


class BenchError(RadixServeError):
    """The server failed a request or answered something the suite cannot use."""


@dataclass(frozen=True)
class SuiteOptions:
    scenarios: tuple[str, ...]
    preset_name: str
    preset: Preset
    out_path: Path
    seed: int = 0
    url: str | None = None  # None: start a local cluster per mode
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "nixl"
    model: str = "default"
    engine_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_* settings


class Client:
    """Streams OpenAI requests and measures them from the client's side."""

    # A stream without usage is an error; if not required, its tokens are counted as
    # content events and its prompt tokens are unknown (`Sample.usage_reported`).
    usage_required = True

    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http, self.model = http, model

    async def chat(self, messages: Messages, answer_tokens: int, round_: int) -> Sample:
        body = {"messages": messages, "max_tokens": answer_tokens, "min_tokens": answer_tokens}
        return await self._stream("/v1/chat/completions", body, round_)

    async def complete_ids(self, prompt_ids: list[int], round_: int) -> Sample:
        return await self._stream(
            "/v1/completions", {"prompt": prompt_ids, "max_tokens": 1}, round_
        )

    async def _stream(self, path: str, body: dict[str, Any], round_: int) -> Sample:
        body = {**body, "model": self.model, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        text: list[str] = []
        usage: dict[str, Any] = {}
        async with self.http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise BenchError(f"{path} answered {resp.status_code}: {resp.text[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise BenchError(f"{path} stream failed: {event['error']}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    content = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now - last) * 1000.0)
                        first, last = first or now, now
                        text.append(content)
        if not usage and self.usage_required:
            raise BenchError(f"{path}: the server sent no usage (stream_options.include_usage)")
        return Sample(
            round=round_,
            prompt_tokens=usage.get("prompt_tokens", 0),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            completion_tokens=usage.get("completion_tokens", len(text)),
            ttft_ms=((first or time.perf_counter()) - start) * 1000.0,
            itl_ms=gaps,
            text="".join(text),
            usage_reported=bool(usage),
        )


async def _first_then_rest(
    first: Callable[[], Awaitable[None]],
    rest: Sequence[Callable[[], Awaitable[None]]],
    concurrency: int,
) -> float:
    """Run ``first`` alone, then ``rest`` at most ``concurrency`` at once; the wall time
    in seconds."""
    slots = asyncio.Semaphore(concurrency)

    async def limited(job: Callable[[], Awaitable[None]]) -> None:
        async with slots:
            await job()

    start = time.perf_counter()
    await first()
    await asyncio.gather(*(limited(job) for job in rest))
    return time.perf_counter() - start


@dataclass
class MultiTurnRun:
    run: ScenarioRun
    answers: list[list[str]]  # [conversation][round]: the model's answers
    last_prompts: list[Messages]  # each conversation's last-round messages
    last_samples: list[Sample]  # and what its last round measured


async def run_multi_turn(
    client: Client,
    wl: MultiTurnWorkload,
    concurrency: int,
    replay: list[list[str]] | None,
    bar: tqdm,
) -> MultiTurnRun:
    """Every conversation round by round, ``concurrency`` conversations at once (each
    holds its slot for all its rounds). With ``replay``, those answers are the history."""
    answers: list[list[str]] = [[] for _ in wl.conversations]
    last: list[Messages] = [[] for _ in wl.conversations]
    last_samples: list[Sample] = [None] * len(wl.conversations)  # type: ignore[list-item]
    samples: list[Sample] = []
    opening: Messages = [{"role": "system", "content": wl.system}]

    async def turn(c: int, r: int, history: Messages) -> Messages:
        step = wl.conversations[c][r]
        messages = [*history, {"role": "user", "content": step.user}]
        sample = await client.chat(messages, step.answer_tokens, r + 1)
        samples.append(sample)
        answers[c].append(sample.text)
        last[c], last_samples[c] = messages, sample
        bar.update(1)
        answer = replay[c][r] if replay is not None else sample.text
        return [*messages, {"role": "assistant", "content": answer}]

    async def conversation(c: int, first_round: int, history: Messages) -> None:
        for r in range(first_round, len(wl.conversations[c])):
            history = await turn(c, r, history)

    after_first: Messages = []

    async def first() -> None:  # conversation 1, round 1, alone: the shared prefix once
        after_first.extend(await turn(0, 0, opening))

    rest = [partial(conversation, 0, 1, after_first)]
    rest += [partial(conversation, c, 0, opening) for c in range(1, len(wl.conversations))]
    wall = await _first_then_rest(first, rest, concurrency)
    return MultiTurnRun(ScenarioRun(samples, wall), answers, last, last_samples)


async def run_rag(
    client: Client, wl: RagWorkload, concurrency: int, bar: tqdm
) -> tuple[ScenarioRun, list[Messages], list[Sample]]:
    """One question per user; user 1 alone, then the rest ``concurrency`` at a time.
    Returns the run, and each user's messages and sample."""
    samples: list[Sample] = []
    by_user: list[Sample] = [None] * len(wl.questions)  # type: ignore[list-item]
    prompts = [
        [{"role": "system", "content": wl.system}, {"role": "user", "content": q.user}]
        for q in wl.questions
    ]

    async def ask(i: int) -> None:
        by_user[i] = await client.chat(prompts[i], wl.questions[i].answer_tokens, 1)
        samples.append(by_user[i])
        bar.update(1)

    rest = [partial(ask, i) for i in range(1, len(prompts))]
    wall = await _first_then_rest(partial(ask, 0), rest, concurrency)
    return ScenarioRun(samples, wall), prompts, by_user


async def measure_floor(
    client: Client, tokenizer: Any, prompts: list[Messages], samples: list[Sample]
) -> float | None:
    """Median TTFT of each request's uncached delta tokens sent alone (see the module
    docstring); None when the local tokenizer does not reproduce the server's counts."""
    ttfts: list[float] = []
    for messages, sample in zip(prompts, samples):
        if len(ttfts) >= FLOOR_REQUESTS:
            break
        ids = tokenizer.encode_chat(messages)
        if len(ids) != sample.prompt_tokens or sample.cached_tokens == 0:
            continue
        alone = await client.complete_ids(ids[sample.cached_tokens :], sample.round)
        if alone.cached_tokens == 0:
            ttfts.append(alone.ttft_ms)
    return statistics.median(ttfts) if ttfts else None


@dataclass
class TargetRun:
    """Every selected scenario on one deployment."""

    runs: dict[str, ScenarioRun]
    answers: list[list[str]] | None  # multi-turn answers, replayed by the cache-off run
    model_name: str


async def run_target(
    url: str, options: SuiteOptions, workloads: dict[str, Any], tokenizer: Any, mode: str,
    replay: list[list[str]] | None,
) -> TargetRun:  # fmt: skip
    """Warm up, then each scenario; on a cache-on deployment also its floor."""
    timeout = httpx.Timeout(1800.0, connect=30.0)  # queued uncached prefills take minutes
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        models = (await http.get("/v1/models")).raise_for_status().json()["data"]
        client = Client(http, models[0]["id"])
        await client.chat([{"role": "user", "content": "Warm-up: say hi."}], 2, 0)
        target = TargetRun({}, None, client.model)
        for name in options.scenarios:
            wl = workloads[name]
            total = sum(map(len, wl.conversations)) if name == "multi-turn" else len(wl.questions)
            with tqdm(
                total=total, desc=f"{name}, cache {mode}", unit="req", file=sys.stderr
            ) as bar:
                if name == "multi-turn":
                    conc = options.preset.multi_turn.concurrency or len(wl.conversations)
                    mt = await run_multi_turn(client, wl, conc, replay, bar)
                    run, prompts, last = mt.run, mt.last_prompts, mt.last_samples
                    target.answers = mt.answers
                else:
                    run, prompts, last = await run_rag(
                        client, wl, options.preset.rag.concurrency, bar
                    )
            if mode == "on":
                run.floor_ms = await measure_floor(client, tokenizer, prompts, last)
            target.runs[name] = run
    return target


def cluster_config(options: SuiteOptions, cache_on: bool) -> ClusterConfig:
    env = {
        "RADIXSERVE_MODEL": options.model,
        "RADIXSERVE_KV_CACHE_MEMORY_GIB": str(options.preset.kv_cache_gib),
        **options.engine_env,
    }
    if not cache_on:
        env["RADIXSERVE_PREFIX_CACHE"] = "false"
    return ClusterConfig(
        num_prefill=options.num_prefill,
        num_decode=options.num_decode,
        transport=options.transport,
        port=0,
        engine_env=env,
    )


def machine_info() -> dict[str, Any]:
    """The CPU (its model name where /proc/cpuinfo has one), GPU, core count."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux only
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip


def _header(name: str, options: SuiteOptions, model: dict[str, Any]) -> dict[str, Any]:
    p = options.preset
    size = p.multi_turn if name == "multi-turn" else p.rag
    threads = threads_described(cluster_config(options, True))
    if name == "multi-turn":
        conc = p.multi_turn.concurrency or p.multi_turn.conversations
        what = (f"{p.multi_turn.conversations} conversations × {p.multi_turn.rounds} rounds, "
                f"{conc} at once, system prompt ~{p.multi_turn.system_tokens} tokens")  # fmt: skip
    else:
        conc = p.rag.concurrency
        what = (f"{p.rag.users} users, {conc} at once, {p.rag.num_docs} documents "
                f"~{p.rag.doc_tokens_total} tokens")  # fmt: skip
    where = f"{options.url} (its cache as it is; no cache-off run)"
    if not options.url:
        where = (f"local cluster, {options.num_prefill} prefill + {options.num_decode} decode "
                 f"({options.transport}), {threads}")  # fmt: skip
    settings = {
        "description": f"{what}; {where}",
        "target": options.url or "local",
        "prefill_workers": None if options.url else options.num_prefill,
        "decode_workers": None if options.url else options.num_decode,
        "threads": None if options.url else threads,
        "kv_cache_gib": None if options.url else p.kv_cache_gib,
        "cache_off_run": options.url is None,
        "seed": options.seed,
        **{k: list(v) if isinstance(v, tuple) else v for k, v in vars(size).items()},
        "concurrency": conc,
        "temperature": 0.0,
        "flops_formula": FLOPS_FORMULA,
    }
    return {"scenario": name, "preset": options.preset_name, "machine": machine_info(),
            "model": model, "settings": settings}  # fmt: skip


def run_suite(options: SuiteOptions) -> dict[str, Any]:
    """Run, write the JSON and plots, print the markdown; the JSON document."""
    from radixserve.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(options.model, progress=False)
    tokenizer, shape = checkpoint.tokenizer, ModelShape.from_config(checkpoint.config)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    workloads: dict[str, Any] = {}
    if "multi-turn" in options.scenarios:
        workloads["multi-turn"] = build_multi_turn(options.preset.multi_turn, options.seed, count)
    if "rag" in options.scenarios:
        workloads["rag"] = build_rag(options.preset.rag, options.seed, count)

    def deploy(url: str | None, mode: str, replay: list[list[str]] | None) -> TargetRun:
        if url is not None:
            return asyncio.run(run_target(url, options, workloads, tokenizer, mode, replay))
        print(f"suite: starting the cluster, prefix cache {mode} ...", file=sys.stderr)
        with LocalCluster(cluster_config(options, mode == "on")) as cluster:
            return asyncio.run(run_target(cluster.url, options, workloads, tokenizer, mode, replay))

    if options.url:
        print(f"suite: {options.url}: its cache cannot be switched off, so one run, reported "
              "as 'on'; every 'off' value is null", file=sys.stderr)  # fmt: skip
        on, off = deploy(options.url.rstrip("/").removesuffix("/v1"), "on", None), None
    else:
        on = deploy(None, "on", None)
        off = deploy(None, "off", on.answers)
    model = {"name": on.model_name, "checkpoint": options.model, **asdict(shape)}
    results = []
    for name in options.scenarios:
        off_run = off.runs[name] if off else None
        results.append(build_result(_header(name, options, model), on.runs[name], off_run, shape))
    _write(results, options.out_path)
    return results[0] if len(results) == 1 else {"scenarios": results}


def _write(results: list[dict[str, Any]], out_path: Path) -> None:
    """The JSON (one scenario: its object; several: ``{"scenarios": [...]}``), the plots
    beside it, and the markdown on stdout."""
    for result in results:
        for row in result["rounds"]:
            if row["off"] and row["off"]["prompt_tokens"] != row["on"]["prompt_tokens"]:
                print(f"suite: warning: {result['scenario']} round {row['round']} sent different "
                      "prompts with the cache on and off", file=sys.stderr)  # fmt: skip
    doc = results[0] if len(results) == 1 else {"scenarios": results}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    plots = [str(path) for result in results for path in write_plots(result, out_path)]
    print("\n\n".join(markdown(result) for result in results))
    print(f"suite: wrote {out_path} and {', '.join(plots)}", file=sys.stderr)
