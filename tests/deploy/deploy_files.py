"""Reading the deployment files the way their tools do, for the tests beside this one.

* `compose_services` — ``compose/docker-compose.yml`` with Compose's ``${VAR}``,
  ``${VAR:-default}``, ``${VAR-default}`` interpolation (values from a dict standing in
  for the shell and ``.env``), YAML merge keys resolved, environments as dicts;
* `render_overlay` — ``kubectl kustomize`` of an overlay, as a list of objects (no
  kubectl on the machine fails the test with how to get it);
* `dockerfile_commands` — ENTRYPOINT, CMD and HEALTHCHECK of a Dockerfile (exec form);
* `SETTINGS` / `setting_of` — every settings class and the environment variable of each
  field, so a variable in a file can be traced to the setting it sets.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from radixserve.runtime.probe import ProbeSettings
from radixserve.runtime.settings_check import field_variables
from radixserve.services.autoscaler.settings import AutoscalerSettings
from radixserve.services.decode import DecodeSettings
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.kvstore import KVStoreSettings
from radixserve.services.prefill import PrefillSettings
from radixserve.settings import EngineSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yml"
OVERLAYS = ("cpu", "gpu", "keda")
#: the overlays on CPU nodes with the model in the image (keda: cpu with KEDA scaling)
CPU_OVERLAYS = ("cpu", "keda")
#: the services that run the radixserve image (compose service -> Kubernetes component)
RADIXSERVE_SERVICES = ("kvstore", "prefill", "decode", "gateway", "autoscaler")

SETTINGS: tuple[type[BaseSettings], ...] = (
    EngineSettings,
    GatewaySettings,
    PrefillSettings,
    DecodeSettings,
    KVStoreSettings,
    AutoscalerSettings,
    ProbeSettings,
)
_PREFIX = {cls: str(cls.model_config.get("env_prefix", "")).upper() for cls in SETTINGS}


def setting_of(variable: str) -> list[tuple[type[BaseSettings], str]]:
    """The (settings class, field) pairs that read environment variable ``variable``."""
    return [(cls, name) for cls in SETTINGS
            for name, names in field_variables(cls).items() if variable in names]  # fmt: skip


def env_name(cls: type[BaseSettings], field: str) -> str:
    return f"{_PREFIX[cls]}{field.upper()}"


# -- compose -----------------------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's interpolation of ``text`` with ``values`` (unset: empty, as compose)."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        value = values.get(name)
        if op == ":-" and not value:
            return default
        if op == "-" and value is None:
            return default
        if op in (":?", "?") and not value:  # compose refuses to start
            raise ValueError(f"{name} is required: {default}")
        return value or ""

    return _VAR.sub(one, text)


#: a .env's required values, as a user makes them (the example's placeholders are refused)
REQUIRED_VALUES = {
    "RADIXSERVE_CLUSTER_SECRET": "a-secret-made-for-this-test-0123456789",
    "RADIXSERVE_GATEWAY_API_KEYS": '[{"key":"an-admin-key-made-for-this-test","role":"admin"}]',
}


def compose_variables() -> set[str]:
    """Every variable the compose file interpolates."""
    text = COMPOSE_FILE.read_text()
    return {m.group(1) or m.group(4) for m in _VAR.finditer(text) if m.group(0) != "$$"}


def compose_document(
    values: dict[str, str] | None = None, path: Path = COMPOSE_FILE
) -> dict[str, Any]:
    """The compose file as compose sees it: parsed, then every string interpolated with
    ``values`` (None: a .env holding only what compose requires, the cluster secret and
    the API keys, made as .env.example says: its placeholders are refused)."""
    if values is None:
        values = dict(REQUIRED_VALUES)

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, values)
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item) for item in node]
        return node

    loaded: dict[str, Any] = walk(yaml.safe_load(path.read_text()))
    return loaded


def compose_services(values: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Each service: its definition, with ``environment`` as a dict of strings."""
    services: dict[str, dict[str, Any]] = compose_document(values)["services"]
    for service in services.values():
        env = service.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        service["environment"] = {k: "" if v is None else str(v) for k, v in env.items()}
    return services


def env_example() -> dict[str, str]:
    """``compose/.env.example`` as name -> value."""
    out = {}
    for line in (COMPOSE / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name] = value
    return out


# -- Kubernetes --------------------------------------------------------------------------


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is needed to render compose/k8s (kubectl kustomize) and is not on "
            "PATH: install it (https://kubernetes.io/docs/tasks/tools/, or `apt-get install "
            "kubectl` from the Kubernetes apt repository) and run the tests again"
        )
    return path


@functools.cache
def render_overlay(overlay: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize compose/k8s/overlays/<overlay>`` renders (once per
    run: callers must not change them)."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(COMPOSE / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def objects_of(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def component(obj: dict[str, Any]) -> str:
    """The radixserve service a Deployment runs (its app.kubernetes.io/component)."""
    return str(obj["metadata"]["labels"]["app.kubernetes.io/component"])


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


def pod_env(objects: list[dict[str, Any]], deployment: dict[str, Any]) -> dict[str, str]:
    """A Deployment's container environment: its ConfigMaps' data, then its own ``env``
    (downward-API values as ``<fieldPath>``)."""
    configmaps = objects_of(objects, "ConfigMap")
    c = container(deployment)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]]["data"])
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"<secret {ref['name']}/{ref['key']}>"
        else:
            env[item["name"]] = f"<{item['valueFrom']['fieldRef']['fieldPath']}>"
    return env


# -- Dockerfiles -------------------------------------------------------------------------


def dashboard_exprs(name: str | None = None) -> list[str]:
    """Every PromQL expression of the Grafana dashboards' panels (of ``<name>.json``
    only, if given)."""
    paths = sorted((COMPOSE / "grafana" / "dashboards").glob(f"{name or '*'}.json"))
    dashboards = [json.loads(path.read_text()) for path in paths]
    return [t["expr"] for d in dashboards for p in d["panels"] for t in p.get("targets", [])]


def metric_names(exprs: list[str]) -> set[str]:
    """The radixserve metric names ``exprs`` use (vLLM's ``vllm:*`` names included)."""
    pattern = r"\bradixserve_[a-z0-9_]+|\bvllm:[a-z0-9_:]+"
    return {name for e in exprs for name in re.findall(pattern, e)}


def dockerfile_commands(path: Path) -> dict[str, list[str]]:
    """ENTRYPOINT, CMD and HEALTHCHECK's CMD of ``path`` (exec form, JSON arrays)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        for key, pattern in (("ENTRYPOINT", r"^ENTRYPOINT\s+(\[.*\])$"),
                             ("CMD", r"^CMD\s+(\[.*\])$"),
                             ("HEALTHCHECK", r"^HEALTHCHECK\s.*\bCMD\s+(\[.*\])$")):  # fmt: skip
            found = re.match(pattern, line.strip())
            if found:
                out[key] = json.loads(found.group(1))
    return out


def dockerfile_exposed(path: Path) -> set[int]:
    ports: set[int] = set()
    for line in path.read_text().splitlines():
        if line.startswith("EXPOSE "):
            ports.update(int(p.split("/")[0]) for p in line.split()[1:])
    return ports
