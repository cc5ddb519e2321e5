"""`radixserve up`: the whole local cluster as separate processes under one supervisor.

(`radixserve up` itself is `radixserve.cli`'s ``up``; `radixserve.bench.local_cluster`
runs the same processes for the benchmarks and tests.)

`cluster_specs` turns a `ClusterConfig` into one `ProcessSpec` per process — the
kvstore, prefill workers, decode workers, then the gateway — each configured only
through environment settings (``RADIXSERVE_*``), exactly as compose or Kubernetes would
run them. Every listening socket of a service (the kvstore's and each worker's control
socket, the gateway's ``host:port``, the autoscaler's HTTP port) is bound here, in the
supervisor's process, before anything starts, and inherited by the service
(`radixserve.launch.listeners`): ports are never probed and handed on, so two services
cannot be given one port, and a restarted service keeps its port. Port 0 (``--port 0``,
the tests and benchmarks) means any free port; the bound one is in
`ClusterProcesses.url`. With the kvstore (the default) nobody is told another's address
but the kvstore's: workers register there and the gateway and decode workers find them
through its membership (`radixserve.runtime.membership`), so workers can be added and
removed while it runs (`LocalPools`, `join_command`). Without it, the addresses are static lists.
`radixserve up` runs them under a `Supervisor`: it waits for the gateway's /health
(`gateway_healthy`), prints the URL, restarts whatever crashes and stops everything on
Ctrl-C or SIGTERM.

CPU threads: unless ``num_threads`` is given, the workers share the machine's cores
through a core board (`radixserve.engine.cores`): each step of a worker runs on the
cores divided by the workers computing at that moment, so a worker alone gets them all
and two busy ones do not oversubscribe them. ``num_threads=N`` gives every worker N
threads, fixed (N=1 on two workers and two cores: the cores split evenly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.engine.cores import board_path
from radixserve.launch.listeners import Listener
from radixserve.launch.local_pools import LocalPools, PoolControl
from radixserve.launch.supervisor import ProcessSpec, Supervisor
from radixserve.launch.warm import WarmServer, available
from radixserve.runtime.probe import probe
from radixserve.transfer import BACKENDS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """What `radixserve up` starts (every field has a CLI flag)."""

    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1  # tensor-parallel ranks (processes, one device each) per prefill worker
    decode_tp: int = 1  # ... per decode worker
    kvstore: bool = True  # start the kvstore (the cluster-wide cache index and host tier)
    nodes: int = 1  # kvstores, one per "node": each its host tier and a shard of the index
    host_tier_gib: float | None = None  # the kvstore's host tier (None: its default)
    disk_tier_dir: str | None = None  # the kvstore's disk tier under it (None: none)
    disk_tier_gib: float | None = None  # its bound (None: the kvstore's default)
    transport: str = "nixl"
    host: str = "127.0.0.1"
    port: int = 8000  # the gateway's (0: any free port, bound by `build_cluster`)
    engine_env: dict[str, str] = field(default_factory=dict)  # RADIXSERVE_* for every worker
    prefill_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_PREFILL_*
    decode_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_DECODE_*
    gateway_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_GATEWAY_*
    num_threads: int | None = None  # fixed threads per worker (None: share the cores)
    core_board: str | None = None  # the board file (`build_cluster` makes one)
    autoscale: bool = False  # run the autoscaler (needs the kvstore: pools are resizable)
    autoscaler_env: dict[str, str] = field(default_factory=dict)  # RADIXSERVE_AUTOSCALER_*
    drain_timeout_s: float = 60.0  # a retired worker still running after this is killed

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker (--decode 1)")
        if self.num_prefill < 0:
            raise ValueError("--prefill must be 0 or more")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("--prefill-tp and --decode-tp must be 1 or more")
        if self.transport not in BACKENDS:
            raise ValueError(f"--transport must be nixl or zmq, not {self.transport!r}")
        if self.host_tier_gib is not None and self.host_tier_gib < 0:
            raise ValueError("--host-tier-gib must be 0 (no host tier) or more")
        if self.autoscale and not self.kvstore:
            raise ValueError("--autoscale needs the kvstore (new workers join through it)")
        if not 1 <= self.nodes <= 16:
            raise ValueError("--nodes must be 1 to 16")
        if self.nodes > 1 and not self.kvstore:
            raise ValueError("--nodes needs the kvstore (one per node)")
        self._check_disk_tier()

    def _check_disk_tier(self) -> None:
        if self.disk_tier_gib is not None and self.disk_tier_dir is None:
            raise ValueError("--disk-tier-gib needs --disk-tier-dir (where the files go)")
        if self.disk_tier_gib is not None and self.disk_tier_gib <= 0:
            raise ValueError("--disk-tier-gib must be more than 0")
        if self.disk_tier_dir is not None and not self.kvstore:
            raise ValueError("--disk-tier-dir needs the kvstore (it owns the disk tier)")
        if self.disk_tier_dir is not None and self.host_tier_gib == 0:
            raise ValueError("--disk-tier-dir needs a host tier (--host-tier-gib above 0): "
                             "the disk tier holds what the host tier evicts")  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def base_env(config: ClusterConfig) -> dict[str, str]:
    """What every process of the cluster gets: the engine settings and a thread count
    (with a core board, the most a worker takes when the others are idle)."""
    if config.num_threads:
        threads = config.num_threads
    elif config.core_board:
        threads = os.cpu_count() or 1
    else:
        ranks = config.num_prefill * config.prefill_tp + config.num_decode * config.decode_tp
        threads = max(1, (os.cpu_count() or 1) // ranks)
    return {
        "RADIXSERVE_LOAD_PROGRESS": "false",
        "RADIXSERVE_NUM_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        **({"RADIXSERVE_CORE_BOARD": config.core_board} if config.core_board else {}),
        **config.engine_env,
    }


#: the services that import torch, forked from a warm-start server (`radixserve.launch.warm`)
WARM_SERVICES = tuple(f"radixserve.services.{s}" for s in ("decode", "prefill", "kvstore"))


def _service_spec(name: str, service: str, env: dict[str, str]) -> ProcessSpec:
    """Process ``name`` running ``python -m radixserve.services.<service>`` with ``env``."""
    return ProcessSpec(name, [sys.executable, "-m", f"radixserve.services.{service}"], env)


def _listening(
    name: str, service: str, env: dict[str, str], prefix: str, listener: Listener
) -> ProcessSpec:
    """`_service_spec` of a service that serves on ``listener`` (``<prefix>LISTEN_FD``),
    its ``<prefix>PORT`` the listener's port."""
    env[f"{prefix}PORT"] = str(listener.port)
    spec = _service_spec(name, service, env)
    return dataclasses.replace(spec, sockets={f"{prefix}LISTEN_FD": listener})


def worker_spec(
    config: ClusterConfig,
    role: str,
    index: int,
    kvstore: str | None,
    prefill_addrs: list[str],
    kvstores: Sequence[str] = (),
) -> tuple[ProcessSpec, str]:
    """Worker ``index`` of ``role`` on a loopback port bound now (its spec holds the
    socket), and its control address. With a ``kvstore`` address it registers there;
    otherwise a decode worker is told the ``prefill_addrs``. With ``kvstores`` (one per
    node) it is on node ``index`` mod their count, and that node's kvstore is its own."""
    name, prefix, listener = f"{role}-{index}", f"RADIXSERVE_{role.upper()}_", Listener()
    extra = config.prefill_env if role == "prefill" else config.decode_env
    tp = config.prefill_tp if role == "prefill" else config.decode_tp
    if len(kvstores) > 1:
        kvstore = kvstores[index % len(kvstores)]
    env = {
        **base_env(config),
        **({f"{prefix}TP": str(tp)} if tp > 1 else {}),
        **({f"{prefix}KVSTORE": kvstore} if kvstore else {}),
        **({f"{prefix}KVSTORES": json.dumps(list(kvstores))} if len(kvstores) > 1 else {}),
        f"{prefix}NAME": name,
        f"{prefix}TRANSFER_BACKEND": config.transport,
        **extra,
    }
    if role == "decode" and not kvstore:
        env["RADIXSERVE_DECODE_PREFILL_WORKERS"] = json.dumps(prefill_addrs)
    spec = _listening(name, role, env, prefix, listener)
    return spec, f"tcp://127.0.0.1:{listener.port}"


def kvstore_name(config: ClusterConfig, node: int) -> str:
    """``kvstore``, or with several nodes ``kvstore-<node>``."""
    return "kvstore" if config.nodes == 1 else f"kvstore-{node}"


def kvstore_spec(config: ClusterConfig, listener: Listener, node: int = 0) -> ProcessSpec:
    """The kvstore of ``node``, serving on ``listener`` (its address:
    ``tcp://127.0.0.1:<port>``); with several nodes its disk tier is the directory's
    ``node-<node>``."""
    name = kvstore_name(config, node)
    env = {
        **base_env(config),
        "RADIXSERVE_KVSTORE_NAME": name,
        "RADIXSERVE_KVSTORE_TRANSFER_BACKEND": config.transport,
    }
    if config.host_tier_gib is not None:
        env["RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB"] = str(config.host_tier_gib)
    if config.disk_tier_dir is not None:
        disk = config.disk_tier_dir
        env["RADIXSERVE_KVSTORE_DISK_TIER_DIR"] = (
            disk if config.nodes == 1 else os.path.join(disk, f"node-{node}"))  # fmt: skip
    if config.disk_tier_gib is not None:
        env["RADIXSERVE_KVSTORE_DISK_TIER_GIB"] = str(config.disk_tier_gib)
    return _listening(name, "kvstore", env, "RADIXSERVE_KVSTORE_", listener)


@dataclass
class ClusterSockets:
    """The listening sockets of a cluster's services whose addresses others are told:
    the gateway's (``host:port``), the kvstore's and the autoscaler's. Port 0 is bound
    at once; a given port by `bind` (before anything starts)."""

    gateway: Listener
    kvstores: list[Listener]  # one per node; none without the kvstore
    autoscaler: Listener | None

    @classmethod
    def of(cls, config: ClusterConfig, kvstore_port: int = 0) -> ClusterSockets:
        """``kvstore_port``: the first kvstore's (the others any free port)."""
        kvstores = [Listener("127.0.0.1", kvstore_port if node == 0 else 0)
                    for node in range(config.nodes)] if config.kvstore else []  # fmt: skip
        return cls(
            gateway=Listener(config.host, config.port),
            kvstores=kvstores,
            autoscaler=_autoscaler_listener(config) if config.autoscale else None,
        )

    @property
    def kvstore(self) -> Listener | None:
        """The first node's kvstore's."""
        return self.kvstores[0] if self.kvstores else None

    def bind(self) -> None:
        """Bind every socket (`OSError` naming the address of one that cannot be)."""
        for listener in (self.gateway, *self.kvstores, self.autoscaler):
            if listener is not None:
                listener.bind()

    def kvstore_addresses(self) -> list[str]:
        return [f"tcp://127.0.0.1:{listener.port}" for listener in self.kvstores]


def _autoscaler_listener(config: ClusterConfig) -> Listener:
    """The autoscaler's HTTP socket, where its settings say (``autoscaler_env``, else
    this process's environment; default 127.0.0.1:8090, 0 = any free port)."""
    env = {**os.environ, **config.autoscaler_env}
    host = env.get("RADIXSERVE_AUTOSCALER_HOST", "127.0.0.1")
    return Listener(host, int(env.get("RADIXSERVE_AUTOSCALER_PORT", "8090")))


def cluster_specs(
    config: ClusterConfig, kvstore_port: int | None = None, sockets: ClusterSockets | None = None
) -> list[ProcessSpec]:
    """The processes of the cluster, the kvstore and workers first, each with its own
    environment and listening socket (``sockets``: those of the gateway, kvstore and
    autoscaler, default `ClusterSockets.of` ``config``, the kvstore on ``kvstore_port``
    or any free port). The autoscaler is not among them (`autoscaler_spec`)."""
    sockets = sockets or ClusterSockets.of(config, kvstore_port or 0)
    specs = [kvstore_spec(config, listener, node) for node, listener in enumerate(sockets.kvstores)]
    kvstores = sockets.kvstore_addresses()
    kvstore = kvstores[0] if kvstores else None
    addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (("prefill", config.num_prefill), ("decode", config.num_decode)):
        for i in range(count):
            spec, address = worker_spec(config, role, i, kvstore, addresses["prefill"], kvstores)
            specs.append(spec)
            addresses[role].append(address)
    env = {
        **base_env(config),
        "RADIXSERVE_GATEWAY_HOST": config.host,
        **({"RADIXSERVE_GATEWAY_KVSTORE": kvstore} if kvstore else {}),
        **({"RADIXSERVE_GATEWAY_KVSTORES": json.dumps(kvstores)} if len(kvstores) > 1 else {}),
        **config.gateway_env,
    }
    if sockets.autoscaler is not None:  # its decisions, on the gateway's /explorer
        env.setdefault("RADIXSERVE_GATEWAY_AUTOSCALER_URL", _url(sockets.autoscaler))
    if not kvstore:
        env["RADIXSERVE_GATEWAY_DECODE_WORKERS"] = json.dumps(addresses["decode"])
        env["RADIXSERVE_GATEWAY_PREFILL_WORKERS"] = json.dumps(addresses["prefill"])
    specs.append(_listening("gateway", "gateway", env, "RADIXSERVE_GATEWAY_", sockets.gateway))
    return specs


def _url(listener: Listener) -> str:
    host = "127.0.0.1" if listener.host in ("0.0.0.0", "") else listener.host
    return f"http://{host}:{listener.port}"


def join_command(
    config: ClusterConfig, kvstore: str, role: str = "prefill", kvstores: Sequence[str] = ()
) -> str:
    """The one-line command that starts one more worker of ``role`` and joins it to the
    cluster whose kvstore is at ``kvstore`` (the engine settings it must share first;
    with a core board, the board too, so a worker started on this host shares its cores;
    with several ``kvstores``, the list: it joins the first's node)."""
    program = sys.argv[0] if os.path.basename(sys.argv[0]) == "radixserve" else None
    argv = [program] if program else [sys.executable, "-m", "radixserve.cli"]
    argv += [role, "--join", kvstore]
    tp = config.prefill_tp if role == "prefill" else config.decode_tp
    if tp > 1:
        argv += ["--tp", str(tp)]
    if config.transport != "nixl":
        argv += ["--transport", config.transport]
    extra = config.prefill_env if role == "prefill" else config.decode_env
    board = {}
    if config.core_board and not config.num_threads:
        board = {"RADIXSERVE_CORE_BOARD": config.core_board,
                 "RADIXSERVE_NUM_THREADS": str(os.cpu_count() or 1)}  # fmt: skip
    if len(kvstores) > 1:
        board[f"RADIXSERVE_{role.upper()}_KVSTORES"] = json.dumps(list(kvstores))
    env = [f"{k}={shlex.quote(v)}" for k, v in {**config.engine_env, **extra, **board}.items()]
    return " ".join([*env, shlex.join(argv)])


def autoscaler_spec(
    config: ClusterConfig, control_url: str, listener: Listener | None = None
) -> ProcessSpec:
    """The autoscaler, sizing this cluster's pools through its control API (``local``),
    its HTTP side on ``listener`` (default: bound on the port its settings give)."""
    env = {
        **base_env(config),
        "RADIXSERVE_AUTOSCALER_CONNECTOR": "local",
        "RADIXSERVE_AUTOSCALER_LOCAL_URL": control_url,
        "RADIXSERVE_AUTOSCALER_GATEWAY_URL": config.url,
        **config.autoscaler_env,
    }
    listener = listener or _autoscaler_listener(config)
    return _listening("autoscaler", "autoscaler", env, "RADIXSERVE_AUTOSCALER_", listener)


@dataclass
class ClusterProcesses:
    """A cluster as processes: the supervisor and, with the kvstore, the resizable pools
    and their control API (started, on loopback)."""

    supervisor: Supervisor
    kvstore: str | None
    pools: LocalPools | None
    control: PoolControl | None

    core_board: str | None = None  # removed at stop
    url: str = ""  # the gateway's, on the port bound (``http://host:port``)
    autoscaler_url: str | None = None  # the autoscaler's HTTP side (/health, /metrics)
    kvstores: list[str] = field(default_factory=list)  # one per node (the first: ``kvstore``)

    def stop(self) -> None:
        self.supervisor.stop()
        if self.control is not None:
            self.control.close()
        if self.core_board is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.core_board)


def build_cluster(
    config: ClusterConfig, restart_backoff_s: float = 1.0, control_port: int = 0
) -> ClusterProcesses:
    """The supervisor of ``config``'s processes (not started) with its pools and control
    API (started) when the cluster has a kvstore. Every listening socket is bound first:
    a port in use is an `OSError` naming it, before any process starts; with port 0
    the gateway's port is the one bound (``url``). Without ``num_threads`` the workers
    share the cores through a core board in the temporary directory."""
    sockets = ClusterSockets.of(config)
    sockets.bind()
    config = dataclasses.replace(config, port=sockets.gateway.port)
    board = None
    if config.num_threads is None and config.core_board is None:
        board = board_path(tempfile.gettempdir(), f"{os.getpid()}-{config.port}")
        config = dataclasses.replace(config, core_board=board)
    supervisor = Supervisor(
        cluster_specs(config, sockets=sockets),
        restart_backoff_s=restart_backoff_s,
        warm=WarmServer(WARM_SERVICES) if available() else None,
    )
    if sockets.kvstore is None:
        return ClusterProcesses(supervisor, None, None, None, board, config.url)
    kvstores = sockets.kvstore_addresses()
    kvstore = kvstores[0]

    def spawn(role: str, index: int) -> ProcessSpec:
        return worker_spec(config, role, index, kvstore, [], kvstores)[0]

    initial = {"prefill": config.num_prefill, "decode": config.num_decode}
    pools = LocalPools(supervisor, initial, spawn, config.drain_timeout_s)
    control = PoolControl(pools, port=control_port)
    control.start()
    scaler = None
    if sockets.autoscaler is not None:
        supervisor.add(autoscaler_spec(config, control.url, sockets.autoscaler))
        scaler = _url(sockets.autoscaler)
    return ClusterProcesses(supervisor, kvstore, pools, control, board, config.url, scaler,
                            kvstores)  # fmt: skip


def gateway_healthy(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``url``/health answers 200 (every decode link the gateway needs is up)."""
    return probe(f"{url}/health", timeout_s)[0]
