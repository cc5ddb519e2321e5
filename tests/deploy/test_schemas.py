"""The deployment files validate against their formats' published schemas.

* every object ``kubectl kustomize`` renders for each overlay, against the Kubernetes
  OpenAPI schemas (`kubernetes_validate`, strict: unknown fields fail) of the oldest
  version the files claim (1.29: NetworkPolicy ``endPort``, ``policy/v1`` budgets) and
  the newest it knows;
* the ServiceMonitor (a custom resource, absent from those schemas) against the
  prometheus-operator CRD's schema as the pydantic models generated from it carry it
  (``cloudcoil-models-prometheus-operator``: types, patterns, enums), plus a round trip
  that catches fields the CRD does not have;
* the compose files against the Compose specification's schema (as check-jsonschema
  vendors it).

Each validator is first shown to reject a broken copy, so a pass means something.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.deploy_files import COMPOSE, COMPOSE_FILE, OVERLAYS, kubectl, render_overlay

K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
KINDS = {
    "Namespace", "ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
    "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor",
}  # fmt: skip


def validate_k8s(obj: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def validate_service_monitor(obj: dict[str, Any]) -> None:
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    model = ServiceMonitor.model_validate(obj)
    assert model.model_dump(by_alias=True, exclude_unset=True) == obj, (
        "fields the ServiceMonitor CRD does not define"
    )


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: Any) -> list[dict[str, Any]]:
    return render_overlay(request.param)


def test_every_rendered_object_validates(rendered: list[dict[str, Any]]) -> None:
    gpu = any(o["kind"] == "PersistentVolumeClaim" for o in rendered)
    keda = any(o["kind"] == "ScaledObject" for o in rendered)
    assert {o["kind"] for o in rendered} == (
        KINDS
        | ({"PersistentVolumeClaim"} if gpu else set())
        | ({"ScaledObject"} if keda else set())
    )
    for obj in rendered:
        if obj["kind"] == "ServiceMonitor":
            validate_service_monitor(obj)
        elif obj["kind"] == "ScaledObject":  # KEDA's CRD: test_crosscheck checks its fields
            assert obj["apiVersion"] == "keda.sh/v1alpha1"
        else:
            validate_k8s(obj)


def test_the_validators_reject_broken_objects(rendered: list[dict[str, Any]]) -> None:
    deployment = next(o for o in rendered if o["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(broken)
    broken = copy.deepcopy(deployment)
    broken["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(broken)
    monitor = next(o for o in rendered if o["kind"] == "ServiceMonitor")
    broken = copy.deepcopy(monitor)
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="does not define"):
        validate_service_monitor(broken)
    broken = copy.deepcopy(monitor)
    broken["spec"]["endpoints"][1]["metricRelabelings"][0]["action"] = "delete"
    with pytest.raises(ValueError, match="action"):
        validate_service_monitor(broken)


def compose_schema() -> dict[str, Any]:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


def compose_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize(
    "name", [COMPOSE_FILE.name, "docker-compose.cuda.yml", "docker-compose.lora.yml"]
)
def test_compose_files_validate(name: str) -> None:
    doc = yaml.safe_load((COMPOSE / name).read_text())
    assert compose_errors(doc) == []
    broken = copy.deepcopy(doc)
    broken["services"]["prefill"]["restrat"] = "always"
    assert compose_errors(broken)


def test_without_kubectl_the_tests_fail_saying_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.fail.Exception, match="kubectl is needed .* install it"):
        kubectl()
