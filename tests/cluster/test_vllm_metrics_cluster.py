"""vLLM's metric names on a running cluster (`radixserve.vllm_metrics`): the gateway's
latency histograms and the workers' per-engine gauges and counters move as requests run,
and agree with radixserve's own figures for the same numbers.

The workers serve their /metrics on a port of their own choosing (``HTTP_PORT=0``); the
test finds it among the worker process's listening sockets (/proc) as the one that
answers HTTP."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.settings import EngineSettings
from radixserve.vllm_metrics import ITL_BUCKETS, TTFT_BUCKETS
from tests.cluster.cluster_helpers import TestCluster, metric_value

pytestmark = pytest.mark.timeout(600)


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def metrics_url(cluster: TestCluster, name: str) -> str:
    """The URL of worker ``name``'s /metrics (the listening port that answers HTTP)."""
    pid = cluster.supervisor.pid(name)
    assert pid is not None, name
    for port in listening_ports(pid):
        try:
            resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200 and "radixserve_worker_up" in resp.text:
            return f"http://127.0.0.1:{port}/metrics"
    raise AssertionError(f"{name} serves no /metrics")


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture(scope="module")
def cluster(tiny_model: str):
    c = TestCluster(transport="zmq", model=tiny_model, decode={"HTTP_PORT": "0"},
                    prefill={"HTTP_PORT": "0"})  # fmt: skip
    yield c
    c.stop()


def test_vllm_names_move_with_requests_and_match_radixserve_figures(cluster: TestCluster) -> None:
    decode_url = metrics_url(cluster, "decode-0")
    prefill_url = metrics_url(cluster, "prefill-0")
    model = cluster.http.get("/v1/models").json()["data"][0]["id"]
    engine = {"model_name": model, "engine": "decode-0"}
    before = httpx.get(decode_url).text
    assert metric_value(before, "vllm:num_requests_running", **engine) == 0
    assert metric_value(before, "vllm:kv_cache_usage_perc", **engine) == 0
    assert metric_value(before, "vllm:prefix_cache_queries_total", **engine) == 0

    # a long stream: while it runs the decode engine has it in its batch and holds pages
    body = {"model": "default", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0, "messages": [{"role": "user", "content": "Count to ten."}]}  # fmt: skip
    first = threading.Event()

    def stream() -> None:
        with cluster.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                first.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        assert first.wait(120)
        during = httpx.get(decode_url).text
    finally:
        streamer.join(300)
    assert metric_value(during, "vllm:num_requests_running", **engine) == 1
    assert metric_value(during, "radixserve_worker_running", worker="decode-0") == 1
    usage = metric_value(during, "vllm:kv_cache_usage_perc", **engine)
    assert 0 < usage <= 1
    total = metric_value(during, "radixserve_worker_pages_total", worker="decode-0")
    free = metric_value(during, "radixserve_worker_pages_free", worker="decode-0")
    evictable = metric_value(during, "radixserve_worker_pages_evictable", worker="decode-0")
    assert usage == pytest.approx((total - free - evictable) / total)

    # the same prompt twice: the second finds the first's pages in the decode worker's cache
    prompt = [{"role": "user", "content": "Tell me about the sea. " * 12}]
    cluster.ask(prompt, max_tokens=4)
    cluster.ask(prompt, max_tokens=4)
    cluster.wait_clean()
    after = httpx.get(decode_url).text
    assert metric_value(after, "vllm:num_requests_running", **engine) == 0
    assert metric_value(after, "vllm:num_requests_waiting", **engine) == 0
    assert metric_value(after, "vllm:kv_cache_usage_perc", **engine) == 0
    queries = metric_value(after, "vllm:prefix_cache_queries_total", **engine)
    hits = metric_value(after, "vllm:prefix_cache_hits_total", **engine)
    assert queries == metric_value(
        after, "radixserve_worker_prefix_cache_queried_tokens_total", worker="decode-0"
    )
    assert hits == metric_value(
        after, "radixserve_worker_prefix_cache_hit_tokens_total", worker="decode-0"
    )
    assert 0 < hits < queries
    assert families(after)["vllm:prefix_cache_hits"].type == "counter"  # type: ignore[attr-defined]
    # the prefill worker is an engine too, with its own label (no request reached it)
    prefill = httpx.get(prefill_url).text
    assert "vllm:num_requests_running" in families(prefill)
    assert 'engine="prefill-0"' in prefill

    # the gateway: vLLM's histograms observe what radixserve's do, in vLLM's buckets
    gateway = cluster.metrics()
    for vllm, own in (("vllm:time_to_first_token_seconds", "radixserve_ttft_seconds"),
                      ("vllm:inter_token_latency_seconds", "radixserve_itl_seconds")):  # fmt: skip
        count = metric_value(gateway, f"{vllm}_count", model_name=model)
        assert count == metric_value(gateway, f"{own}_count") > 0
        assert metric_value(gateway, f"{vllm}_sum", model_name=model) == pytest.approx(
            metric_value(gateway, f"{own}_sum")
        )
    assert metric_value(gateway, "vllm:time_to_first_token_seconds_count") == 3
    ttft = families(gateway)["vllm:time_to_first_token_seconds"]
    bounds = {s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")}  # type: ignore[attr-defined]
    assert len(bounds) == len(TTFT_BUCKETS) + 1
    itl = families(gateway)["vllm:inter_token_latency_seconds"]
    bounds = {s.labels["le"] for s in itl.samples if s.name.endswith("_bucket")}  # type: ignore[attr-defined]
    assert len(bounds) == len(ITL_BUCKETS) + 1
    [lora] = families(gateway)["vllm:lora_requests_info"].samples  # type: ignore[attr-defined]
    # max_lora: the workers' adapter slots (max_loras, its default here)
    slots = metric_value(gateway, "radixserve_worker_lora_max", worker="decode-0")
    assert slots == EngineSettings.model_fields["max_loras"].default
    assert lora.labels == {"max_lora": str(int(slots)), "waiting_lora_adapters": "",
                           "running_lora_adapters": ""}  # fmt: skip
    # one source per series: the per-engine families come from the workers only
    assert "vllm:num_requests_running" not in families(gateway)
    assert "vllm:prefix_cache_hits" not in families(gateway)
