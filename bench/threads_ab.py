"""CPU threads of `radixserve up`: the cores shared (the default), split, or all to each.

    .venv/bin/python bench/threads_ab.py [--preset quick|seed] [--repeats N] [--out F.json]

Runs the peer benchmark's workloads (`bench/peer.py`: the multi-turn chat one
conversation at a time, then the shared-prefix load 4 at a time) against `radixserve up`
only, in one run, once per policy and cache mode:

- ``shared``: the default, workers share the cores through the core board (each step
  on the cores divided by the workers computing);
- ``split``: ``--num-threads`` = cores ÷ workers, fixed (1 each with 2 workers on 2 cores);
- ``all``: ``--num-threads`` = every core to every worker, fixed (oversubscribed whenever
  both compute).

Cache ``on`` is the `make serve` default; ``busted`` turns the prefix cache off, so every
request prefills its whole prompt on the prefill worker while the decode worker
decodes the others: both busy, the case the board exists for. Prints one row per run and
the medians; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radixserve.bench import peer
from radixserve.bench.local_cluster import LocalCluster
from radixserve.bench.peer_report import multi_turn_stats, run_stats
from radixserve.launch.cluster import ClusterConfig

POLICIES = ("shared", "split", "all")
MODES = ("on", "busted")


def threads_of(policy: str) -> int | None:
    cores = os.cpu_count() or 1
    return {"shared": None, "split": max(1, cores // 2), "all": cores}[policy]


def target(policy: str, mode: str) -> peer.Target:
    env = {"RADIXSERVE_PREFIX_CACHE": "false"} if mode == "busted" else {}

    @contextlib.contextmanager
    def start() -> Iterator[peer.Deployment]:
        config = ClusterConfig(port=0, num_threads=threads_of(policy), engine_env=env)
        with LocalCluster(config) as cluster:
            yield peer.Deployment(cluster.url, {"policy": policy, "mode": mode})

    return peer.Target(f"radixserve {policy}", mode, start, {"ignore_eos": True})


def row(run: peer.TargetRun) -> dict[str, Any]:
    mt, load = multi_turn_stats(run.multi_turn), run_stats(run.load)
    return {
        "cached_turn_ttft_ms": mt["cached_turn_ttft_ms"],
        "round1_ttft_ms": mt["round1_ttft_ms"],
        "multi_turn_itl_p50_ms": mt["itl_ms"]["p50"],
        "load_ttft_p50_ms": load["ttft_ms"]["p50"],
        "load_ttft_p90_ms": load["ttft_ms"]["p90"],
        "load_itl_p50_ms": load["itl_ms"]["p50"],
        "load_itl_p90_ms": load["itl_ms"]["p90"],
        "load_requests_per_s": load["requests_per_s"],
        "errors": mt["errors"] + load["errors"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(peer.PEER_PRESETS), default="quick")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each policy and mode")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    policies, modes = args.policies.split(","), args.modes.split(",")
    for name in policies:
        if name not in POLICIES:
            parser.error(f"--policies: {name!r} is not one of {', '.join(POLICIES)}")
    for name in modes:
        if name not in MODES:
            parser.error(f"--modes: {name!r} is not one of {', '.join(MODES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    from radixserve.model.checkpoint import load_checkpoint

    options = peer.PeerOptions(args.preset, peer.PEER_PRESETS[args.preset], Path(os.devnull))
    tokenizer = load_checkpoint(options.model, progress=False).tokenizer
    wl = peer.build_workloads(
        options, lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    )
    rows: list[dict[str, Any]] = []
    for mode in modes:
        for _ in range(args.repeats):
            for policy in policies:  # interleaved, so drift on the machine hits all alike
                runs, failed = peer.run_targets([target(policy, mode)], wl, options)
                if failed:
                    print(f"threads: {policy} {mode} not measured: {failed}", file=sys.stderr)
                    return 1
                rows.append({"policy": policy, "mode": mode, **row(runs[0])})
                print("threads:", json.dumps(rows[-1]), flush=True)
    medians = []
    for mode in modes:
        for policy in policies:
            mine = [r for r in rows if r["policy"] == policy and r["mode"] == mode]
            keys = [k for k in mine[0] if k not in ("policy", "mode")]
            medians.append({"policy": policy, "mode": mode,
                            **{k: statistics.median(r[k] for r in mine) for k in keys}})  # fmt: skip
    keys = [k for k in medians[0] if k not in ("policy", "mode")]
    print(f"\n| policy | cache | {' | '.join(keys)} |")
    print(f"|---|---|{'---|' * len(keys)}")
    for m in medians:
        print(f"| {m['policy']} | {m['mode']} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
    if args.out:
        doc = {"preset": args.preset, "cores": os.cpu_count(), "runs": rows, "medians": medians}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
