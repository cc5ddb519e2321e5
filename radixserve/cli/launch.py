"""Cluster commands: up (the local cluster), one service (prefill, decode, gateway,
kvstore, autoscaler, configured by RADIXSERVE_* settings as compose and Kubernetes run
them), and a container's probe and stop hooks."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from radixserve.cli.engine import (
    auth_args,
    engine_args,
    engine_env,
    gateway_args,
    lora_args,
    lora_env,
)
from radixserve.errors import UsageError
from radixserve.transfer import BACKENDS

if TYPE_CHECKING:
    from radixserve.launch.cluster import ClusterConfig


def cmd_up(args: argparse.Namespace) -> int:
    from radixserve.launch.cluster import (
        ClusterConfig,
        build_cluster,
        gateway_healthy,
        join_command,
    )
    from radixserve.services.gateway.settings import GatewaySettings

    env = {**engine_env(args), **lora_env(args)}
    decode_env = {}
    if args.local_prefill_max_tokens is not None:
        decode_env["RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS"] = str(
            args.local_prefill_max_tokens
        )
    gateway_env = {}
    if args.served_model_name:
        gateway_env["RADIXSERVE_GATEWAY_SERVED_MODEL_NAME"] = ",".join(args.served_model_name)
    flags = ("tool_parser", "reasoning_parser", "explorer_prompt_text")
    given = {key: getattr(args, key) for key in flags if getattr(args, key)}
    store = {key: getattr(args, key)
             for key in ("response_store_size", "response_store_ttl_s", "trace_buffer",
                         "allow_runtime_lora", "lora_dir", "lora_load_on_demand")
             if getattr(args, key) is not None}  # fmt: skip
    if args.lora_dir is not None:  # the gateway starts elsewhere: its absolute path
        store["lora_dir"] = args.lora_dir.resolve()
    gateway_env.update({f"RADIXSERVE_GATEWAY_{k.upper()}": str(v).lower() if isinstance(v, bool)
                        else str(v) for k, v in {**given, **store}.items()})  # fmt: skip
    auth = _gateway_auth(args)
    # a bad bound, a bad key or an unauthenticated non-loopback host is refused by name
    # before any process starts (the gateway reads RADIXSERVE_GATEWAY_API_KEYS itself)
    GatewaySettings(host=args.host, **store, **auth).require_secure()
    if "api_key_file" in auth:
        gateway_env["RADIXSERVE_GATEWAY_API_KEYS_FILE"] = str(auth["api_key_file"].resolve())
    if auth.get("allow_unauthenticated"):
        gateway_env["RADIXSERVE_GATEWAY_ALLOW_UNAUTHENTICATED"] = "true"
    try:
        config = ClusterConfig(
            num_prefill=args.prefill,
            num_decode=args.decode,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            transport=args.transport,
            kvstore=args.kvstore,
            nodes=args.nodes,
            host_tier_gib=args.host_tier_gib,
            disk_tier_dir=args.disk_tier_dir,
            disk_tier_gib=args.disk_tier_gib,
            host=args.host,
            port=args.port,
            engine_env=env,
            decode_env=decode_env,
            gateway_env=gateway_env,
            num_threads=args.num_threads,
            autoscale=args.autoscale,
            drain_timeout_s=args.drain_timeout_s,
        )
    except ValueError as exc:  # a shape the cluster refuses, by its flag: no traceback
        raise UsageError(str(exc)) from None
    print(
        f"radixserve: starting {config.num_prefill} prefill{_tp(config.prefill_tp)} and "
        f"{config.num_decode} decode{_tp(config.decode_tp)} "
        f"worker(s){_kvstores(config)} and the gateway "
        f"(KV transfer over {config.transport}) ...",
        flush=True,
    )
    try:  # every listening socket is bound here, before any process starts
        cluster = build_cluster(config, control_port=args.control_port)
    except OSError as exc:  # a port in use, by its address
        raise UsageError(exc.strerror or str(exc)) from None
    url = cluster.url or config.url  # with --port 0, the port bound

    def announce() -> None:
        print(
            f"radixserve: cluster up. OpenAI API at {url}/v1 "
            f"(metrics {url}/metrics, cache {url}/debug/cache). Ctrl-C stops it.",
            flush=True,
        )
        if cluster.control is not None and cluster.kvstore is not None:
            shared = dataclasses.replace(config, core_board=cluster.core_board)
            stores = cluster.kvstores
            prefill = join_command(shared, cluster.kvstore, kvstores=stores)
            decode = join_command(shared, cluster.kvstore, "decode", stores)
            # the same command but for the role, unless --tp differs or the kvstore list
            # (a RADIXSERVE_<ROLE>_KVSTORES) is in it
            same = len(stores) <= 1 and config.decode_tp == config.prefill_tp
            print(f"radixserve: add a worker: {prefill}"
                  f"{'  (or decode instead of prefill)' if same else ''}", flush=True)  # fmt: skip
            if not same:
                print(f"radixserve: add a decode worker: {decode}", flush=True)
            print(f"radixserve: pool sizes at {cluster.control.url}/v1/pools"
                  f"{' (the autoscaler sets them)' if config.autoscale else ''}", flush=True)  # fmt: skip

    pools = cluster.pools
    try:
        code = cluster.supervisor.run(
            ready=lambda: gateway_healthy(url, 0.5),
            on_ready=announce,
            on_poll=pools.reconcile if pools is not None else None,
        )
    finally:
        cluster.stop()
    failure = cluster.supervisor.failure
    if failure is not None:  # the same error twice before the cluster was ready
        print(f"radixserve: {failure}", file=sys.stderr, flush=True)
    print("radixserve: cluster stopped", flush=True)
    return code


def _gateway_auth(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's auth flags given, as settings fields."""
    return {key: getattr(args, key) for key in ("api_key_file", "allow_unauthenticated")
            if getattr(args, key, None) is not None}  # fmt: skip


def _kvstores(config: ClusterConfig) -> str:
    if not config.kvstore:
        return ""
    return ", the kvstore" if config.nodes == 1 else f", {config.nodes} kvstores (one per node)"


def _tp(size: int) -> str:
    return f" (TP={size})" if size > 1 else ""


def worker_tp(value: str) -> int | str:
    """--tp's value: a size from 1 to 64, or 'auto'."""
    from radixserve.runtime.settings import parse_tp

    try:
        return parse_tp(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def cmd_service(args: argparse.Namespace) -> int:
    if args.check_config:
        return _check_config(args)
    if args.command == "gateway":
        from radixserve.services.gateway.__main__ import main as gateway_main

        return gateway_main(_gateway_auth(args))
    if args.command == "autoscaler":
        from radixserve.services.autoscaler.__main__ import main as autoscaler_main

        return autoscaler_main()
    from radixserve.runtime.service import serve_until_signalled
    from radixserve.runtime.worker import run_worker

    overrides = _service_overrides(args)
    if args.command in ("kvstore", "prefill", "decode"):  # refused before the model loads
        from radixserve.services.decode import DecodeSettings
        from radixserve.services.kvstore import KVStoreSettings
        from radixserve.services.prefill import PrefillSettings

        own = {"kvstore": KVStoreSettings, "prefill": PrefillSettings, "decode": DecodeSettings}
        own[args.command](**overrides).require_secure(args.command)
    if args.command == "kvstore":
        from radixserve.services.kvstore import KVStoreService, KVStoreSettings

        service = KVStoreService(KVStoreSettings(**overrides))
        return serve_until_signalled(service.run, service.begin_drain)
    if args.command == "prefill":
        from radixserve.services.prefill import PrefillSettings, PrefillWorker

        return run_worker(PrefillWorker, PrefillSettings(**overrides))
    from radixserve.services.decode import DecodeSettings, DecodeWorker

    return run_worker(DecodeWorker, DecodeSettings(**overrides))


def _service_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """A service command's flags as settings fields (over the environment's)."""
    fields = (("join", "kvstore"), ("name", "name"), ("port", "port"), ("host", "host"),
              ("advertise_host", "advertise_host"), ("transport", "transfer_backend"), ("tp", "tp"),
              ("disk_tier_dir", "disk_tier_dir"), ("disk_tier_gib", "disk_tier_gib"))  # fmt: skip
    return {
        key: getattr(args, flag) for flag, key in fields if getattr(args, flag, None) is not None
    }


def _check_config(args: argparse.Namespace) -> int:
    """Print the service's settings as JSON (exit 0), or say what is wrong (exit 1 for
    an unknown RADIXSERVE_* name, 2 for a refused value); start nothing."""
    import json

    from radixserve.runtime.settings_check import check_config

    overrides = _service_overrides(args)
    if args.command == "gateway":
        overrides.update(_gateway_auth(args))
    settings = check_config(args.command, overrides)
    print(json.dumps(settings, indent=2, sort_keys=True))
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """Exit 0 if the health URL answers 200 (a container's HEALTHCHECK), else 1."""
    from radixserve.runtime.probe import ProbeSettings, probe

    settings = ProbeSettings()  # type: ignore[call-arg]  # every field from the environment
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
            raise UsageError(f"--{flag.replace('_', '-')} must be 0 or more")
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


def disk_tier_args(parser: argparse.ArgumentParser) -> None:
    """The kvstore's disk tier flags (`radixserve up` and `radixserve kvstore`)."""
    parser.add_argument("--disk-tier-dir",
                        help="directory (a local SSD) where the kvstore writes the pages its "
                        "host tier evicts and finds them again after a restart (default: "
                        "no disk tier)")  # fmt: skip
    parser.add_argument("--disk-tier-gib", type=float,
                        help="bound of the disk tier's files (default 64); the least "
                        "recently used pages are overwritten past it")  # fmt: skip


def add_commands(sub: Any) -> None:
    up = sub.add_parser(
        "up", help="run the local cluster: gateway, prefill and decode workers as processes"
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    up.add_argument("--prefill-tp", type=int, default=1,
                    help="tensor-parallel size of each prefill worker: ranks (processes, one "
                    "device each) its model is split over (default 1)")  # fmt: skip
    up.add_argument("--decode-tp", type=int, default=1,
                    help="tensor-parallel size of each decode worker (default 1; KV pages "
                    "move between the pools when one size divides the other)")  # fmt: skip
    up.add_argument("--transport", choices=BACKENDS, default="nixl",
                    help="how KV pages move between workers (default nixl)")  # fmt: skip
    up.add_argument("--no-kvstore", action="store_false", dest="kvstore",
                    help="do not start the kvstore (the cluster-wide cache index)")  # fmt: skip
    up.add_argument("--nodes", type=int, default=1,
                    help="kvstores to start, one per node as a cluster of N machines has: each "
                    "holds its node's host tier (workers spread over the nodes spill there) and "
                    "a shard of the cache index, and every one the membership (default 1)")  # fmt: skip
    up.add_argument("--host-tier-gib", type=float,
                    help="host-memory tier of the kvstore (of each, with --nodes) that evicted "
                    "KV spills into (default 4; 0 = none)")  # fmt: skip
    disk_tier_args(up)
    up.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    up.add_argument("--port", type=int, default=8000,
                    help="gateway port (default 8000; 0: any free one, printed)")  # fmt: skip
    gateway_args(up)
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
    engine_args(up, tp=False)
    lora_args(up)
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
            service.add_argument("--transport", choices=BACKENDS,
                                 help="KV transfer backend (the cluster's)")  # fmt: skip
            service.add_argument("--tp", type=worker_tp,
                                 help="tensor-parallel size: ranks (processes, one device "
                                 "each) the model is split over (default 1), or 'auto': one "
                                 "per visible CUDA device")  # fmt: skip
        if name == "kvstore":
            disk_tier_args(service)
        if name == "gateway":
            auth_args(service)
        if name in ("prefill", "decode", "kvstore"):
            service.add_argument("--name", help="name in the cluster (default <role>-<port>)")
            service.add_argument("--host", help="listen address (default 127.0.0.1)")
            service.add_argument("--port", type=int, help="control port (default: any free)")
            service.add_argument("--advertise-host",
                                 help="address others dial to reach it (default: --host)")  # fmt: skip
        service.set_defaults(func=cmd_service)
