"""Tenants through `radixserve up`'s processes (the tiny model, pages over ZMQ), as a client
sees them: the gateway's keys come from its environment (the admin) and its key file (two
tenants, the first with two keys). A stored response is its tenant's: another tenant gets
the same 404 as for an id never stored, on GET, DELETE and input_items, while the
tenant's second key reads it; the explorer's request list and the traces are the admin's
alone (403 for a user key)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.cluster_helpers import TestCluster

A1 = "tenant-a-first-key-0123456789"
A2 = "tenant-a-second-key-0123456789"
B = "tenant-b-only-key-0123456789"
ADMIN = "cluster-admin-key-0123456789"
SECRET_TEXT = "my secret code is 7342"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    key_file = Path(tmp_path_factory.mktemp("keys")) / "api-keys.json"
    key_file.write_text(json.dumps([{"key": A1, "tenant": "tenant-a"},
                                    {"key": A2, "tenant": "tenant-a"}, B]))  # fmt: skip
    cluster = TestCluster(
        transport="zmq",
        model=tiny_model,
        gateway={
            "API_KEYS": json.dumps([{"key": ADMIN, "tenant": "ops", "role": "admin"}]),
            "API_KEYS_FILE": str(key_file),
        },
    )
    yield cluster
    cluster.stop()


def test_a_tenants_stored_response_is_hidden_from_another(cluster: TestCluster) -> None:
    http = cluster.http
    body = {"model": "default", "input": SECRET_TEXT, "max_output_tokens": 4, "temperature": 0}
    created = http.post("/v1/responses", json=body, headers=auth(A1))
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    paths = (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items")
    never = http.get("/v1/responses/resp_never_stored", headers=auth(B))
    assert never.status_code == 404
    for path in paths:
        hidden = http.get(path, headers=auth(B))
        assert hidden.status_code == 404, hidden.text
        assert hidden.json()["error"]["message"] == never.json()["error"]["message"].replace(
            "resp_never_stored", rid)  # fmt: skip
        assert http.get(path, headers=auth(A2)).status_code == 200
    assert http.delete(paths[0], headers=auth(B)).status_code == 404
    items = http.get(paths[1], headers=auth(A2)).json()["data"]
    assert SECRET_TEXT in json.dumps(items)  # still there: B deleted nothing
    # B cannot find the id either: the request list and the traces are the admin's
    for path in ("/debug/explorer/requests", "/debug/traces", "/debug/cache", "/explorer"):
        refused = http.get(path, headers=auth(B))
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["code"] == 403
    listed = http.get("/debug/explorer/requests", headers=auth(ADMIN)).json()["requests"]
    assert rid in {r["request_id"] for r in listed}
    traced = http.get("/debug/traces", headers=auth(ADMIN)).json()["traces"]
    assert rid in {t["request_id"] for t in traced}
    assert http.get("/v1/models", headers=auth(B)).status_code == 200
    assert httpx.get(f"{cluster.url}/metrics").status_code == 200  # Prometheus needs no key
    assert http.delete(paths[0], headers=auth(A2)).json()["deleted"] is True
    assert http.get(paths[0], headers=auth(A1)).status_code == 404
