"""Connectors: `radixserve up`'s pools through their control API (real supervised
processes that drain on SIGTERM), and Deployments' scale subresource through the
official kubernetes client."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from radixserve.launch.local_pools import LocalPools, PoolControl
from radixserve.launch.supervisor import ProcessSpec, Supervisor
from radixserve.services.autoscaler.connectors import (
    ConnectorError,
    KubernetesConnector,
    LocalConnector,
)

# A stand-in worker process: says it is up (a file), and on SIGTERM "drains" for a
# moment, then exits 0.
WORKER = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.2), sys.exit(0)))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "while True: time.sleep(0.1)\n"
)


def test_local_connector_resizes_the_pools_of_radixserve_up(tmp_path):
    def _spawn(role: str, index: int) -> ProcessSpec:
        flag = tmp_path / f"{role}-{index}"
        return ProcessSpec(f"{role}-{index}", [sys.executable, "-c", WORKER, str(flag)])

    def wait_up(*names: str) -> None:
        deadline = time.monotonic() + 20
        while not all((tmp_path / n).exists() for n in names):
            assert time.monotonic() < deadline, f"{names} did not start"
            time.sleep(0.05)

    supervisor = Supervisor([_spawn("prefill", 0), _spawn("decode", 0)])
    supervisor.start()
    pools = LocalPools(supervisor, {"prefill": 1, "decode": 1}, _spawn, drain_timeout_s=10)
    control = PoolControl(pools)
    control.start()
    connector = LocalConnector(control.url)
    try:
        assert connector.get("prefill").desired == 1
        connector.set("prefill", 3)
        pools.reconcile()  # on the supervisor's thread, as `radixserve up` polls
        assert sorted(n for n in supervisor.names() if n.startswith("prefill")) == [
            "prefill-0", "prefill-1", "prefill-2",
        ]  # fmt: skip
        assert connector.get("prefill").running == 3
        wait_up("prefill-1", "prefill-2")
        connector.set("prefill", 1)
        pools.reconcile()
        # the newest two drain (SIGTERM) and, once exited 0, are forgotten
        deadline = time.monotonic() + 10
        while len(supervisor.retired) < 2 and time.monotonic() < deadline:
            supervisor.poll()
            time.sleep(0.05)
        assert supervisor.retired == {"prefill-1": 0, "prefill-2": 0}
        assert supervisor.alive("prefill-0") and supervisor.alive("decode-0")
        pools.reconcile()
        scale = httpx.get(f"{control.url}/v1/pools/prefill").json()
        assert scale["spec"]["replicas"] == 1 and scale["status"]["replicas"] == 1
        # a scale-up after a scale-down takes a new name: nothing is confused with the old
        connector.set("prefill", 2)
        pools.reconcile()
        assert "prefill-3" in supervisor.names()
        # bad requests are refused by name, and nothing changes
        assert (
            httpx.put(f"{control.url}/v1/pools/decode", json={"spec": {"replicas": 0}}).status_code
            == 400
        )  # a cluster needs a decode worker
        assert httpx.put(f"{control.url}/v1/pools/gpu", json={"spec": {"replicas": 1}}
                         ).status_code == 404  # fmt: skip
        bad = httpx.put(f"{control.url}/v1/pools/prefill", json={"replicas": "two"})
        assert bad.status_code == 400 and "spec" in bad.json()["error"]
        with pytest.raises(ConnectorError, match="400"):
            connector.set("decode", 0)
        assert connector.get("decode").desired == 1
    finally:
        connector.close()
        control.close()
        supervisor.stop()


class _FakeApiServer(BaseHTTPRequestHandler):
    """Serves apps/v1 Deployments' ``scale`` subresource the way the Kubernetes API server
    does: GET returns an autoscaling/v1 Scale, PATCH applies a merge patch of
    spec.replicas, and any other verb or path is refused (403), like an RBAC Role that
    grants only get and patch on deployments/scale. No API server can run on this
    machine, so this stands in for one; the client is the official one, unmodified."""

    replicas = {"radixserve-prefill": 1, "radixserve-decode": 2}
    calls: list[tuple[str, str, str]] = []

    def _scale(self, name: str) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": "llm"},
                "spec": {"replicas": self.replicas[name]},
                "status": {"replicas": self.replicas[name], "selector": f"app={name}"}}  # fmt: skip

    def _route(self) -> str | None:
        prefix, _, rest = self.path.partition("/apis/apps/v1/namespaces/llm/deployments/")
        name, _, sub = rest.partition("/")
        return name if prefix == "" and sub == "scale" and name in self.replicas else None

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _forbidden(self) -> None:
        self._send(403, {"kind": "Status", "status": "Failure", "reason": "Forbidden",
                         "code": 403, "message": f"{self.command} {self.path} is forbidden"})  # fmt: skip

    def do_GET(self):  # noqa: N802
        name = self._route()
        self.calls.append(("GET", self.path, ""))
        if name is None:
            return self._forbidden()
        self._send(200, self._scale(name))

    def do_PATCH(self):  # noqa: N802
        name = self._route()
        body = self.rfile.read(int(self.headers["content-length"]))
        self.calls.append(("PATCH", self.path, self.headers["content-type"]))
        if name is None:
            return self._forbidden()
        patch = json.loads(body)
        if isinstance(patch, list):  # a JSON patch
            patch = {"spec": {"replicas": next(op["value"] for op in patch)}}
        self.replicas[name] = int(patch["spec"]["replicas"])
        self._send(200, self._scale(name))

    do_PUT = do_POST = do_DELETE = _forbidden  # noqa: N815

    def log_message(self, *args):
        pass


def test_kubernetes_connector_patches_the_scale_subresource(tmp_path, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {
            "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }))  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    try:
        connector = KubernetesConnector(
            "llm", {"prefill": "radixserve-prefill", "decode": "radixserve-decode"}
        )
        assert connector.get("decode").desired == 2
        connector.set("prefill", 4)
        assert _FakeApiServer.replicas["radixserve-prefill"] == 4
        assert connector.get("prefill").desired == 4
        verbs = {(verb, path.split("?")[0]) for verb, path, _ in _FakeApiServer.calls}
        assert verbs <= {
            ("GET", "/apis/apps/v1/namespaces/llm/deployments/radixserve-prefill/scale"),
            ("GET", "/apis/apps/v1/namespaces/llm/deployments/radixserve-decode/scale"),
            ("PATCH", "/apis/apps/v1/namespaces/llm/deployments/radixserve-prefill/scale"),
        }  # only get and patch of deployments/scale: what its Role grants
        wrong = KubernetesConnector("llm", {"prefill": "nope", "decode": "nope"})
        with pytest.raises(ConnectorError, match="403"):
            wrong.get("prefill")
    finally:
        server.shutdown()
        server.server_close()
