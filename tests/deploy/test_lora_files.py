"""The LoRA deployment files: ``compose/docker-compose.lora.yml`` (an override) and the
``compose/k8s/components/lora`` component mount one adapter directory read-only at the
same path in the prefill, decode and gateway containers, and set the settings that read
it: the workers' ``RADIXSERVE_LORA_MODULES`` paths lie under the mount, the gateway's
``lora_dir`` is the mount, run-time loads are on. Both files keep a working cluster
(the same checks as the base files), the override merges as ``docker compose config``
merges it, and the component renders into the cpu and gpu overlays as objects the
Kubernetes schemas accept."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from radixserve.services.gateway.settings import GatewaySettings
from radixserve.settings import EngineSettings
from tests.deploy.deploy_files import (
    COMPOSE,
    RADIXSERVE_SERVICES,
    REQUIRED_VALUES,
    component,
    compose_document,
    compose_services,
    container,
    kubectl,
    objects_of,
    pod_env,
)
from tests.deploy.test_crosscheck import check_cluster_settings, load_settings
from tests.deploy.test_schemas import validate_k8s

OVERRIDE = COMPOSE / "docker-compose.lora.yml"
COMPONENT = COMPOSE / "k8s" / "components" / "lora"
MOUNTED = ("prefill", "decode", "gateway")
MODULES = '["sql=/adapters/sql", "chat=/adapters/chat"]'


def merged_services(values: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The base compose file with the override on it, as compose merges one: each
    service's environment by name, its volumes added."""
    services = compose_services(values)
    for name, extra in compose_document(values, OVERRIDE)["services"].items():
        services[name]["environment"].update({k: str(v) for k, v in extra["environment"].items()})
        services[name]["volumes"] = [*services[name].get("volumes", []), *extra["volumes"]]
    return services


def check_lora_settings(
    monkeypatch: pytest.MonkeyPatch,
    envs: dict[str, dict[str, str]],
    mount: str,
    modules: dict[str, str],
    tmp_path: Path,
) -> dict[str, Any]:
    """Every service's settings from ``envs``: the workers serve ``modules``, each under
    ``mount``; the gateway loads at run time from ``mount`` (a directory here stands in
    for it: the setting must name one that exists). The settings, for the cluster checks."""
    assert envs["gateway"]["RADIXSERVE_GATEWAY_LORA_DIR"] == mount
    settings = {}
    for name in RADIXSERVE_SERVICES:
        env = dict(envs[name])
        if name == "gateway":
            env["RADIXSERVE_GATEWAY_LORA_DIR"] = str(tmp_path)
        settings[name] = load_settings(monkeypatch, name, env)
    for role in ("prefill", "decode"):
        paths = settings[role][EngineSettings].lora_paths()
        assert paths == modules, role
        assert all(Path(p).is_relative_to(mount) for p in paths.values()), role
    gateway = settings["gateway"][GatewaySettings]
    assert gateway.allow_runtime_lora and gateway.lora_dir == tmp_path
    return settings


def test_the_compose_override_mounts_the_adapters_where_the_settings_look(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = {**REQUIRED_VALUES, "LORA_ADAPTERS_DIR": "/srv/adapters",
              "RADIXSERVE_LORA_MODULES": MODULES}  # fmt: skip
    services = merged_services(values)
    for name in MOUNTED:
        assert "/srv/adapters:/adapters:ro" in services[name]["volumes"], name
    envs = {name: services[name]["environment"] for name in RADIXSERVE_SERVICES}
    modules = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    settings = check_lora_settings(monkeypatch, envs, "/adapters", modules, tmp_path)
    check_cluster_settings(settings, envs, "kvstore", "gateway")
    # by default: ./adapters beside the files, no adapter named (run-time loads only)
    defaults = merged_services(dict(REQUIRED_VALUES))
    assert all("./adapters:/adapters:ro" in defaults[n]["volumes"] for n in MOUNTED)
    envs = {name: defaults[name]["environment"] for name in RADIXSERVE_SERVICES}
    check_lora_settings(monkeypatch, envs, "/adapters", {}, tmp_path)


def compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:  # fmt: skip
        return ["docker", "compose"]
    return None


@pytest.mark.benchmark  # make test-docker runs it, where .ci/docker-up installs docker-compose
def test_docker_compose_merges_the_override_as_the_tests_do(tmp_path: Path) -> None:
    """``docker compose config`` (no engine needed) of the two files gives the adapter
    services the environment and volumes `merged_services` gives them."""
    cli = compose_cli()
    assert cli is not None, "neither docker-compose nor `docker compose` on PATH"
    values = {**REQUIRED_VALUES, "LORA_ADAPTERS_DIR": str(tmp_path),
              "RADIXSERVE_LORA_MODULES": MODULES}  # fmt: skip
    done = subprocess.run(
        [*cli, "-p", "radixserve", "-f", str(COMPOSE / "docker-compose.yml"), "-f",
         str(OVERRIDE), "config"],
        capture_output=True, text=True, timeout=60, cwd=COMPOSE,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), **values},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)["services"]
    ours = merged_services(values)
    for name in MOUNTED:
        env = {k: str(v) for k, v in config[name]["environment"].items()}
        assert env == ours[name]["environment"], name
        mounts = {(v["source"], v["target"], v.get("read_only", False)) if isinstance(v, dict)
                  else tuple(v.split(":")) for v in config[name]["volumes"]}  # fmt: skip
        assert mounts & {(str(tmp_path), "/adapters", True), (str(tmp_path), "/adapters", "ro")}


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def with_component(request: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The overlay with the component added to its kustomization.yaml, as the
    component's header says (a copy of the tree), rendered; RADIXSERVE_LORA_MODULES
    set to name two adapters."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(COMPOSE / "k8s", root)
    overlay = root / "overlays" / request.param / "kustomization.yaml"
    overlay.write_text(overlay.read_text() + "\ncomponents:\n  - ../../components/lora\n")
    settings = root / "components" / "lora" / "kustomization.yaml"
    text = settings.read_text()
    assert "RADIXSERVE_LORA_MODULES=[]" in text
    settings.write_text(text.replace("RADIXSERVE_LORA_MODULES=[]",
                                     f"RADIXSERVE_LORA_MODULES={MODULES}"))  # fmt: skip
    out = subprocess.run([kubectl(), "kustomize", str(overlay.parent)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_the_k8s_component_mounts_the_adapters_where_the_settings_look(
    with_component: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    objects = with_component
    for obj in objects:
        if obj["kind"] in ("PersistentVolumeClaim", "Deployment", "ConfigMap"):
            validate_k8s(obj)
    claims = objects_of(objects, "PersistentVolumeClaim")
    claim = claims["radixserve-lora-adapters"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert claim["metadata"]["namespace"] == "radixserve"  # the overlay's
    deployments = {component(d): d for d in objects_of(objects, "Deployment").values()}
    mounts = {}
    for name, deployment in deployments.items():
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        adapters = [v for v in volumes if v.get("persistentVolumeClaim", {}).get("claimName")
                    == "radixserve-lora-adapters"]  # fmt: skip
        assert bool(adapters) == (name in MOUNTED), name
        if adapters:
            [volume] = adapters
            assert volume["persistentVolumeClaim"]["readOnly"] is True
            [mount] = [m for m in container(deployment)["volumeMounts"]
                       if m["name"] == volume["name"]]  # fmt: skip
            assert mount["readOnly"] is True
            mounts[name] = mount["mountPath"]
    assert set(mounts.values()) == {"/adapters"}  # one path in every pod
    envs = {name: pod_env(objects, d) for name, d in deployments.items()}
    modules = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    settings = check_lora_settings(monkeypatch, envs, "/adapters", modules, tmp_path)
    check_cluster_settings(settings, envs, "radixserve-kvstore", "radixserve-gateway")
