"""The explorer's JSON on a real cluster (the shared "remote-tiny": every prompt prefilled
on the prefill worker, pages moved over NIXL): each worker answers the gateway's
`CacheTreeQuery` over its control socket with its tree and live requests, the recent
requests name their route and workers, and the kvstore's host tier is listed. (The page
itself, in a browser: tests/browser.)"""

from __future__ import annotations

import threading

SHARED_CLUSTER = "remote-tiny"  # tests/cluster/conftest.py

SYSTEM = "You answer in one short sentence about the river delta. " * 4


def _turns(cluster, name: str, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name} asks question {turn}"})
        replies.append(cluster.ask(messages, max_tokens=4))
        messages.append(
            {"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]}
        )
    return replies


def test_every_worker_describes_its_cache_and_the_requests_name_their_route(cluster) -> None:
    http = cluster.http
    replies = _turns(cluster, "explorer", 3)
    workers = {w["name"]: w for w in http.get("/debug/explorer/workers").json()["workers"]}
    roles = {w["role"]: w for w in workers.values()}
    assert set(roles) == {"decode", "prefill", "kvstore"}
    assert roles["kvstore"]["tiers"]["host"]["total"] > 0
    for role in ("decode", "prefill"):
        worker = roles[role]
        assert worker["state"] == "up" and worker["tp_size"] == 1
        assert worker["live"] is not None  # it answered the query
        assert worker["tiers"]["device"]["pages_total"] > 0  # (its heartbeat may lag a turn)
        tree = http.get("/debug/explorer/tree", params={"worker": worker["name"]}).json()
        assert tree["num_nodes"] >= 1 and tree["cached_pages"] > 0
        assert all("text" not in node for node in tree["nodes"])
    decode = http.get("/debug/explorer/tree", params={"worker": roles["decode"]["name"]}).json()
    shared = max(decode["nodes"], key=lambda n: n["hits"])
    assert shared["hits"] >= 2  # turns 2 and 3 started from the conversation so far
    assert {r["id"] for r in replies[1:]} & set(shared["recent_request_ids"])
    listed = {r["request_id"]: r for r in http.get("/debug/explorer/requests").json()["requests"]}
    for reply in replies:
        record = listed[reply["id"]]
        assert (record["route"], record["prefill_worker"]) == ("remote", roles["prefill"]["name"])
        assert record["decode_worker"] == roles["decode"]["name"]
        assert record["cached"]["total"] == reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_running_request_shows_its_phase(cluster) -> None:
    """A long generation is listed by its worker while it runs, with its phase."""
    body = {"model": "default", "prompt": "Count slowly:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    done = threading.Event()

    def run() -> None:
        cluster.http.post("/v1/completions", json=body)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    seen: set[str] = set()
    while not done.is_set() and "decode" not in seen:
        workers = cluster.http.get("/debug/explorer/workers").json()["workers"]
        for worker in workers:
            for request in (worker["live"] or {}).get("requests", []):
                seen.add(request["phase"])
    done.wait(120)
    assert "decode" in seen, seen
