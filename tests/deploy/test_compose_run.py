"""Run it: docker-compose.yml's commands and environments make a working cluster.

No Docker engine runs here, so each compose service's container is a local process
with exactly that service's command and environment, on a loopback address of its own
(`tests.deploy.compose_run` says how names and addresses map). The ``.env`` is a small
machine's (less KV memory, one thread, a fast autoscaler loop); the real default model
serves. One test walks what a user of the compose file sees:

1. before the kvstore is there, workers whose model is loaded are live but not ready,
   and so is the gateway (no decode worker to serve through);
2. once the kvstore starts, every service turns ready (as the image's HEALTHCHECK,
   ``radixserve probe`` with the container's environment, says);
3. chat through the gateway, a long prompt prefilled remotely (KV pages over NIXL
   between two "containers");
4. ``--scale prefill=2``: a second prefill container joins, and both serve;
5. every service's /metrics parses, the series Prometheus keeps (prometheus.yml's drop
   rules applied per job) come from one job each, and the Grafana dashboard's queries
   name only metrics those scrapes have;
6. SIGTERM drains the decode worker: unready (/health 503) but live while a stream on it
   completes, then it exits 0.

A second test takes the cluster down and up again (``docker-compose down; up``): the
kvstore-disk volume keeps the disk tier, and a long prompt asked before the restart is
served from it after, once the gateway says ready.

Marked ``benchmark`` (half a minute of the default model in six processes, where the
suite has a bound): ``make test-docker`` runs it beside tests/deploy/test_docker.py,
which runs the same file in Docker; it needs no Docker engine itself (``make bench-test``
runs it too).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from radixserve.protocol import Channel, GenerateRequest, Hello
from tests.cluster.cluster_helpers import holds_nothing, metric_value
from tests.cluster.prompts import QUESTIONS
from tests.cluster.prompts import chat as messages_of
from tests.cluster.test_host_tier import branch_system, cached
from tests.deploy.compose_run import ComposeRun, Container, http_get
from tests.deploy.deploy_files import COMPOSE, compose_services, dashboard_exprs, metric_names

ADMIN_KEY = "admin-key-of-this-test-0123"  # the chats and /debug/cache need a key
DOT_ENV = {  # what a small machine's .env says
    "RADIXSERVE_CLUSTER_SECRET": "secret-of-this-test-cluster-0123",
    "RADIXSERVE_GATEWAY_API_KEYS": json.dumps([{"key": ADMIN_KEY, "role": "admin"}]),
    "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.25",
    "RADIXSERVE_NUM_THREADS": "1",
    "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB": "0.25",
    "RADIXSERVE_AUTOSCALER_INTERVAL_S": "1",
}
PORTS = {"kvstore": 8080, "prefill": 8080, "decode": 8080, "gateway": 8000, "autoscaler": 8090}
START_TIMEOUT_S = 240


def long_prompt(i: int) -> str:
    """A prompt past the decode worker's local-prefill limit (256 tokens), distinct per i."""
    words = " ".join(f"item{i}-{j}" for j in range(60))
    return f"Document {i}: {words}. Summarise document {i} in one line."


def chat(client: httpx.Client, content: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


def scrape(container: Container) -> str:
    status, body = http_get(f"http://{container.address}:{PORTS[container.service]}/metrics")
    assert status == 200, (container.name, status)
    return body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics body (raises if it does not parse)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def kept_by_prometheus(job: str, scraped: dict[Any, float]) -> dict[Any, float]:
    """The samples prometheus.yml keeps from a scrape of ``job`` (its drop rules)."""
    config = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    [spec] = [j for j in config["scrape_configs"] if j["job_name"] == job]
    drops = [r["regex"] for r in spec.get("metric_relabel_configs", []) if r["action"] == "drop"]
    return {k: v for k, v in scraped.items() if not any(re.fullmatch(d, k[0]) for d in drops)}


def dashboard_metrics() -> set[str]:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    return metric_names(exprs)


def value(scraped: dict[Any, float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in scraped.items() if n == name
               and labels.items() <= dict(lab).items())  # fmt: skip


@pytest.mark.benchmark
def test_compose_services_make_a_working_cluster(tmp_path: Path) -> None:
    run = ComposeRun(compose_services(DOT_ENV), tmp_path)
    try:
        walk_the_cluster(run)
    finally:
        run.stop()
    leftover = [c.name for c in run.containers if c.process.poll() is None]
    assert not leftover, f"still running: {leftover}"


def walk_the_cluster(run: ComposeRun) -> None:
    # 1. no kvstore yet: loaded workers are live, not ready; nor is the gateway
    prefill, decode, gateway = (run.start(n) for n in ("prefill", "decode", "gateway"))
    run.start("autoscaler")
    for w in (prefill, decode):
        run.wait(lambda w=w: w.get(8080, "/live")[0] == 200, START_TIMEOUT_S, f"{w.name} live")
        status, health = w.get(8080, "/health")
        assert status == 503 and health["kvstore"] == "down", health
    run.wait(lambda: gateway.get(8000, "/live")[0] == 200, START_TIMEOUT_S, "gateway live")
    assert gateway.get(8000, "/health")[0] == 503  # no decode worker to serve through
    # 2. with the kvstore every service turns ready, as the image's HEALTHCHECK sees it
    run.start("kvstore")
    for c in run.containers:
        port = PORTS[c.service]
        run.wait(lambda c=c, p=port: c.get(p, "/health")[0] == 200, START_TIMEOUT_S,
                 f"{c.name} ready")  # fmt: skip
        assert c.get(port, "/live")[0] == 200
        probe = subprocess.run([run.program, "probe"], env=c.env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert probe.returncode == 0, (c.name, probe.stderr)
    client = httpx.Client(base_url=f"http://{gateway.address}:8000", timeout=120,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip

    def workers() -> dict[str, Any]:
        found: dict[str, Any] = client.get("/debug/cache").json()["workers"]
        return found

    # 3. chat: a short prompt (decode prefills it) and a long one (the prefill worker does);
    # meanwhile a second prefill container starts (4. --scale prefill=2)
    second = run.start("prefill")
    assert chat(client, "Say hello.")["choices"][0]["message"]["content"]
    assert chat(client, long_prompt(0))["usage"]["prompt_tokens"] > 256
    decode_samples = samples(scrape(decode))
    assert value(decode_samples, "radixserve_worker_remote_prefills_total") >= 1
    assert value(decode_samples, "radixserve_worker_kv_transfer_bytes_total") > 0
    # 4. the new replica joins, and both serve concurrent prompts

    def two_prefills_up() -> bool:
        ws = workers()
        up = [w for w in ws.values() if w["role"] == "prefill" and w["up"]]
        decodes = [w for w in ws.values() if w["role"] == "decode"]
        return len(up) == 2 and all(w.get("prefills_up") == 2 for w in decodes)

    run.wait(two_prefills_up, START_TIMEOUT_S, "the second prefill worker to join")
    addresses = {w["address"] for w in workers().values() if w["role"] == "prefill"}
    assert addresses == {f"tcp://{p.address}:7000" for p in (prefill, second)}
    threads = [threading.Thread(target=chat, args=(client, long_prompt(i))) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for p in (prefill, second):
        served = value(samples(scrape(p)), "radixserve_worker_prefill_requests_total")
        assert served >= 1, f"{p.name} served no prefill"
    run.wait(lambda: holds_nothing(client.get("/debug/cache").json()), 30, "nothing held")
    # the workers (named by default: role, host, port) are in the kvstore's index under
    # the names they registered with
    index = workers()["kvstore"]
    assert index["index_workers"] == 3 and index["index_pages"] > 0, index
    # 4b. the internal plane is keyed by the cluster secret
    kvstore = next(c for c in run.containers if c.service == "kvstore")
    outsiders_are_refused(run, workers, decode, kvstore)
    # 5. metrics: parse, one source per series, the dashboard's names all exported
    kept: dict[Any, set[str]] = {}
    for c in run.containers:
        for key in kept_by_prometheus(c.service, samples(scrape(c))):
            kept.setdefault(key, set()).add(c.name)
    twice = {k: v for k, v in kept.items() if len(v) > 1}
    assert not twice, f"series from two scrapes: {list(twice.items())[:5]}"
    exported = {name for name, _ in kept}
    missing = dashboard_metrics() - exported
    assert not missing, f"the dashboard queries metrics no service exports: {sorted(missing)}"
    roles = {dict(lab).get("role") for (n, lab) in kept if n == "radixserve_worker_up"}
    assert roles == {"kvstore", "prefill", "decode"}
    # 6. drain: SIGTERM the decode worker while a stream runs on it
    drain_while_streaming(run, client, decode)


def outsiders_are_refused(run: ComposeRun, workers, decode: Container, kvstore: Container) -> None:
    """A client without the secret gets no answer from a worker's control port (its
    handshake fails, which the worker counts), and a worker with another secret never
    joins (the kvstore refuses it)."""
    refused = lambda c: value(samples(scrape(c)), "radixserve_worker_auth_refused_total")  # noqa: E731
    before = refused(decode)
    context = zmq.Context()
    try:
        with Channel.open(context, zmq.DEALER, f"tcp://{decode.address}:7000", bind=False) as ch:
            with contextlib.suppress(TimeoutError):  # no peer to send to once it is refused
                ch.send(Hello("outsider", "gateway"), timeout_ms=1000)
                ch.send(GenerateRequest("outsider-1", (1, 2, 3)), timeout_ms=1000)
            assert ch.recv(timeout_ms=1500) is None, "a worker answered a client without the secret"
    finally:
        context.term()
    run.wait(lambda: refused(decode) > before, 10, "the refused handshake counted")
    intruder = run.start(
        "prefill", {"RADIXSERVE_CLUSTER_SECRET": "another-cluster-secret-0123456789"}
    )
    before = refused(kvstore)
    run.wait(lambda: refused(kvstore) > before, START_TIMEOUT_S, "the kvstore refusing it")
    run.wait(lambda: intruder.get(8080, "/live")[0] == 200, START_TIMEOUT_S, "the intruder live")
    assert intruder.get(8080, "/health")[0] == 503  # its kvstore link never comes up
    assert all(w["address"] != f"tcp://{intruder.address}:7000" for w in workers().values())
    intruder.process.kill()
    intruder.process.wait(30)
    run.containers.remove(intruder)


def drain_while_streaming(run: ComposeRun, client: httpx.Client, decode: Container) -> None:
    body = {"model": "default", "max_tokens": 32, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count slowly."}]}  # fmt: skip
    first, events = threading.Event(), []

    def stream() -> None:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60), "no first token"
    decode.process.send_signal(signal.SIGTERM)
    run.wait(lambda: decode.get(8080, "/health")[0] == 503, 10, "the draining decode unready")
    status, health = decode.get(8080, "/health")
    assert health["draining"] is True and decode.get(8080, "/live")[0] == 200
    reader.join(120)
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["usage"]["completion_tokens"] == 32, final
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert decode.process.wait(60) == 0


# A machine whose device pool holds two of the long prompts and whose host tier a few:
# P is pushed out to the host tier by the others, and the kvstore writes its host pages
# to the disk tier when it stops.
SMALL_TIERS = {
    **DOT_ENV,
    "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.06",
    "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB": "0.1",
    "RADIXSERVE_KVSTORE_DISK_TIER_GIB": "0.5",
}
P = messages_of(QUESTIONS[0], branch_system(0) * 5)  # about 1,400 tokens
OTHERS = [messages_of(QUESTIONS[i % 8], branch_system(i) * 5) for i in range(1, 15)]


@pytest.mark.benchmark
def test_compose_down_and_up_serves_the_disk_tier(tmp_path: Path) -> None:
    run = ComposeRun(compose_services(SMALL_TIERS), tmp_path)
    started: list[Container] = []

    def up() -> httpx.Client:
        started.extend(run.start(n) for n in ("kvstore", "prefill", "decode", "gateway"))
        for c in run.containers:
            run.wait(lambda c=c: c.get(PORTS[c.service], "/health")[0] == 200,
                     START_TIMEOUT_S, f"{c.name} ready")  # fmt: skip
        gateway = next(c for c in run.containers if c.service == "gateway")
        return httpx.Client(base_url=f"http://{gateway.address}:8000", timeout=600,
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"})  # fmt: skip

    def ask(client: httpx.Client, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": "default", "max_tokens": 8, "temperature": 0, "messages": messages}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        result: dict[str, Any] = resp.json()
        return result

    try:
        with up() as client:
            first = ask(client, P)
            assert first["usage"]["prompt_tokens"] >= 1300
            for messages in OTHERS:
                ask(client, messages)
        kvstore = next(c for c in run.containers if c.service == "kvstore")
        run.down()
        assert kvstore.process.returncode == 0, kvstore.log_tail()
        volume = Path(kvstore.env["RADIXSERVE_KVSTORE_DISK_TIER_DIR"])
        assert any(volume.glob("slab-*.kv")), "the stop wrote no disk-tier file"
        # the same services on the same volume, asked as soon as the gateway is ready
        with up() as client:
            disk = lambda: metric_value(client.get("/metrics").text,  # noqa: E731
                                        "radixserve_cached_tokens_total", tier="disk")  # fmt: skip
            kv = client.get("/debug/cache").json()["workers"]["kvstore"]
            assert kv["disk_tier_ready"] == 1 and kv["disk_restored_pages"] > 80, kv
            before = disk()
            again = ask(client, P)
            assert cached(again) >= 1000, again["usage"]
            assert disk() - before >= 1000
            assert again["choices"][0]["message"] == first["choices"][0]["message"]
    finally:
        run.stop()
    leftover = [c.name for c in started if c.process.poll() is None]
    assert not leftover, f"still running: {leftover}"
