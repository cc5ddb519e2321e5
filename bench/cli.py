"""`radixserve bench`: the scenarios' flags, checked here (a flag a scenario does not
take is refused by name), and the dispatch to each scenario's module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from radixserve.cli.engine import QUANTIZATIONS, build_settings, engine_env
from radixserve.errors import UsageError

#: flags that only some scenarios take, and those scenarios (any other refuses them by name)
_SCENARIO_FLAGS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("peer_venv", "peer_threads", "peer_env"): ("peer", "perplexity", "decode"),
    ("llama_server",): ("peer", "decode"),
    ("batches", "contexts", "decode_tokens", "prefill_budget_tokens"): ("decode",),
    ("seconds", "decode_tp"): ("chaos",),
    ("config", "ctx", "chunks", "text"): ("perplexity",),
    ("trace", "trace_shape", "ttft_per_1k_tokens_s"): ("autoscale",),
    ("through_cluster",): ("speculative",),
}


def cmd_bench(args: argparse.Namespace) -> int:
    for flags, scenarios in _SCENARIO_FLAGS.items():
        for flag in flags:
            if getattr(args, flag) is not None and args.scenario not in scenarios:
                names = ", ".join(scenarios[:-1]) + " or " if len(scenarios) > 1 else ""
                raise UsageError(f"--{flag.replace('_', '-')} applies to --scenario "
                                 f"{names}{scenarios[-1]} only")  # fmt: skip
    if args.quantization is not None and args.scenario != "perplexity":
        if args.scenario in _OWN_ENGINE_SETTINGS:
            raise UsageError(f"--quantization: --scenario {args.scenario} runs its own "
                               "engine settings (peer: the make serve defaults and none)")  # fmt: skip
        if args.quantization not in QUANTIZATIONS:
            raise UsageError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} "
                               f"for --scenario {args.scenario}, not {args.quantization!r}")  # fmt: skip
    if args.preset == "pool" and args.scenario != "tiers":
        raise UsageError("--preset pool applies to --scenario tiers only")
    if args.scenario == "engine":
        from radixserve.bench.engine_ttft import run_engine_bench

        return run_engine_bench(build_settings(args), out_path=args.out, quick=args.quick)
    if args.scenario == "gateway":
        from radixserve.bench.gateway_chat import run_gateway_bench

        return run_gateway_bench(quick=args.quick, out_path=args.out)
    if args.scenario == "abuse":
        from radixserve.bench.abuse import run_abuse_bench

        return run_abuse_bench(quick=args.quick, out_path=args.out, model=args.model or "default")
    if args.scenario == "sampling":
        from radixserve.bench.sampling import run_sampling_bench

        return run_sampling_bench(build_settings(args), out_path=args.out, quick=args.quick)
    if args.scenario == "host-tier":
        from radixserve.bench.host_tier import run_host_tier_bench

        return run_host_tier_bench(
            quick=args.quick, out_path=args.out, model=args.model or "default"
        )
    if args.scenario == "tiers":
        from radixserve.bench.tiers import run_tiers_bench

        preset = "quick" if args.quick else args.preset
        return run_tiers_bench(preset, out_path=args.out, model=args.model or "default")
    if args.scenario == "shared-tier":
        return _run_shared_tier(args)
    if args.scenario == "autoscale":
        return _run_autoscale(args)
    if args.scenario in SUITE_SCENARIOS:
        return _run_suite(args)
    if args.scenario == "peer":
        return _run_peer(args)
    if args.scenario == "chaos":
        return _run_chaos(args)
    if args.scenario == "perplexity":
        return _run_perplexity(args)
    if args.scenario == "decode":
        return _run_decode(args)
    if args.scenario == "speculative":
        return _run_speculative(args)
    if args.scenario == "lora":
        return _run_lora(args)
    print(f"error: unknown scenario {args.scenario!r}", file=sys.stderr)
    return 2


SUITE_SCENARIOS = ("multi-turn", "rag", "all")
# scenarios that run their own engine settings: --quantization is refused by name
_OWN_ENGINE_SETTINGS = ("gateway", "abuse", "host-tier", "tiers", "shared-tier", "autoscale",
                        "peer", "decode", "speculative", "lora")  # fmt: skip


# Flags `--scenario shared-tier` does not take (flag, its default): it runs its own
# cluster (1 prefill + 2 decode workers) with the serving defaults.
_NOT_FOR_SHARED_TIER = (("device", None), ("dtype", None), ("kv_cache_memory_gib", None),
                        ("page_size", None), ("prefix_cache", None), ("tp", None),
                        ("concurrency", None), ("rounds", None), ("users", None),
                        ("url", None), ("prefill", None), ("decode", None))  # fmt: skip


def _run_shared_tier(args: argparse.Namespace) -> int:
    from radixserve.bench.shared_tier import run_shared_tier_bench

    _refuse_flags(args, _NOT_FOR_SHARED_TIER, "--scenario shared-tier runs its own cluster "
                  "(1 prefill + 2 decode workers) with the serving defaults (--model, "
                  "--transport, --conversations, --quick, --out apply)")  # fmt: skip
    if args.conversations is not None and args.conversations < 1:
        raise UsageError(f"--conversations must be at least 1, not {args.conversations}")
    return run_shared_tier_bench(quick=args.quick, out_path=args.out,
                                 model=args.model or "default", transport=args.transport,
                                 conversations=args.conversations)  # fmt: skip


def _run_autoscale(args: argparse.Namespace) -> int:
    from radixserve.bench.autoscale import run_autoscale_bench

    if args.trace is not None and args.trace_shape is not None:
        raise UsageError("--trace-shape generates a trace; --trace reads one: give one")
    budget = args.ttft_per_1k_tokens_s
    if budget is not None and not 0 < budget <= 3600:
        raise UsageError(f"--ttft-per-1k-tokens-s must be in (0, 3600] seconds, not {budget:g}")
    return run_autoscale_bench(args.quick, args.out, args.trace, args.seed,
                               args.trace_shape or "diurnal", budget)  # fmt: skip


def suite_options(args: argparse.Namespace):
    """`SuiteOptions` from the bench flags (the preset, resized by any override)."""
    from dataclasses import replace
    from pathlib import Path

    from radixserve.bench.suite import SCENARIOS, SuiteOptions
    from radixserve.bench.workload import PRESETS

    preset_name = "quick" if args.quick else args.preset
    preset = PRESETS[preset_name]
    multi_turn, rag = preset.multi_turn, preset.rag
    for flag in ("concurrency", "conversations", "rounds", "users"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag} must be at least 1, not {value}")
    if args.conversations is not None:
        multi_turn = replace(multi_turn, conversations=args.conversations)
    if args.rounds is not None:
        multi_turn = replace(multi_turn, rounds=args.rounds)
    if args.users is not None:
        rag = replace(rag, users=args.users)
    if args.concurrency is not None:
        multi_turn = replace(multi_turn, concurrency=args.concurrency)
        rag = replace(rag, concurrency=args.concurrency)
    env = engine_env(args, ("device", "dtype", "quantization", "page_size", "log_level"))
    if args.kv_cache_memory_gib is not None:
        preset = replace(preset, kv_cache_gib=args.kv_cache_memory_gib)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    out = args.out or f"bench/results/suite-{args.scenario}-{preset_name}.json"
    return SuiteOptions(
        scenarios=scenarios,
        preset_name=preset_name,
        preset=replace(preset, multi_turn=multi_turn, rag=rag),
        out_path=Path(out),
        seed=args.seed,
        url=args.url,
        num_prefill=1 if args.prefill is None else args.prefill,
        num_decode=1 if args.decode is None else args.decode,
        transport=args.transport,
        model=args.model or "default",
        engine_env=env,
    )


def _run_suite(args: argparse.Namespace) -> int:
    from radixserve.bench.suite import run_suite

    options = suite_options(args)
    if args.prefix_cache is False:
        raise UsageError("--no-prefix-cache: the suite runs the cache on and off itself")
    run_suite(options)
    return 0


def _refuse_flags(args: argparse.Namespace, not_for: Sequence[tuple[str, Any]], why: str) -> None:
    """A clear error naming the first flag of ``not_for`` (flag, its default) that was set."""
    names = {"prefix_cache": "--no-prefix-cache", "kv_cache_memory_gib": "--kv-cache-gib"}
    for key, default in not_for:
        if getattr(args, key) != default:
            raise UsageError(f"{names.get(key, '--' + key.replace('_', '-'))}: {why}")


# Flags `--scenario peer` does not take: it runs `radixserve up` with the `make serve`
# defaults and its own workload sizes. (flag, its default)
_NOT_FOR_PEER = (("device", None), ("dtype", None), ("kv_cache_memory_gib", None),
                 ("page_size", None), ("prefix_cache", None), ("concurrency", None),
                 ("conversations", None), ("rounds", None), ("users", None), ("url", None),
                 ("prefill", None), ("decode", None), ("transport", "nixl"))  # fmt: skip


# Flags `--scenario chaos` does not take (flag, its default): it sizes its own chats.
_NOT_FOR_CHAOS = (("kv_cache_memory_gib", None), ("page_size", None), ("prefix_cache", None),
                  ("concurrency", None), ("conversations", None), ("rounds", None),
                  ("users", None), ("url", None), ("quick", False))  # fmt: skip


def _run_chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench.chaos import ChaosOptions, run_chaos_bench

    _refuse_flags(args, _NOT_FOR_CHAOS, "--scenario chaos runs its own chats")
    seconds = 300.0 if args.seconds is None else args.seconds
    if not 30 <= seconds <= 86400:
        raise UsageError(f"--seconds must be in [30, 86400], not {seconds:g}")
    workers = {"prefill": 2 if args.prefill is None else args.prefill,
               "decode": 2 if args.decode is None else args.decode}  # fmt: skip
    for role, count in workers.items():
        if count < 2:
            raise UsageError(f"--{role} must be at least 2 for chaos (an event takes one "
                               f"worker down and leaves another serving), not {count}")  # fmt: skip
    decode_tp = 1 if args.decode_tp is None else args.decode_tp
    if decode_tp < 1:
        raise UsageError(f"--decode-tp must be 1 or more, not {decode_tp}")
    env = engine_env(args, ("model", "device", "dtype", "quantization", "log_level"))
    out = Path(args.out or f"bench/results/chaos-{seconds:g}s-seed{args.seed}.json")
    report = run_chaos_bench(ChaosOptions(
        seconds=seconds, seed=args.seed, out_path=out, num_prefill=workers["prefill"],
        num_decode=workers["decode"], decode_tp=decode_tp, transport=args.transport,
        engine_env=env,
    ))  # fmt: skip
    q = report["requests"]
    bad = q["wrong_answers"] + q["unclean_failures"] + q["hangs"] + bool(report["left_held"])
    return 1 if bad else 0


def _run_peer(args: argparse.Namespace) -> int:
    from pathlib import Path

    _refuse_flags(args, _NOT_FOR_PEER, "--scenario peer runs the `make serve` defaults and its "
                  "own workload sizes (--preset quick|seed)")  # fmt: skip

    from radixserve.bench.peer import PEER_PRESETS, PeerOptions, run_peer_bench

    preset_name = "quick" if args.quick else args.preset
    out = Path(args.out or f"bench/results/peer-{preset_name}.json")
    settings = _peer_settings(args)
    threads = {} if args.peer_threads is None else {"threads": args.peer_threads}
    peer_env = _peer_env(args)
    run_peer_bench(PeerOptions(preset_name, PEER_PRESETS[preset_name], out, settings,
                               model=args.model or "default", seed=args.seed, peer_env=peer_env, **threads))  # fmt: skip
    return 0


def _peer_settings(args: argparse.Namespace):
    """`PeerBenchSettings` from the environment, ``--peer-venv`` and ``--llama-server``
    over it."""
    from pathlib import Path

    from radixserve.bench.peer_servers import PeerBenchSettings

    update = {key: Path(getattr(args, key)) for key in ("peer_venv", "llama_server")
              if getattr(args, key)}  # fmt: skip
    return PeerBenchSettings().model_copy(update=update)


# Flags `--scenario decode` does not take (flag, its default): it runs `radixserve up`
# with the `make serve` defaults (--model, --kv-cache-gib and --log-level apply).
_NOT_FOR_DECODE = (("device", None), ("dtype", None), ("page_size", None),
                   ("prefix_cache", None), ("tp", None), ("audit_sample_rate", None),
                   ("audit_fail_closed", None), ("concurrency", None), ("conversations", None),
                   ("rounds", None), ("users", None), ("url", None), ("prefill", None),
                   ("decode", None), ("transport", "nixl"), ("preset", "seed"))  # fmt: skip


def _run_decode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench import decode
    from radixserve.bench import decode_cells as cells

    _refuse_flags(args, _NOT_FOR_DECODE, "--scenario decode runs `radixserve up` with the "
                  "`make serve` defaults (--model, --kv-cache-gib, --log-level apply)")  # fmt: skip
    # --quick: batches 1,4 at context 512, 32 tokens; a flag given wins over it
    batches = _sizes(args.batches, "--batches", 1, 1024) or ((1, 4) if args.quick
                                                              else cells.BATCHES)  # fmt: skip
    contexts = _sizes(args.contexts, "--contexts", 16, 1 << 20) or ((512,) if args.quick
                                                                     else cells.CONTEXTS)  # fmt: skip
    tokens = args.decode_tokens
    if tokens is None:
        tokens = 32 if args.quick else cells.DECODE_TOKENS
    if not 2 <= tokens < min(contexts):
        raise UsageError(f"--decode-tokens must be at least 2 and below the smallest context "
                           f"({min(contexts)}), not {tokens}")  # fmt: skip
    budget = args.prefill_budget_tokens
    if budget is not None and budget < 1:
        raise UsageError(f"--prefill-budget-tokens must be at least 1, not {budget}")
    threads = {} if args.peer_threads is None else {"threads": args.peer_threads}
    decode.run_decode_bench(cells.DecodeOptions(
        out_path=Path(args.out or "bench/results/decode.json"), batches=batches,
        contexts=contexts, decode_tokens=tokens,
        prefill_budget_tokens=cells.PREFILL_BUDGET_TOKENS if budget is None else budget,
        model=args.model or "default", seed=args.seed,
        engine_env=engine_env(args, ("kv_cache_memory_gib", "log_level")),
        settings=_peer_settings(args), peer_env=_peer_env(args), **threads,
    ))  # fmt: skip
    return 0


def _sizes(text: str | None, flag: str, low: int, high: int) -> tuple[int, ...]:
    """``1,4,16`` as (1, 4, 16), each in [low, high], no repeats; () if not given."""
    if text is None:
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated integers, not {text!r}") from None
    bad = [v for v in values if not low <= v <= high]
    if bad or len(set(values)) != len(values):
        raise UsageError(f"{flag} takes distinct integers in [{low}, {high}], not {text!r}")
    return values


# Flags `--scenario speculative` does not take (flag, its default): it builds one engine
# per drafting method itself, on the CPU, with the defaults (--model applies).
_NOT_FOR_SPECULATIVE = (("device", None), ("dtype", None), ("kv_cache_memory_gib", None),
                        ("page_size", None), ("prefix_cache", None), ("tp", None),
                        ("audit_sample_rate", None), ("audit_fail_closed", None),
                        ("speculative_method", None), ("speculative_max_draft_tokens", None),
                        ("concurrency", None), ("conversations", None), ("rounds", None),
                        ("users", None), ("url", None), ("prefill", None), ("decode", None),
                        ("transport", "nixl"), ("preset", "seed"))  # fmt: skip


def _run_speculative(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from radixserve.bench.speculative import run_speculative_bench
    from radixserve.bench.speculative_options import QUICK, SpeculativeOptions

    _refuse_flags(args, _NOT_FOR_SPECULATIVE, "--scenario speculative builds one engine per "
                  "drafting method itself, with the defaults (--model, --seed apply)")  # fmt: skip
    options = QUICK if args.quick else SpeculativeOptions()
    out = Path(args.out or "bench/results/speculative" + ("-quick" if args.quick else "") + ".json")
    return run_speculative_bench(replace(options, seed=args.seed, model=args.model or "default",
                                         out_path=out, through_cluster=bool(args.through_cluster)))  # fmt: skip


# Flags `--scenario lora` does not take: those speculative refuses (it builds its engine
# itself, on the CPU, with the defaults but max_loras; --model applies).
_NOT_FOR_LORA = _NOT_FOR_SPECULATIVE


def _run_lora(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from radixserve.bench.lora import run_lora_bench
    from radixserve.bench.lora_engine import QUICK, LoraOptions

    _refuse_flags(args, _NOT_FOR_LORA, "--scenario lora builds its engine itself, with the "
                  "defaults, and writes its own adapters (--model, --seed apply)")  # fmt: skip
    options = QUICK if args.quick else LoraOptions()
    out = Path(args.out) if args.out else options.out_path
    return run_lora_bench(replace(options, seed=args.seed, model=args.model or "default",
                                  out_path=out))  # fmt: skip


def _peer_env(args: argparse.Namespace) -> dict[str, str]:
    """``--peer-env KEY=VALUE`` items as a map (``--peer-threads`` checked too)."""
    peer_env = {}
    for item in args.peer_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--peer-env takes KEY=VALUE, not {item!r}")
        peer_env[key] = value
    if args.peer_threads is not None and args.peer_threads < 1:
        raise UsageError(f"--peer-threads must be at least 1, not {args.peer_threads}")
    return peer_env


# Flags `--scenario perplexity` does not take (flag, its default): it runs one engine at a
# time in this process, prefix cache off, on a fixed text.
_NOT_FOR_PERPLEXITY = (("prefix_cache", None), ("concurrency", None), ("conversations", None),
                       ("rounds", None), ("users", None), ("url", None), ("prefill", None),
                       ("decode", None), ("transport", "nixl"), ("preset", "seed"),
                       ("seed", 0))  # fmt: skip


def _run_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench import perplexity as ppl
    from radixserve.bench.peer_servers import PeerBenchSettings

    _refuse_flags(args, _NOT_FOR_PERPLEXITY, "--scenario perplexity runs one engine at a time "
                  "in this process, prefix cache off, on a fixed text")  # fmt: skip
    if args.quantization is not None and args.config is not None:
        raise UsageError("--quantization and --config: give one list of configurations")
    keys = ("model", "device", "dtype", "kv_cache_memory_gib", "page_size")
    base = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    dtype_given = args.dtype is not None
    if args.config is not None:
        configs = [ppl.parse_configuration(spec) for spec in args.config]
    elif args.quantization is not None:
        values = [v.strip() for v in args.quantization.split(",") if v.strip()]
        configs = ppl.quantization_configurations(values, dtype_given)
    else:
        configs = ppl.default_configurations(dtype_given)
    settings = PeerBenchSettings()
    if args.peer_venv:
        settings = settings.model_copy(update={"peer_venv": Path(args.peer_venv)})
    ctx = ppl.DEFAULT_CTX if args.ctx is None else args.ctx
    chunks = 2 if args.quick and args.chunks is None else args.chunks
    threads = {} if args.peer_threads is None else {"peer_threads": args.peer_threads}
    ppl.run_perplexity_bench(ppl.PerplexityOptions(
        configurations=tuple(configs), base=base, ctx=ctx, max_chunks=chunks,
        text_path=Path(args.text) if args.text else ppl.TEXT_PATH,
        out_path=Path(args.out or f"bench/results/perplexity-ctx{ctx}.json"),
        peer=settings, peer_env=_peer_env(args), **threads,
    ))  # fmt: skip
    return 0
