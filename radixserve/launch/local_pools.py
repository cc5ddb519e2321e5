"""The worker pools of `radixserve up`, resizable while it runs.

`LocalPools` holds the desired number of prefill and decode workers and, on the
supervisor's thread (`reconcile`, after every supervision pass), starts worker processes
(``spawn(role, index)`` makes each one's spec, `radixserve.launch.cluster.worker_spec`: they
register with the cluster's kvstore and routing follows) or retires the newest ones (SIGTERM: each drains, then exits 0). `PoolControl`
serves the desired sizes over HTTP on loopback, in the shape of Kubernetes' ``scale``
subresource, so the autoscaler's ``local`` connector sets them the way its
``kubernetes`` connector patches Deployments::

    GET /v1/pools                   {"prefill": Scale, "decode": Scale}
    GET /v1/pools/<role>            Scale
    PUT /v1/pools/<role>            {"spec": {"replicas": n}}  ->  Scale

    Scale = {"kind": "Scale", "metadata": {"name": role},
             "spec": {"replicas": desired}, "status": {"replicas": running, "retiring": n}}
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from radixserve.launch.supervisor import ProcessSpec, Supervisor

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MAX_REPLICAS = 256
_MIN_REPLICAS = {"prefill": 0, "decode": 1}


class PoolError(ValueError):
    """A pool size that cannot be set (unknown role, out of bounds)."""


class LocalPools:
    """Desired pool sizes (thread-safe) and their reconciliation with the supervisor."""

    def __init__(
        self,
        supervisor: Supervisor,
        initial: Mapping[str, int],
        spawn: Callable[[str, int], ProcessSpec],
        drain_timeout_s: float,
    ) -> None:
        self._supervisor = supervisor
        self._spawn = spawn
        self._drain_timeout_s = drain_timeout_s
        self._lock = threading.Lock()
        self._desired = {role: int(initial[role]) for role in ROLES}
        self._next = dict(self._desired)  # index of the next worker of each role
        self._running = {role: self._names(role) for role in ROLES}
        self._retiring = {role: 0 for role in ROLES}

    def set_replicas(self, role: str, replicas: object) -> None:
        if role not in ROLES:
            raise PoolError(f"no pool {role!r}; pools: {', '.join(ROLES)}")
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise PoolError(f"replicas must be an integer, not {replicas!r}")
        if not _MIN_REPLICAS[role] <= replicas <= MAX_REPLICAS:
            raise PoolError(
                f"{role} replicas must be in [{_MIN_REPLICAS[role]}, {MAX_REPLICAS}], "
                f"not {replicas}"
            )
        with self._lock:
            if self._desired[role] != replicas:
                logger.warning("pool %s: %d -> %d workers", role, self._desired[role], replicas)
            self._desired[role] = replicas

    def scale(self, role: str) -> dict[str, Any]:
        """The pool as a Kubernetes-style ``Scale`` object."""
        if role not in ROLES:
            raise PoolError(f"no pool {role!r}; pools: {', '.join(ROLES)}")
        with self._lock:
            running, retiring = list(self._running[role]), self._retiring[role]
            desired = self._desired[role]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": role},
            "spec": {"replicas": desired},
            "status": {"replicas": len(running), "retiring": retiring, "workers": running},
        }

    def reconcile(self) -> None:
        """On the supervisor's thread: start or retire workers to match the desired sizes."""
        sup = self._supervisor
        for role in ROLES:
            with self._lock:
                desired = self._desired[role]
            names = self._names(role)
            while len(names) < desired:
                index = self._next[role]
                self._next[role] += 1
                spec = self._spawn(role, index)
                sup.add(spec)
                names.append(spec.name)
                logger.warning("pool %s: started %s", role, spec.name)
            while len(names) > desired:
                newest = max(names, key=lambda n: int(n.rsplit("-", 1)[1]))
                sup.retire(newest, self._drain_timeout_s)
                names.remove(newest)
                logger.warning("pool %s: retiring %s (it drains first)", role, newest)
            retiring = sum(1 for n in sup.names() if n.startswith(f"{role}-") and sup.retiring(n))
            with self._lock:
                self._running[role] = names
                self._retiring[role] = retiring

    def _names(self, role: str) -> list[str]:
        sup = self._supervisor
        return [n for n in sup.names() if n.startswith(f"{role}-") and not sup.retiring(n)]


class PoolControl:
    """The HTTP control API of `LocalPools` on ``host:port`` (a thread of its own)."""

    def __init__(self, pools: LocalPools, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("_Handler", (_PoolHandler,), {"pools": pools})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="radixserve-pool-control", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _PoolHandler(BaseHTTPRequestHandler):
    pools: LocalPools

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        role = self._role()
        if role == "":
            self._reply(200, {r: self.pools.scale(r) for r in ROLES})
        elif role is not None:
            self._reply(200, self.pools.scale(role))

    def do_PUT(self) -> None:  # noqa: N802
        role = self._role()
        if not role:
            self._reply(405, {"error": "PUT /v1/pools/<role>"})
            return
        try:
            length = int(self.headers.get("content-length") or 0)
            if length > 4096:
                raise PoolError("body too large")
            body = json.loads(self.rfile.read(length) or b"{}")
            replicas = body["spec"]["replicas"] if isinstance(body, dict) else None
            self.pools.set_replicas(role, replicas)
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": f'expected {{"spec": {{"replicas": n}}}}: {exc}'})
            return
        self._reply(200, self.pools.scale(role))

    do_PATCH = do_PUT

    def _role(self) -> str | None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/pools":
            return ""
        prefix, _, role = path.rpartition("/")
        if prefix == "/v1/pools" and role in ROLES:
            return role
        self._reply(404, {"error": f"no such resource {path!r}; see /v1/pools"})
        return None

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("pool control: " + format, *args)
