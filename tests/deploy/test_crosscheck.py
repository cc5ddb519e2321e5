"""The deployment files agree with the code and with each other.

* every ``RADIXSERVE_*`` variable any file sets is a setting, and every service's
  environment parses into its settings classes; every setting a service needs in a
  cluster is set; ``.env.example`` is exactly what the compose file interpolates;
* every command the files run (compose commands, the images' ENTRYPOINT, CMD and
  HEALTHCHECK, the pods' args and preStop hooks, the README's) parses with the real CLI
  parser;
* ports, service names and probe paths agree across compose, Prometheus, the Dockerfiles
  and the Kubernetes objects, and with the settings' defaults; the NetworkPolicies allow
  exactly the connections the services open; RBAC names exactly the autoscaler's pools.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from typing import Any

import pytest
import torch
import yaml
from pydantic_settings import BaseSettings

from radixserve.cli import make_parser
from radixserve.runtime.probe import ProbeSettings
from radixserve.runtime.settings import resolved_tp
from radixserve.runtime.settings_check import PROCESS_VARIABLES
from radixserve.services.autoscaler.settings import AutoscalerSettings
from radixserve.services.decode import DecodeSettings
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.kvstore import KVStoreSettings
from radixserve.services.prefill import PrefillSettings
from radixserve.settings import EngineSettings
from radixserve.transfer.network import WILDCARD_HOSTS
from tests.deploy.deploy_files import (
    COMPOSE,
    CPU_OVERLAYS,
    OVERLAYS,
    RADIXSERVE_SERVICES,
    REQUIRED_VALUES,
    component,
    compose_document,
    compose_services,
    compose_variables,
    container,
    dashboard_exprs,
    dockerfile_commands,
    dockerfile_exposed,
    env_example,
    interpolate,
    kubectl,
    metric_names,
    objects_of,
    pod_env,
    render_overlay,
    setting_of,
)

#: the settings classes each service reads
SERVICE_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "kvstore": (KVStoreSettings,),
    "prefill": (EngineSettings, PrefillSettings),
    "decode": (EngineSettings, DecodeSettings),
    "gateway": (EngineSettings, GatewaySettings),
    "autoscaler": (AutoscalerSettings,),
}
#: downward-API values a pod gets, for parsing its settings
DOWNWARD = {"<status.podIP>": "10.0.0.7", "<metadata.name>": "pod-a", "<metadata.namespace>": "ns",
            # the Secrets' values, as compose/README.md says to make them
            "<secret radixserve-api-keys/keys>": REQUIRED_VALUES["RADIXSERVE_GATEWAY_API_KEYS"]}  # fmt: skip
DRAIN_SERVICES = ("prefill", "decode")
ENGINE_SHARED = ("RADIXSERVE_MODEL", "RADIXSERVE_DTYPE", "RADIXSERVE_PAGE_SIZE")


def load_settings(
    monkeypatch: pytest.MonkeyPatch, service: str, env: dict[str, str]
) -> dict[type[BaseSettings], Any]:
    """The service's settings objects, built from exactly ``env`` (downward values filled)."""
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("RADIXSERVE_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, DOWNWARD.get(value, value))
        return {cls: cls() for cls in SERVICE_SETTINGS[service]}


def parse_cli(argv: list[str]) -> Any:
    """``argv`` (``radixserve ...``) through the real parser; fails the test if it refuses."""
    assert argv[0] == "radixserve", argv
    try:
        return make_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"the CLI refuses {shlex.join(argv)}")


# -- variables and settings ---------------------------------------------------------------


def variables_in_files() -> dict[str, set[str]]:
    """Every RADIXSERVE_* name written in the deployment files, by file (prose's
    ``RADIXSERVE_*_PORT``-style patterns left out)."""
    pattern = re.compile(r"\bRADIXSERVE_[A-Z0-9_*]+")
    files = [
        p
        for p in COMPOSE.rglob("*")
        if p.is_file() and p.suffix != ".json" and COMPOSE / "local" not in p.parents
    ]  # build inputs a user puts there
    return {
        str(p.relative_to(COMPOSE)): {n for n in pattern.findall(p.read_text()) if "*" not in n}
        for p in files
    }


def test_every_variable_in_the_files_is_a_setting() -> None:
    unknown = {
        f"{name} ({where})"
        for where, names in variables_in_files().items()
        for name in names
        if not setting_of(name) and name not in PROCESS_VARIABLES
    }
    assert not unknown, f"not a setting of any settings class: {sorted(unknown)}"


def test_env_example_is_what_compose_interpolates_with_its_defaults() -> None:
    example = env_example()
    assert set(example) == compose_variables()
    text = (COMPOSE / "docker-compose.yml").read_text()
    for name, value in example.items():
        required = f"${{{name}:?" in text  # no default: compose refuses to start without it
        assert required or f"${{{name}:-{value}}}" in text, (
            f"{name}: compose's default is not {value!r}"
        )
        assert setting_of(name), name


def compose_settings(monkeypatch: pytest.MonkeyPatch, values: dict[str, str] | None = None):
    services = compose_services(values)
    return services, {
        name: load_settings(monkeypatch, name, services[name]["environment"])
        for name in RADIXSERVE_SERVICES
    }


def k8s_settings(monkeypatch: pytest.MonkeyPatch, objects: list[dict[str, Any]]):
    deployments = {component(d): d for d in objects_of(objects, "Deployment").values()}
    assert set(deployments) == set(RADIXSERVE_SERVICES)
    envs = {name: pod_env(objects, d) for name, d in deployments.items()}
    return deployments, envs, {n: load_settings(monkeypatch, n, e) for n, e in envs.items()}


def check_cluster_settings(
    settings: dict[str, dict[type[BaseSettings], Any]],
    envs: dict[str, dict[str, str]],
    kvstore_host: str,
    gateway_host: str,
) -> None:
    """What every service needs set to run in a cluster (compose or Kubernetes)."""
    kv = settings["kvstore"][KVStoreSettings]
    gw = settings["gateway"][GatewaySettings]
    scaler = settings["autoscaler"][AutoscalerSettings]
    for name, s in [("kvstore", kv), *((r, settings[r][c]) for r, c in
                    (("prefill", PrefillSettings), ("decode", DecodeSettings)))]:  # fmt: skip
        assert s.host in WILDCARD_HOSTS, f"{name} must listen on every interface"
        assert s.port and s.http_port, f"{name} needs fixed control and HTTP ports"
        if isinstance(s, DecodeSettings):
            assert s.token_port and s.token_port not in (s.port, s.http_port), "token port"
        assert s.transfer_port_min and s.transfer_port_max, f"{name}: fixed transfer ports"
        assert s.transfer_backend == kv.transfer_backend, f"{name}: another transfer backend"
        if name != "kvstore":
            assert s.kvstore == f"tcp://{kvstore_host}:{kv.port}", name
    assert kv.name == "kvstore" and kv.advertise_host, "the kvstore's name and address"
    assert gw.host in WILDCARD_HOSTS and gw.kvstore == f"tcp://{kvstore_host}:{kv.port}"
    # beyond loopback: every service has the secret, the gateway an admin key
    gw.require_secure()
    admin = json.loads(REQUIRED_VALUES["RADIXSERVE_GATEWAY_API_KEYS"])[0]["key"]
    assert (found := gw.keyring().principal(admin)) is not None and found.is_admin
    for name, s in (("kvstore", kv), *((r, settings[r][c]) for r, c in
                    (("prefill", PrefillSettings), ("decode", DecodeSettings)))):  # fmt: skip
        s.require_secure(name)
    assert scaler.host in WILDCARD_HOSTS and scaler.metrics_source == "gateway"
    assert scaler.gateway_url == f"http://{gateway_host}:{gw.port}"
    for key in ENGINE_SHARED:  # the model-loading services agree on the model
        assert len({envs[r].get(key) for r in ("prefill", "decode", "gateway")}) == 1, key
    # settings' defaults where the files keep them
    assert gw.port == GatewaySettings.model_fields["port"].default
    assert scaler.port == AutoscalerSettings.model_fields["port"].default


def test_compose_environments_make_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    services, settings = compose_settings(monkeypatch)
    envs = {name: services[name]["environment"] for name in RADIXSERVE_SERVICES}
    check_cluster_settings(settings, envs, "kvstore", "gateway")
    assert settings["autoscaler"][AutoscalerSettings].connector == "dry-run"
    # .env values reach the settings, and every radixserve service holds the one secret
    secret = "a-secret-of-this-test-0123456789"
    _, tuned = compose_settings(
        monkeypatch, {**REQUIRED_VALUES, "RADIXSERVE_PAGE_SIZE": "32",
                      "RADIXSERVE_CLUSTER_SECRET": secret}
    )  # fmt: skip
    assert tuned["decode"][EngineSettings].page_size == 32
    for name in ("kvstore", "gateway", "prefill", "decode"):
        held = [
            s.cluster_secret
            for s in tuned[name].values()
            if "cluster_secret" in type(s).model_fields
        ]
        assert held and all(h is not None and h.get_secret_value() == secret for h in held), name
    # without one, or without API keys, compose refuses to start
    for required in REQUIRED_VALUES:
        values = {k: v for k, v in REQUIRED_VALUES.items() if k != required}
        with pytest.raises(ValueError, match=f"{required} is required"):
            compose_settings(monkeypatch, {**values, "RADIXSERVE_PAGE_SIZE": "32"})
    # and the example's placeholders are refused by the services themselves
    for name, value in env_example().items():
        if name in REQUIRED_VALUES:
            with pytest.raises(ValueError, match="placeholder"):
                compose_settings(monkeypatch, {**REQUIRED_VALUES, name: value})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_environments_make_a_cluster(
    monkeypatch: pytest.MonkeyPatch, overlay: str
) -> None:
    objects = render_overlay(overlay)
    deployments, envs, settings = k8s_settings(monkeypatch, objects)
    check_cluster_settings(settings, envs, "radixserve-kvstore", "radixserve-gateway")
    for role in DRAIN_SERVICES:  # unique names and dialable addresses per pod
        assert envs[role][f"RADIXSERVE_{role.upper()}_NAME"] == "<metadata.name>"
        assert envs[role][f"RADIXSERVE_{role.upper()}_ADVERTISE_HOST"] == "<status.podIP>"
    assert envs["kvstore"]["RADIXSERVE_KVSTORE_ADVERTISE_HOST"] == "<status.podIP>"
    for name in ("kvstore", "gateway", "prefill", "decode"):  # the internal plane is keyed
        secret = envs[name]["RADIXSERVE_CLUSTER_SECRET"]
        assert secret == "<secret radixserve-cluster-secret/secret>", name
    scaler = settings["autoscaler"][AutoscalerSettings]
    assert scaler.connector == "kubernetes"
    assert (
        envs["autoscaler"]["RADIXSERVE_AUTOSCALER_KUBERNETES_NAMESPACE"] == "<metadata.namespace>"
    )
    names = {role: deployments[role]["metadata"]["name"] for role in DRAIN_SERVICES}
    assert scaler.kubernetes_prefill_deployment == names["prefill"]
    assert scaler.kubernetes_decode_deployment == names["decode"]


# -- commands -----------------------------------------------------------------------------


def test_every_command_exists_in_the_cli() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        commands = dockerfile_commands(COMPOSE / dockerfile)
        entry = commands["ENTRYPOINT"]
        assert entry == ["radixserve"]
        assert parse_cli(entry + commands["CMD"]).command == "up"
        assert parse_cli(commands["HEALTHCHECK"]).command == "probe"
    for name, service in compose_services().items():
        if name in RADIXSERVE_SERVICES:
            assert parse_cli(["radixserve", *service["command"]]).command == name
    for overlay in OVERLAYS:
        for deployment in objects_of(render_overlay(overlay), "Deployment").values():
            c = container(deployment)
            assert "command" not in c, "the image's ENTRYPOINT (radixserve) must stay"
            assert parse_cli(["radixserve", *c["args"]]).command == component(deployment)
            hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            if hook is not None:
                assert parse_cli(hook).command == "stop"
    readme = (COMPOSE / "README.md").read_text()
    in_blocks = re.findall(r"^\s*(?:\S+=\S+\s+)*(radixserve\s.+?)\s*$", readme, re.M)
    inline = re.findall(r"`(radixserve [^`]+)`", readme)
    assert len(in_blocks) + len(inline) >= 5
    for line in in_blocks + inline:
        parse_cli(shlex.split(line.split(" #")[0]))


# -- ports, names, probes -----------------------------------------------------------------


def grace_s(text: str) -> float:
    value = re.fullmatch(r"(\d+)(s|m)", text)
    assert value, text
    return float(value[1]) * (60 if value[2] == "m" else 1)


def test_compose_ports_probes_and_scrapes_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    services, settings = compose_settings(monkeypatch)
    http = {
        "kvstore": settings["kvstore"][KVStoreSettings].http_port,
        "prefill": settings["prefill"][PrefillSettings].http_port,
        "decode": settings["decode"][DecodeSettings].http_port,
        "gateway": settings["gateway"][GatewaySettings].port,
        "autoscaler": settings["autoscaler"][AutoscalerSettings].port,
    }
    for name, port in http.items():
        probe_url = services[name]["environment"]["RADIXSERVE_PROBE_URL"]
        assert probe_url == f"http://127.0.0.1:{port}/health", name
    assert ProbeSettings().url == f"http://127.0.0.1:{http['gateway']}/health"
    assert services["gateway"]["ports"] == [f"127.0.0.1:{http['gateway']}:{http['gateway']}"]
    exposed = dockerfile_exposed(COMPOSE / "Dockerfile")
    assert exposed == dockerfile_exposed(COMPOSE / "Dockerfile.cuda")
    assert set(http.values()) | {settings["kvstore"][KVStoreSettings].port} <= exposed
    for role, cls in (("prefill", PrefillSettings), ("decode", DecodeSettings)):
        assert grace_s(services[role]["stop_grace_period"]) > settings[role][cls].drain_grace_s
    # Prometheus scrapes every service on its HTTP port, the pools by DNS
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    assert set(jobs) == set(RADIXSERVE_SERVICES)
    for name, job in jobs.items():
        if name in DRAIN_SERVICES:
            [dns] = job["dns_sd_configs"]
            assert (dns["names"], dns["port"]) == ([name], http[name])
        else:
            assert job["static_configs"] == [{"targets": [f"{name}:{http[name]}"]}]
    [drop] = jobs["gateway"]["metric_relabel_configs"]
    assert drop["action"] == "drop" and re.fullmatch(drop["regex"], "radixserve_worker_up")
    assert re.fullmatch(drop["regex"], "radixserve_kv_transfer_seconds_count")
    assert not re.fullmatch(drop["regex"], "radixserve_ttft_seconds_bucket")


@pytest.mark.parametrize("gpus", [{}, {"PREFILL_GPUS": "0,1", "DECODE_GPUS": "2"}])
def test_compose_cuda_override_gives_each_pool_its_gpus(
    gpus: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One setting per pool (PREFILL_GPUS, DECODE_GPUS; default "0") becomes the workers'
    CUDA_VISIBLE_DEVICES, their TP is 'auto' (one rank per GPU seen: resolved with the
    device count the CUDA runtime would report for that list — no GPU here, so
    torch.cuda.device_count is replaced by the list's length), and the containers get
    the host's GPUs (`count: all`, the only non-integer docker-compose 1.29 takes)."""
    values = {**REQUIRED_VALUES, **gpus}
    cuda = compose_document(values, path=COMPOSE / "docker-compose.cuda.yml")["services"]
    for name in RADIXSERVE_SERVICES:
        assert cuda[name]["image"] == "radixserve:cuda"
        assert cuda[name]["build"]["dockerfile"] == "compose/Dockerfile.cuda"
    for name in DRAIN_SERVICES:
        [device] = cuda[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert device["count"] == "all"
        env = cuda[name]["environment"]
        visible = gpus.get(f"{name.upper()}_GPUS", "0")
        assert env["CUDA_VISIBLE_DEVICES"] == visible
        variable = f"RADIXSERVE_{name.upper()}_TP"
        own = PrefillSettings if name == "prefill" else DecodeSettings
        tp = load_settings(monkeypatch, name, {variable: env[variable]})[own].tp
        count = len(visible.split(","))
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert tp == "auto" and resolved_tp(tp) == count
    base = compose_services()
    assert {base[n]["build"]["dockerfile"] for n in RADIXSERVE_SERVICES} == {"compose/Dockerfile"}


def named_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_ports_probes_and_names_agree(
    monkeypatch: pytest.MonkeyPatch, overlay: str
) -> None:
    objects = render_overlay(overlay)
    deployments, envs, settings = k8s_settings(monkeypatch, objects)
    expected = {
        "kvstore": {"control": settings["kvstore"][KVStoreSettings].port,
                    "metrics": settings["kvstore"][KVStoreSettings].http_port},
        "prefill": {"control": settings["prefill"][PrefillSettings].port,
                    "metrics": settings["prefill"][PrefillSettings].http_port},
        "decode": {"control": settings["decode"][DecodeSettings].port,
                   "tokens": settings["decode"][DecodeSettings].token_port,
                   "metrics": settings["decode"][DecodeSettings].http_port},
        "gateway": {"http": settings["gateway"][GatewaySettings].port},
        "autoscaler": {"metrics": settings["autoscaler"][AutoscalerSettings].port},
    }  # fmt: skip
    for name, deployment in deployments.items():
        c = container(deployment)
        assert named_ports(c) == expected[name], name
        for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/live"),
                            ("startupProbe", "/live")):  # fmt: skip
            if probe == "startupProbe" and name == "autoscaler":
                continue
            get = c[probe]["httpGet"]
            assert get["path"] == path and get["port"] in expected[name], (name, probe)
        pod = deployment["spec"]["template"]
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= pod["metadata"]["labels"].items()
        )
        if name in DRAIN_SERVICES or name == "gateway":
            hook = parse_cli(c["lifecycle"]["preStop"]["exec"]["command"])
            grace = pod["spec"]["terminationGracePeriodSeconds"]
            assert hook.after_s + hook.timeout_s <= grace, name
        if name in DRAIN_SERVICES:
            cls = PrefillSettings if name == "prefill" else DecodeSettings
            assert hook.timeout_s > settings[name][cls].drain_grace_s, name
    # Services select their Deployment's pods and reach named container ports
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
    services = objects_of(objects, "Service")
    for svc in services.values():
        target = component(svc)
        assert svc["spec"]["selector"].items() <= pods[target].items(), svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            assert expected[target][port["targetPort"]] == port["port"]
    assert services["radixserve-kvstore"]["spec"].get("clusterIP") != "None"
    for role in DRAIN_SERVICES:  # discovery goes through the kvstore: headless, for DNS
        assert services[f"radixserve-{role}"]["spec"]["clusterIP"] == "None"
    # the ServiceMonitor's ports exist, and the gateway's repeats are dropped as in compose
    [monitor] = objects_of(objects, "ServiceMonitor").values()
    port_names = {p["name"] for s in services.values() for p in s["spec"]["ports"]}
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    [gateway_job] = [j for j in prom["scrape_configs"] if j["job_name"] == "gateway"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        if endpoint["port"] == "http":
            [drop] = endpoint["metricRelabelings"]
            assert drop["regex"] == gateway_job["metric_relabel_configs"][0]["regex"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_names_only_the_autoscalers_pools(overlay: str) -> None:
    objects = render_overlay(overlay)
    deployments = {component(d): d for d in objects_of(objects, "Deployment").values()}
    [role] = objects_of(objects, "Role").values()
    pools = sorted(deployments[r]["metadata"]["name"] for r in DRAIN_SERVICES)
    [rule] = role["rules"]
    verbs = ["get"] if overlay == "keda" else ["get", "patch"]  # keda: recommendations only
    assert (rule["apiGroups"], rule["resources"], rule["verbs"]) == (
        ["apps"],
        ["deployments/scale"],
        verbs,
    )
    assert sorted(rule["resourceNames"]) == pools
    [binding] = objects_of(objects, "RoleBinding").values()
    pod = deployments["autoscaler"]["spec"]["template"]["spec"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": role["metadata"]["namespace"]}]  # fmt: skip
    for name, deployment in deployments.items():
        if name != "autoscaler":
            assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# The connections each service opens (initiator -> target: kind of port). The policies
# must allow exactly these between radixserve pods.
FLOWS = {
    ("gateway", "kvstore", "control"), ("gateway", "prefill", "control"),
    ("gateway", "decode", "control"), ("gateway", "decode", "tokens"),
    ("decode", "prefill", "control"),
    ("decode", "prefill", "transfer"), ("prefill", "kvstore", "control"),
    ("prefill", "kvstore", "transfer"), ("decode", "kvstore", "control"),
    ("decode", "kvstore", "transfer"), ("kvstore", "prefill", "transfer"),
    ("kvstore", "decode", "transfer"),
}  # fmt: skip


def selected_components(selector: dict[str, Any]) -> set[str]:
    labels = selector.get("matchLabels", {})
    if labels.get("app.kubernetes.io/name") != "radixserve":
        return set()
    if "app.kubernetes.io/component" in labels:
        return {labels["app.kubernetes.io/component"]}
    [expr] = selector["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
    return set(expr["values"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_connections_made(
    monkeypatch: pytest.MonkeyPatch, overlay: str
) -> None:
    objects = render_overlay(overlay)
    _, _, settings = k8s_settings(monkeypatch, objects)
    ports: dict[str, dict[str, tuple[int, int]]] = {}
    for name, cls in (("kvstore", KVStoreSettings), ("prefill", PrefillSettings),
                      ("decode", DecodeSettings)):  # fmt: skip
        s = settings[name][cls]
        ports[name] = {"control": (s.port, s.port), "metrics": (s.http_port, s.http_port),
                       "transfer": (s.transfer_port_min, s.transfer_port_max)}  # fmt: skip
        if isinstance(s, DecodeSettings):  # its token endpoint, fixed to be allowed
            assert s.token_endpoint and s.token_port, "decode: a fixed token port"
            ports[name]["tokens"] = (s.token_port, s.token_port)
    gateway, scaler = (
        settings["gateway"][GatewaySettings],
        settings["autoscaler"][AutoscalerSettings],
    )
    ports["gateway"] = {"api": (gateway.port, gateway.port)}
    ports["autoscaler"] = {"metrics": (scaler.port, scaler.port)}
    allowed, open_to_all, from_prometheus = set(), set(), set()
    for policy in objects_of(objects, "NetworkPolicy").values():
        [target] = selected_components(policy["spec"]["podSelector"])
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            kinds = set()
            for p in rule["ports"]:
                span = (p["port"], p.get("endPort", p["port"]))
                [kind] = [k for k, v in ports[target].items() if v == span]
                kinds.add(kind)
            if "from" not in rule:
                open_to_all |= {(target, k) for k in kinds}
                continue
            for peer in rule["from"]:
                if "namespaceSelector" in peer:  # Prometheus
                    assert peer["podSelector"]["matchLabels"] == {
                        "app.kubernetes.io/name": "prometheus"
                    }
                    from_prometheus |= {(target, k) for k in kinds}
                    continue
                allowed |= {
                    (s, target, k) for s in selected_components(peer["podSelector"]) for k in kinds
                }
    assert allowed == FLOWS
    assert open_to_all == {("gateway", "api")}
    assert from_prometheus == {
        (n, "metrics") for n in ("kvstore", "prefill", "decode", "autoscaler")
    }


def test_overlays_run_the_model_they_say() -> None:
    for overlay in OVERLAYS:
        objects = render_overlay(overlay)
        deployments = {component(d): d for d in objects_of(objects, "Deployment").values()}
        for name, deployment in deployments.items():
            c = container(deployment)
            assert c["image"] == f"radixserve:{'cuda' if overlay == 'gpu' else 'cpu'}", name
            gpus = {k: v.get("nvidia.com/gpu") for k, v in c["resources"].items()}
            assert gpus == ({"requests": 1, "limits": 1} if overlay == "gpu" and name in
                            DRAIN_SERVICES else {"requests": None, "limits": None}), name  # fmt: skip
            assert {"requests", "limits"} <= set(c["resources"]), name
        env = pod_env(objects, deployments["prefill"])
        if overlay in CPU_OVERLAYS:
            assert env["RADIXSERVE_MODEL"] == "default"
            continue
        claim = "radixserve-models"
        assert claim in objects_of(objects, "PersistentVolumeClaim")
        for name in ("prefill", "decode", "gateway"):
            spec = deployments[name]["spec"]["template"]["spec"]
            volume = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
            assert volume["persistentVolumeClaim"]["claimName"] == claim
            [mount] = [m for m in container(deployments[name])["volumeMounts"]
                       if m["name"] == volume["name"]]  # fmt: skip
            assert env["RADIXSERVE_MODEL"].startswith(mount["mountPath"] + "/")
        assert env["RADIXSERVE_DEVICE"] == "cuda"


def test_gpu_overlay_sizes_each_pool_from_its_tensor_parallel_setting(tmp_path) -> None:
    """tensor-parallel.yaml's one value per pool is its pods' GPUs and RADIXSERVE_TP (and
    stays out of what is applied)."""
    shutil.copytree(COMPOSE / "k8s", tmp_path / "k8s")
    sizes = tmp_path / "k8s" / "overlays" / "gpu" / "tensor-parallel.yaml"
    sizes.write_text(sizes.read_text().replace('prefill: "1"', 'prefill: "2"')
                     .replace('decode: "1"', 'decode: "4"'))  # fmt: skip
    out = subprocess.run([kubectl(), "kustomize", str(tmp_path / "k8s" / "overlays" / "gpu")],
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    objects = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    assert "radixserve-tensor-parallel" not in objects_of(objects, "ConfigMap")
    deployments = {component(d): d for d in objects_of(objects, "Deployment").values()}
    for name, tp in (("prefill", 2), ("decode", 4)):
        c = container(deployments[name])
        assert c["resources"]["requests"]["nvidia.com/gpu"] == tp
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert pod_env(objects, deployments[name])["RADIXSERVE_TP"] == str(tp)


def test_interpolation_follows_compose() -> None:
    values = {"A": "1", "E": ""}
    assert interpolate("${A:-x} ${B:-y} ${E:-z} ${E-w} ${B-v} $$A $A", values) == "1 y z  v $A 1"


def _gib(quantity: str) -> float:
    """A Kubernetes quantity in Gi (the only unit these files use for sizes)."""
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def test_the_kvstore_disk_tier_has_a_volume_larger_than_its_bound() -> None:
    """Compose mounts a named volume at the kvstore's disk tier directory; the cpu
    overlay an emptyDir whose size limit is above the tier's bound (the kubelet evicts a
    pod past it), the gpu overlay a ReadWriteOnce claim above it (kept across restarts),
    writable by the kvstore's user (fsGroup)."""
    kvstore = compose_services()["kvstore"]
    where = kvstore["environment"]["RADIXSERVE_KVSTORE_DISK_TIER_DIR"]
    assert f"kvstore-disk:{where}" in kvstore["volumes"]
    assert "kvstore-disk" in compose_document()["volumes"]
    for overlay in OVERLAYS:
        objects = render_overlay(overlay)
        deployment = next(d for d in objects_of(objects, "Deployment").values()
                          if component(d) == "kvstore")  # fmt: skip
        env = pod_env(objects, deployment)
        bound = float(env["RADIXSERVE_KVSTORE_DISK_TIER_GIB"])
        spec = deployment["spec"]["template"]["spec"]
        [mount] = [m for m in container(deployment)["volumeMounts"]
                   if m["mountPath"] == env["RADIXSERVE_KVSTORE_DISK_TIER_DIR"]]  # fmt: skip
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
        if overlay in CPU_OVERLAYS:
            assert _gib(volume["emptyDir"]["sizeLimit"]) > bound
            continue
        claim = objects_of(objects, "PersistentVolumeClaim")[
            volume["persistentVolumeClaim"]["claimName"]
        ]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert _gib(claim["spec"]["resources"]["requests"]["storage"]) > bound


def test_the_vllm_dashboard_queries_names_radixserve_exports() -> None:
    """compose/grafana/dashboards/vllm.json uses only vLLM's names, each exported by a
    worker's or the gateway's /metrics (sample names: ``_bucket``, ``_total``), and
    Prometheus keeps the gateway's own vLLM series (its drop rule leaves them)."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixserve.metrics import ServingMetrics
    from radixserve.protocol.link_messages import WorkerLoad
    from radixserve.protocol.stats_messages import EngineSection
    from radixserve.vllm_metrics import engine_metrics

    worker = engine_metrics("m", "decode-0", WorkerLoad(), EngineSection()).decode()
    texts = (ServingMetrics("m").render({}).decode(), worker)
    exported = {s.name for t in texts for f in text_string_to_metric_families(t) for s in f.samples}
    used = metric_names(dashboard_exprs("vllm"))
    assert used and all(name.startswith("vllm:") for name in used), used
    assert used <= exported, sorted(used - exported)
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    [gateway_job] = [j for j in prom["scrape_configs"] if j["job_name"] == "gateway"]
    [drop] = gateway_job["metric_relabel_configs"]
    assert not any(
        re.fullmatch(drop["regex"], name) for name in exported if name.startswith("vllm:")
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_the_pools_on_the_autoscalers_recommendation(
    monkeypatch: pytest.MonkeyPatch, overlay: str
) -> None:
    """The keda overlay's autoscaler only recommends (it never patches, and may not), and
    one ScaledObject per pool scales that pool's Deployment to the recommendation
    (AverageValue 1: replicas = the query's value) within the autoscaler's own bounds,
    from the Prometheus series the ServiceMonitor brings in; the other overlays leave the
    autoscaler to set the pools itself and have no ScaledObject."""
    objects = render_overlay(overlay)
    deployments, _, settings = k8s_settings(monkeypatch, objects)
    scaler = settings["autoscaler"][AutoscalerSettings]
    scaled = objects_of(objects, "ScaledObject")
    assert scaler.recommend_only == (overlay == "keda")
    if overlay != "keda":
        assert not scaled
        return
    assert {component(o) for o in scaled.values()} == set(DRAIN_SERVICES)
    for obj in scaled.values():
        role = component(obj)
        spec = obj["spec"]
        assert spec["scaleTargetRef"] == {"name": deployments[role]["metadata"]["name"]}
        lo, hi = scaler.bounds(role)
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (lo, hi)
        window = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert window["stabilizationWindowSeconds"] > scaler.scale_up_cooldown_s
        [trigger] = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["threshold"] == "1"
        namespace = obj["metadata"]["namespace"]
        assert meta["query"] == (
            f'max(radixserve_autoscaler_desired_replicas{{namespace="{namespace}", role="{role}"}})'
        )
    # the series is the autoscaler's own, scraped through the ServiceMonitor
    [monitor] = objects_of(objects, "ServiceMonitor").values()
    ports = {p["name"] for s in objects_of(objects, "Service").values()
             if component(s) == "autoscaler" for p in s["spec"]["ports"]}  # fmt: skip
    assert any(e["port"] in ports for e in monitor["spec"]["endpoints"])
