"""The two-node layouts agree with the settings: compose's ``docker-compose.two-nodes.yml``
(each node's containers on its own network, a fabric network between the nodes) and the
Kubernetes ``two-node`` overlay (a kvstore per node, each node's workers beside it).

Every process lists the same kvstores in the same order (the index is sharded by that
list), each worker's own kvstore is among them and on its node, and every service's
environment parses into its settings (the services run for real in the Docker test,
tests/deploy/test_docker_nodes.py)."""

from __future__ import annotations

import copy

import yaml

from radixserve.services.decode import DecodeSettings
from radixserve.services.gateway.settings import GatewaySettings
from radixserve.services.kvstore import KVStoreSettings
from radixserve.services.prefill import PrefillSettings
from tests.deploy.deploy_files import (
    COMPOSE,
    component,
    compose_document,
    container,
    objects_of,
    pod_env,
    render_overlay,
)
from tests.deploy.test_crosscheck import load_settings
from tests.deploy.test_schemas import compose_errors, validate_k8s, validate_service_monitor

TWO_NODES = COMPOSE / "docker-compose.two-nodes.yml"
WORKERS = {"prefill": PrefillSettings, "decode": DecodeSettings}


def services() -> dict[str, dict]:
    found: dict[str, dict] = compose_document(path=TWO_NODES)["services"]
    return found


def test_the_two_node_compose_file_validates() -> None:
    doc = yaml.safe_load(TWO_NODES.read_text())
    assert compose_errors(doc) == []
    broken = copy.deepcopy(doc)
    broken["services"]["decode-a"]["restrat"] = "always"
    assert compose_errors(broken)


def test_each_node_is_a_kvstore_and_its_workers_on_their_own_network(monkeypatch) -> None:
    found = services()
    kvstores = {name: svc for name, svc in found.items() if svc["command"] == ["kvstore"]}
    assert sorted(kvstores) == ["kvstore-a", "kvstore-b"]
    addresses: dict[str, str] = {}
    for name, svc in kvstores.items():
        kv = load_settings(monkeypatch, "kvstore", svc["environment"])[KVStoreSettings]
        assert kv.name == name and kv.advertise_host == name
        addresses[f"tcp://{name}:{kv.port}"] = name
        node = f"node-{name[-1]}"
        assert set(svc["networks"]) == {node, "fabric"}, name
    lists = set()
    for name, svc in found.items():
        role = svc["command"][0]
        if role in WORKERS:
            s = load_settings(monkeypatch, role, svc["environment"])[WORKERS[role]]
            own = addresses[s.kvstore]  # its node's kvstore
            assert set(svc["networks"]) == set(kvstores[own]["networks"]), name
            assert s.drain_linger_s > 0 and svc["stop_grace_period"] == "45s"
            assert s.drain_grace_s + s.drain_linger_s < 45, name
            lists.add(tuple(s.index_shards))
        elif role == "gateway":
            gw = load_settings(monkeypatch, role, svc["environment"])[GatewaySettings]
            lists.add(tuple(gw.kvstore_list()))
            assert svc["networks"] == ["fabric"]
    # one list, in one order, everywhere: the shards of the index
    assert lists == {tuple(addresses)}, lists


# -- Kubernetes: the two-node overlay ------------------------------------------------------

KV_PODS = ("radixserve-kvstore-0", "radixserve-kvstore-1")


def _affinity_pod(deployment: dict) -> str:
    """The kvstore pod a worker Deployment's pods are placed beside."""
    [term] = deployment["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    return str(term["labelSelector"]["matchLabels"]["statefulset.kubernetes.io/pod-name"])


def test_the_two_node_overlay_puts_a_kvstore_on_each_node_and_workers_beside_it(
    monkeypatch,
) -> None:
    objects = render_overlay("two-node")
    assert "radixserve-kvstore" not in objects_of(objects, "Deployment")
    sts = objects_of(objects, "StatefulSet")["radixserve-kvstore"]
    assert sts["spec"]["replicas"] == len(KV_PODS)
    service = objects_of(objects, "Service")[sts["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # each pod by its own name
    [anti] = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"][
        "labels"].items()  # fmt: skip
    kv_env = pod_env(objects, sts)
    assert kv_env["RADIXSERVE_KVSTORE_NAME"] == "<metadata.name>"
    kv = load_settings(monkeypatch, "kvstore", kv_env)[KVStoreSettings]
    addresses = [f"tcp://{pod}.{service['metadata']['name']}:{kv.port}" for pod in KV_PODS]

    lists, nodes = set(), {}
    for name, deployment in objects_of(objects, "Deployment").items():
        role = component(deployment)
        env = pod_env(objects, deployment)
        if role in WORKERS:
            s = load_settings(monkeypatch, role, env)[WORKERS[role]]
            pod = _affinity_pod(deployment)
            assert s.kvstore == addresses[KV_PODS.index(pod)], name  # beside its kvstore
            lists.add(tuple(s.index_shards))
            nodes.setdefault(role, set()).add(pod)
            labels = deployment["spec"]["selector"]["matchLabels"]
            assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        elif role == "gateway":
            lists.add(tuple(load_settings(monkeypatch, role, env)[GatewaySettings].kvstore_list()))
    assert lists == {tuple(addresses)}, lists
    assert nodes == {role: set(KV_PODS) for role in WORKERS}  # each node has each pool
    # one node's pods are never another's (selectors apart)
    selectors = {n: d["spec"]["selector"]["matchLabels"].get("radixserve.io/node")
                 for n, d in objects_of(objects, "Deployment").items()
                 if component(d) in WORKERS}  # fmt: skip
    assert sorted(selectors.values()) == ["0", "0", "1", "1"], selectors


def test_node_1s_workers_are_the_base_workers_but_for_their_node() -> None:
    """workers-node-1.yaml copies the base Deployments: it must not drift from them."""
    base = objects_of(render_overlay("cpu"), "Deployment")
    two = objects_of(render_overlay("two-node"), "Deployment")
    for role in WORKERS:
        copy_ = container(two[f"radixserve-{role}-node-1"])
        node_0 = container(two[f"radixserve-{role}"])
        original = container(base[f"radixserve-{role}"])
        own = f"RADIXSERVE_{role.upper()}_KVSTORE"
        assert [e for e in copy_["env"] if e["name"] != own] == original["env"], role
        assert copy_["envFrom"] == node_0["envFrom"], role  # this overlay's settings
        rest = ("env", "envFrom")
        assert {k: v for k, v in copy_.items() if k not in rest} == {
            k: v for k, v in original.items() if k not in rest}, role  # fmt: skip
    # everything this overlay adds runs the image the cpu overlay names
    images = {container(o)["image"] for o in render_overlay("two-node")
              if o["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip
    assert images == {container(base["radixserve-decode"])["image"]}, images


def test_every_object_of_the_two_node_overlay_validates() -> None:
    for obj in render_overlay("two-node"):
        if obj["kind"] == "ServiceMonitor":
            validate_service_monitor(obj)
        else:
            validate_k8s(obj)
