"""`radixserve bench --scenario chaos`: serving through faults, checked answer by answer.

A real cluster (`LocalCluster`: the kvstore, ``num_prefill`` prefill and ``num_decode``
decode workers, the gateway; the default model with the engine's defaults, on 127.0.0.1;
float32 with tensor-parallel decode workers) carries
concurrent multi-turn greedy chats (`chaos_load`) for ``seconds`` while a seeded
schedule (`chaos_schedule`) kills, drains and pauses its processes and drops client
connections (`chaos_faults`). Every answer is compared with a single-process engine's
(`chaos_reference`); failures are sorted into clean errors, unclean failures and hangs
and attributed to the events (`chaos_report`). After the load the cluster settles
(every process back, nothing held) and what each worker still holds is reported.

Settings the benchmark gives the cluster: liveness at its defaults (heartbeat 0.5 s,
peer timeout 5 s; a pause lasts the timeout + 2 s), decode workers prefill locally up
to 48 uncached tokens (so a conversation's first turn goes to a prefill worker and a
short later turn to either), a 0.25 GiB KV pool per worker and host tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.chaos_client import RequestRecord, load_clock
from radixserve.bench.chaos_faults import ClusterMonitor, FaultInjector
from radixserve.bench.chaos_load import ChatLoad, Messages
from radixserve.bench.chaos_reference import ReferenceAnswers
from radixserve.bench.chaos_report import build_report, format_table, held
from radixserve.bench.chaos_schedule import KINDS, TP_KINDS, build_schedule
from radixserve.bench.local_cluster import LocalCluster
from radixserve.bench.workload import MultiTurnSize, MultiTurnWorkload, build_multi_turn
from radixserve.engine.engine import Engine
from radixserve.launch.cluster import ClusterConfig
from radixserve.settings import EngineSettings

logger = logging.getLogger(__name__)
#: float32 weights and compute (tensor-parallel decode workers: see `cluster_config`)
FLOAT32_ENV = {"RADIXSERVE_DTYPE": "float32", "RADIXSERVE_QUANTIZATION": "none"}

# a ~200-token shared system prompt, 4 turns of 12-30 tokens, answers of 12-32 tokens
CHAT = MultiTurnSize(200, 4, 1, (12, 30), (12, 32))


@dataclass(frozen=True)
class ChaosOptions:
    seconds: float = 300.0  # of load; events stop `quiet_tail_s` before its end
    seed: int = 0
    out_path: Path | None = None
    num_prefill: int = 2
    num_decode: int = 2
    decode_tp: int = 1  # > 1: the decode workers' ranks are killed too (kill-rank)
    transport: str = "nixl"
    concurrency: int = 4  # chats at once
    hang_s: float = 60.0  # no byte for this long: a hang
    heartbeat_interval_s: float = 0.5  # the services' defaults
    peer_timeout_s: float = 5.0
    kv_cache_gib: float = 0.25
    engine_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_* settings
    settle_timeout_s: float = 120.0  # after the load: every process back, nothing held
    recovery_timeout_s: float = 180.0  # one event's target back up

    @property
    def pause_s(self) -> float:
        return self.peer_timeout_s + 2.0


def cluster_config(options: ChaosOptions) -> ClusterConfig:
    liveness = {"HEARTBEAT_INTERVAL_S": str(options.heartbeat_interval_s),
                "PEER_TIMEOUT_S": str(options.peer_timeout_s)}  # fmt: skip

    def env(role: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {f"RADIXSERVE_{role}_{k}": v for k, v in {**liveness, **(extra or {})}.items()}

    return ClusterConfig(
        num_prefill=options.num_prefill,
        num_decode=options.num_decode,
        decode_tp=options.decode_tp,
        transport=options.transport,
        port=0,
        host_tier_gib=options.kv_cache_gib,
        engine_env={
            # answers are checked token for token, and a migrated stream recomputes its
            # tokens as a prompt: the defaults compute a row the same way in any step; a
            # tensor-parallel worker's all-reduce adds in another order than one process,
            # which float32 rounding absorbs and bfloat16's would not
            **(FLOAT32_ENV if options.decode_tp > 1 else {}),
            "RADIXSERVE_KV_CACHE_MEMORY_GIB": str(options.kv_cache_gib),
            **options.engine_env,
            **env("KVSTORE"),  # every process gets it; the kvstore reads it
        },
        prefill_env=env("PREFILL"),
        decode_env=env("DECODE", {"LOCAL_PREFILL_MAX_TOKENS": "48"}),
        gateway_env=env("GATEWAY"),
    )


def reference_engine(options: ChaosOptions) -> Engine:
    """The single-process reference: the cluster's model, device, dtype and weights."""
    env = {**cluster_config(options).engine_env}
    settings: dict[str, Any] = {"model": env.get("RADIXSERVE_MODEL", "default"),
                "dtype": env.get("RADIXSERVE_DTYPE", "auto"),
                "quantization": env.get("RADIXSERVE_QUANTIZATION", "auto"),
                "kv_cache_memory_gib": 0.5, "load_progress": False}  # fmt: skip
    if "RADIXSERVE_DEVICE" in env:
        settings["device"] = env["RADIXSERVE_DEVICE"]
    return Engine(EngineSettings(**settings))


def chat_workload(options: ChaosOptions, engine: Engine) -> MultiTurnWorkload:
    """Enough conversations for the run (they are reused round robin past the end)."""

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    chats = max(8, int(options.seconds // 4))
    return build_multi_turn(MultiTurnSize(**{**vars(CHAT), "conversations": chats}),
                            options.seed, count)  # fmt: skip


def run_chaos_bench(options: ChaosOptions) -> dict[str, Any]:
    """Run the benchmark; print the table, write the JSON (``out_path``), return it."""
    started = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    reference = ReferenceAnswers(lambda: reference_engine(options))  # loads meanwhile
    kinds = TP_KINDS if options.decode_tp > 1 else KINDS
    schedule = build_schedule(options.seconds, options.seed, kinds=kinds)
    print(f"chaos: starting {options.num_prefill} prefill + {options.num_decode} decode "
          f"{f'(TP={options.decode_tp}) ' if options.decode_tp > 1 else ''}workers, then {options.seconds:g} s of load and {len(schedule)} events ...",
          file=sys.stderr)  # fmt: skip
    with LocalCluster(cluster_config(options)) as cluster:
        timings = {"cluster_start_s": time.monotonic() - started}
        engine = reference.engine()
        workload = chat_workload(options, engine)
        timings["reference_and_workload_s"] = time.monotonic() - started
        run = asyncio.run(
            _run(cluster, options, workload, schedule, reference, engine.tokenizer.encode_chat)
        )
        t0 = time.monotonic()
    timings["cluster_stop_s"] = time.monotonic() - t0
    answers = reference.finish(timeout_s=600)
    timings["reference_finish_s"] = time.monotonic() - t0 - timings["cluster_stop_s"]
    header = {
        "scenario": "chaos",
        "date": date,
        "seconds": options.seconds,
        "seed": options.seed,
        "num_prefill": options.num_prefill,
        "num_decode": options.num_decode,
        "transport": options.transport,
        "concurrency": options.concurrency,
        "hang_s": options.hang_s,
        "peer_timeout_s": options.peer_timeout_s,
        "pause_s": options.pause_s,
        "machine": {"cores": os.cpu_count(), "load_average": list(os.getloadavg())},
        **{k: round(v, 1) for k, v in timings.items()},
        "load_end_s": run["load_end_s"],
        "reference_at_load_end": run["reference_at_load_end"],
        "reference_engine": reference.step_counters(),
        "settle_s": run["settle_s"],
        "settled": run["settled"],
        "wall_s": round(time.monotonic() - started, 1),
        "schedule": [vars(e) for e in schedule],
    }
    report = build_report(run["records"], run["events"], answers, run["final"], header)
    print(format_table(report))
    if options.out_path is not None:
        options.out_path.parent.mkdir(parents=True, exist_ok=True)
        options.out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"chaos: wrote {options.out_path}", file=sys.stderr)
    return report


async def _run(
    cluster: LocalCluster,
    options: ChaosOptions,
    workload: MultiTurnWorkload,
    schedule: list[Any],
    reference: ReferenceAnswers,
    prompt_ids: Callable[[Messages], list[int]],
) -> dict[str, Any]:
    """The load and the events, then the settling; what the report needs."""
    limits = httpx.Limits(max_connections=options.concurrency + 8)
    async with httpx.AsyncClient(base_url=cluster.url, limits=limits, timeout=30) as http:
        await _check_tokenizer(http, workload, prompt_ids)
        monitor = ClusterMonitor(cluster.processes, http)
        supervise = asyncio.ensure_future(monitor.run())
        clock = load_clock()
        load = ChatLoad(http, workload, prompt_ids, clock, concurrency=options.concurrency,
                        hang_s=options.hang_s,
                        on_done=lambda r: _to_check(reference, r))  # fmt: skip
        injector = FaultInjector(monitor, load, clock, pause_s=options.pause_s,
                                 recovery_timeout_s=options.recovery_timeout_s,
                                 max_postpone_s=20.0)  # fmt: skip
        try:
            events = asyncio.ensure_future(injector.run(schedule, options.seconds))
            await load.run(options.seconds)
            load_end_s = round(clock(), 1)
            progress = reference.progress()
            await events
            await injector.wait_recovered(options.recovery_timeout_s + 10)
            settle_s, settled = await _settle(monitor, options, clock)
        finally:
            injector.resume_all()
            supervise.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervise
    return {"records": load.records, "events": injector.events, "final": monitor.snapshot,
            "load_end_s": load_end_s, "settle_s": settle_s, "settled": settled,
            "reference_at_load_end": progress}  # fmt: skip


def _to_check(reference: ReferenceAnswers, record: RequestRecord) -> None:
    """Ask for the reference answer of a request that has text to check."""
    if record.outcome == "ok" or record.text:
        reference.submit(record.prompt_ids, record.max_tokens)


async def _check_tokenizer(
    http: httpx.AsyncClient,
    workload: MultiTurnWorkload,
    prompt_ids: Callable[[Messages], list[int]],
) -> None:
    """The reference's prompt ids must be the gateway's (its /tokenize)."""
    messages: Messages = [{"role": "system", "content": workload.system},
                          {"role": "user", "content": workload.conversations[0][0].user}]  # fmt: skip
    resp = await http.post("/tokenize", json={"model": "default", "messages": messages})
    resp.raise_for_status()
    if resp.json()["tokens"] != prompt_ids(messages):
        raise RuntimeError("the gateway tokenises chats differently from the reference engine")


async def _settle(monitor: ClusterMonitor, options: ChaosOptions, clock: Any) -> tuple[float, bool]:
    """Wait until every process is up again and no worker holds anything (at most
    ``settle_timeout_s``); the seconds it took and whether it happened."""
    names = {"kvstore", *(f"prefill-{i}" for i in range(options.num_prefill)),
             *(f"decode-{i}" for i in range(options.num_decode))}  # fmt: skip
    start = clock()
    await asyncio.sleep(2 * options.heartbeat_interval_s)  # heartbeats from after the load
    while clock() - start < options.settle_timeout_s:
        await monitor.refresh()
        up = all(monitor.up(n) for n in names)
        idle = not monitor.snapshot.get("gateway_in_flight") and not any(
            any(h.values()) for h in held(monitor.workers).values()
        )
        if up and idle:
            return round(clock() - start, 1), True
        await asyncio.sleep(0.5)
    logger.warning("chaos: the cluster did not settle in %g s", options.settle_timeout_s)
    return round(clock() - start, 1), False
