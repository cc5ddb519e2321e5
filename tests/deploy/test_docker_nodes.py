"""The two-node compose layout (``compose/docker-compose.two-nodes.yml``) run for real in
Docker: containers as nodes, each node's on a network of its own, the nodes joined by a
third (fabric), KV pages between them over NIXL/UCX.

1. Both kvstores list both decode workers, and each indexes its shard of their pages.
2. A ~3,000-token conversation on one node's decode worker; that worker is stopped
   (``docker stop``: it drains, then lingers lending its pages). The next turn goes to the
   other node's worker, which reads the prefix from the drained one: at least 90 % of the
   prompt cached, from the peer tier, and the answer the one process gives. Its TTFT is
   printed beside a local device hit's (a twin conversation's turn 4 on its own worker:
   the same prefix cached, the same new tokens computed), a recompute's and the same
   prompt repeated on the worker now holding it (one run, this machine).
3. ``docker kill`` of one kvstore while new conversations arrive: none is lost; the
   gateway still lists both workers (the other kvstore keeps the membership); the
   replacement (``docker start``) is whole again (its shard of the index, the members)
   from the workers' resyncs, in the seconds printed.

Marked ``benchmark`` (images, then the default model in five containers); ``make
test-docker`` runs it where a Docker engine runs (``.ci/docker-up`` starts one).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.cluster_helpers import memoised_chat
from tests.cluster.prompts import long_conversation
from tests.deploy.deploy_files import COMPOSE
from tests.deploy.docker_host import Images, compose_command, sh
from tests.deploy.test_docker import (  # noqa: F401 - the images fixture, shared
    API_KEYS,
    AUTH,
    IMAGE,
    SECRET,
    images,
    inspect,
    report,
    wait_for,
)
from tests.engine.engine_helpers import make_engine

pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(3600)]

SERVICES = ("kvstore-a", "kvstore-b", "decode-a", "decode-b", "gateway")
DECODES = ("decode-a", "decode-b")
MAX_TOKENS = 8


class Nodes:
    """The two-node compose file with the built image, under a project of its own."""

    def __init__(self, folder: Path) -> None:
        self.project = f"rxnodes{uuid.uuid4().hex[:6]}"
        override = {
            "services": {s: {"image": IMAGE} for s in (*SERVICES, "prefill-a", "prefill-b")}
        }
        (folder / "override.yml").write_text(json.dumps(override))
        (folder / ".env").write_text(
            f"RADIXSERVE_CLUSTER_SECRET={SECRET}\nRADIXSERVE_GATEWAY_API_KEYS={API_KEYS}\n"
            "RADIXSERVE_KV_CACHE_MEMORY_GIB=0.25\nRADIXSERVE_NUM_THREADS=1\n"
            "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB=0.25\n"
            # the decode workers compute their prompts themselves (no prefill pool here)
            "RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS=100000\n"
        )
        self.base = [*compose_command(), "-p", self.project, "--project-directory", str(COMPOSE),
                     "--env-file", str(folder / ".env"),
                     "-f", str(COMPOSE / "docker-compose.two-nodes.yml"),
                     "-f", str(folder / "override.yml")]  # fmt: skip

    def __call__(self, *args: str, timeout_s: float = 600) -> str:
        return sh([*self.base, *args], timeout_s=timeout_s).stdout

    def container(self, service: str) -> str:
        [cid] = self("ps", "-q", service).split()
        return cid

    def down(self) -> None:
        sh([*self.base, "down", "-v", "-t", "5"], timeout_s=300, check=False)


@pytest.fixture(scope="module")
def nodes(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:  # noqa: F811
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.fail("127.0.0.1:8000 is taken: the compose file publishes the gateway there")
    run = Nodes(tmp_path_factory.mktemp("nodes"))
    try:
        yield run
    finally:
        run.down()


def ask(client: httpx.Client, messages: list[dict[str, str]]) -> tuple[dict[str, Any], float]:
    """A greedy streamed chat: (its text and usage, its time to first token in s)."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start, ttft, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - start
                    text += piece
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage, (text, usage)
    return {"text": text, "usage": usage}, ttft


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def workers(client: httpx.Client) -> dict[str, Any]:
    found: dict[str, Any] = client.get("/debug/cache").json()["workers"]
    return found


def worker_of(client: httpx.Client, container: str) -> str:
    """The gateway's name of the worker in ``container`` (its name holds the host name)."""
    [name] = [n for n in workers(client) if container[:12] in n]
    return name


def test_two_nodes(nodes: Nodes) -> None:
    start = time.monotonic()
    nodes("up", "-d", *SERVICES)

    def all_healthy() -> bool:
        return all(inspect(nodes.container(s), "{{.State.Health.Status}}") == "healthy"
                   for s in SERVICES)  # fmt: skip

    wait_for("every service healthy", all_healthy, 420, every_s=2)
    report("two nodes: all healthy after s", round(time.monotonic() - start, 1))
    client = httpx.Client(base_url="http://127.0.0.1:8000", timeout=300, headers=AUTH)
    names = {s: worker_of(client, nodes.container(s)) for s in DECODES}

    def both_listed() -> bool:
        found = workers(client)
        return all(found[k].get("members") == 2 for k in ("kvstore-a", "kvstore-b"))

    wait_for("both kvstores to list both decode workers", both_listed, 60)
    reference = memoised_chat(make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False))

    # -- a drain moves a conversation to the other node: its prefix read from the peer --
    tag = uuid.uuid4().hex[:8]
    before = {s: workers(client)[n].get("local_prefills_total", 0) for s, n in names.items()}
    for turns in (1, 2, 3):
        ask(client, long_conversation(tag, turns))
    after = workers(client)
    owner = max(DECODES, key=lambda s: after[names[s]].get("local_prefills_total", 0) - before[s])
    other = DECODES[1 - DECODES.index(owner)]
    pages = {k: after[k].get("index_pages", 0) for k in ("kvstore-a", "kvstore-b")}
    report("two nodes: index pages per shard", pages)
    assert all(pages.values()), pages
    read_before = after[names[other]].get("peer_read_pages_total", 0)
    stop_owner = threading.Thread(target=lambda: sh(["docker", "stop", "-t", "60",
                                                     nodes.container(owner)], timeout_s=120))  # fmt: skip
    stop_owner.start()
    try:
        wait_for(f"{owner} draining", lambda: workers(client)[names[owner]].get("draining"), 30,
                 every_s=0.2)  # fmt: skip
        messages = long_conversation(tag, 4)
        answer, peer_ttft = ask(client, messages)
    finally:
        stop_owner.join(120)
    prompt = answer["usage"]["prompt_tokens"]
    read = workers(client)[names[other]].get("peer_read_pages_total", 0) - read_before
    report(
        "two nodes: turn 4 after the drain, cached / prompt tokens", f"{cached(answer)} / {prompt}"
    )
    report("two nodes: pages read from the drained worker", read)
    assert cached(answer) >= 0.9 * prompt, answer["usage"]
    assert read * 16 >= 0.85 * prompt, (read, prompt)
    assert answer["text"] == reference(messages, MAX_TOKENS)
    assert int(inspect(nodes.container(owner), "{{.State.ExitCode}}")) == 0
    # the prompt repeated on the worker that now holds it (all but its last page on its
    # device), and the same turn under another tag (nothing cached: computed)
    _, repeat_ttft = ask(client, messages)
    _, recompute_ttft = ask(client, long_conversation(uuid.uuid4().hex[:8], 4))
    nodes("up", "-d", owner)  # the stopped worker back, for what follows
    wait_for(f"{owner} healthy again", lambda: inspect(nodes.container(owner),
             "{{.State.Health.Status}}") == "healthy", 300)  # fmt: skip
    # the local device hit of the same turn: a twin conversation whose turn 4 stays on
    # its worker (the same prefix cached, the same new tokens computed; no read)
    twin = uuid.uuid4().hex[:8]
    for turns in (1, 2, 3):
        ask(client, long_conversation(twin, turns))
    _, local_ttft = ask(client, long_conversation(twin, 4))
    report("two nodes: turn 4 TTFT ms peer read / local hit (a twin's turn 4 on its own "
           "worker) / recompute",
           f"{peer_ttft * 1e3:.0f} / {local_ttft * 1e3:.0f} / {recompute_ttft * 1e3:.0f} "
           f"(peer/local {peer_ttft / local_ttft:.2f}x, "
           f"peer/recompute {peer_ttft / recompute_ttft:.3f}x)")  # fmt: skip
    report("two nodes: the prompt repeated on the worker holding it, TTFT ms",
           f"{repeat_ttft * 1e3:.0f}")  # fmt: skip

    # -- one kvstore killed mid-traffic: nothing lost, the replacement whole again -------
    victim = "kvstore-b"
    answers: list[tuple[list[dict[str, str]], dict[str, Any]]] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            for _ in range(4):
                chat = long_conversation(uuid.uuid4().hex[:8], 1)
                answers.append((chat, ask(client, chat)[0]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(1)
    sh(["docker", "kill", nodes.container(victim)])
    wait_for(f"{victim} down at the gateway", lambda: not workers(client)[victim]["up"], 60,
             every_s=0.2)  # fmt: skip
    up = {n: w["up"] for n, w in workers(client).items() if w.get("role") == "decode"}
    report("two nodes: decode workers up with one kvstore killed", up)
    assert len(up) == 2 and all(up.values()), up
    thread.join(600)
    assert not errors, errors
    assert len(answers) == 4
    for chat, got in answers:
        assert got["text"] == reference(chat, MAX_TOKENS)
    sh(["docker", "start", nodes.container(victim)])
    up_s = wait_for(f"{victim} up at the gateway", lambda: workers(client)[victim]["up"], 120,
                    every_s=0.1)  # fmt: skip
    up_at = time.monotonic()

    def whole() -> bool:
        view = workers(client)[victim]
        return bool(view["up"]) and view.get("members") == 2 and view.get("index_workers") == 2

    wait_for(f"{victim} back with its shard and the members", whole, 120, every_s=0.1)
    report("two nodes: replacement kvstore up after s (docker start to its link up)", up_s)
    report("two nodes: ... then whole (both workers registered and indexed) after s",
           round(time.monotonic() - up_at, 1))  # fmt: skip
    with contextlib.suppress(httpx.HTTPError):
        client.close()
