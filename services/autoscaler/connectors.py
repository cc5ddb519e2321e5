"""How the autoscaler sets replica counts: one interface, three connectors by name.

* ``local``: `radixserve up`'s pools, through its control API (`radixserve.launch.local_pools`:
  Kubernetes-style ``Scale`` objects at ``/v1/pools/<role>``). Removed workers drain
  before they exit.
* ``kubernetes``: the ``scale`` subresource of the prefill and decode Deployments, with
  the official ``kubernetes`` client (in-cluster config inside a pod, else the
  kubeconfig). It needs only ``get`` and ``patch`` on ``deployments/scale``.
* ``dry-run``: decides and logs, changes nothing (it remembers what it would have set).

``get(role)`` returns the pool's desired and running replicas (None if unknown);
``set(role, n)`` asks for ``n``. Both may raise `ConnectorError` (logged; the loop goes on).
"""

from __future__ import annotations

import abc
import logging
import os
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve.services.autoscaler.settings import AutoscalerSettings

logger = logging.getLogger(__name__)


class ConnectorError(RuntimeError):
    """The replica count could not be read or set."""


@dataclass(frozen=True)
class Replicas:
    desired: int
    running: int


class Connector(abc.ABC):
    name: str

    @abc.abstractmethod
    def get(self, role: str) -> Replicas | None: ...

    @abc.abstractmethod
    def set(self, role: str, replicas: int) -> None: ...

    def close(self) -> None:  # noqa: B027 (a hook: most connectors hold nothing)
        """Release what it holds."""


class DryRunConnector(Connector):
    name = "dry-run"

    def __init__(self) -> None:
        self.wanted: dict[str, int] = {}

    def get(self, role: str) -> Replicas | None:
        return None  # nothing is provisioned by us: the observed pools are what there is

    def set(self, role: str, replicas: int) -> None:
        self.wanted[role] = replicas
        logger.warning("dry-run: would set %s replicas to %d", role, replicas)


class LocalConnector(Connector):
    name = "local"

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(timeout=timeout_s)

    def get(self, role: str) -> Replicas | None:
        scale = self._call("GET", role)
        return Replicas(int(scale["spec"]["replicas"]), int(scale["status"]["replicas"]))

    def set(self, role: str, replicas: int) -> None:
        self._call("PUT", role, {"spec": {"replicas": replicas}})

    def _call(self, method: str, role: str, body: dict[str, Any] | None = None) -> Any:
        try:
            resp = self._http.request(method, f"{self.url}/v1/pools/{role}", json=body)
        except httpx.HTTPError as exc:
            raise ConnectorError(f"pool control API at {self.url}: {exc}") from exc
        if resp.status_code != 200:
            raise ConnectorError(f"pool control API: {resp.status_code} {resp.text[:200]}")
        return resp.json()

    def close(self) -> None:
        self._http.close()


class KubernetesConnector(Connector):
    name = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[str, str]) -> None:
        try:
            from kubernetes import client, config
        except ImportError as exc:
            raise ConnectorError(
                "connector=kubernetes needs the kubernetes client: pip install kubernetes"
            ) from exc
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
        self._api = client.AppsV1Api()
        self._exc = client.exceptions.ApiException
        self.namespace, self.deployments = namespace, deployments

    def get(self, role: str) -> Replicas | None:
        try:
            scale = self._api.read_namespaced_deployment_scale(
                self.deployments[role], self.namespace
            )
        except self._exc as exc:
            raise ConnectorError(self._why("read", role, exc)) from exc
        running = scale.status.replicas if scale.status and scale.status.replicas else 0
        desired = scale.spec.replicas if scale.spec and scale.spec.replicas else 0
        return Replicas(int(desired), int(running))

    def set(self, role: str, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        try:
            self._api.patch_namespaced_deployment_scale(
                self.deployments[role], self.namespace, body
            )
        except self._exc as exc:
            raise ConnectorError(self._why("patch", role, exc)) from exc

    def _why(self, verb: str, role: str, exc: Any) -> str:
        name = f"{self.namespace}/{self.deployments[role]}"
        return f"cannot {verb} deployments/scale of {name}: {exc.status} {exc.reason}"


def make_connector(settings: AutoscalerSettings) -> Connector:
    """The connector the ``connector`` setting names."""
    if settings.connector == "local":
        assert settings.local_url is not None  # checked by the settings
        return LocalConnector(settings.local_url)
    if settings.connector == "kubernetes":
        deployments = {
            "prefill": settings.kubernetes_prefill_deployment,
            "decode": settings.kubernetes_decode_deployment,
        }
        return KubernetesConnector(settings.kubernetes_namespace, deployments)
    return DryRunConnector()
