"""The autoscaler's control loop on real processes, with the ``local`` connector.

A bounded load of long, uncached prompts (prefill-heavy) queues on the one prefill
worker, whose per-request histograms show the wait; the autoscaler adds a prefill worker
process through `radixserve up`'s pool API, the gateway routes to it; the load stops,
and the autoscaler scales back down through a drain (the worker exits 0). Then, on the
same cluster, one prompt longer than a replica computes within the TTFT target: the
autoscaler logs it infeasible, counts it, and adds no worker. No request fails. On 2
cores the added worker need not lower TTFT: this checks the loop and the routing; the
simulator (`bench --scenario autoscale`) judges the policy.

The cluster serves the tiny model (the `tiny_model` fixture): the subject is the control
loop, not the model's answers (nothing here compares them), and the default model's
compute was most of this test's cost. Its prefill being far faster, the prompts are
longer (~1,000 tokens, under 0.1 s of prefill each on a free core) and the TTFT target
is 0.1 s, so three clients queueing on one prefill worker stay over it on an idle machine
too. The load runs until the added worker has served, bounded in time rather than in
requests: how long a worker takes to start depends on the machine, not on the model.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx

from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.launch.cluster import ClusterConfig
from tests.cluster.cluster_helpers import FAST_LIVENESS, holds_nothing
from tests.cluster.prompts import SYSTEM, chat


def _env(prefix: str, values: dict[str, str]) -> dict[str, str]:
    return {f"RADIXSERVE_{prefix}_{k}": v for k, v in values.items()}


def test_autoscaler_adds_a_prefill_worker_under_load_and_drains_it_after(tiny_model: str, capfd):
    config = ClusterConfig(
        port=0,  # any free port, as the autoscaler's: bound by the supervisor
        engine_env={"RADIXSERVE_MODEL": tiny_model, "RADIXSERVE_DEVICE": "cpu",
                    "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1",
                    **_env("KVSTORE", {**FAST_LIVENESS, "HOST_CAPACITY_GIB": "0.1"})},
        prefill_env=_env("PREFILL", FAST_LIVENESS),
        decode_env=_env("DECODE", FAST_LIVENESS),
        gateway_env=_env("GATEWAY", FAST_LIVENESS),
        autoscale=True,
        autoscaler_env=_env("AUTOSCALER", {
            "TTFT_P90_TARGET_S": "0.1", "ITL_P90_TARGET_S": "5", "INTERVAL_S": "1",
            "SCALE_UP_COOLDOWN_S": "2", "SCALE_DOWN_COOLDOWN_S": "6", "COLD_START_S": "0",
            "MIN_PREFILL": "1", "MAX_PREFILL": "2", "MIN_DECODE": "1", "MAX_DECODE": "1",
            "PORT": "0",
        }) | {"RADIXSERVE_LOG_LEVEL": "INFO"},  # every interval's decisions, in the log
        drain_timeout_s=60,
    )  # fmt: skip
    statuses: list[int] = []
    stop = threading.Event()
    with LocalCluster(config) as cluster, httpx.Client(base_url=cluster.url, timeout=120) as http:
        scaler = cluster.processes.autoscaler_url

        def load(worker: int) -> None:  # bounded: at most 180 s, the wait's below
            deadline = time.monotonic() + 180
            for i in itertools.count():
                if stop.is_set() or time.monotonic() > deadline:
                    return
                body = {"model": "default", "max_tokens": 2, "temperature": 0,
                        "messages": chat("Hi", f"[{worker}.{i}] " + SYSTEM * 4)}  # fmt: skip
                resp = http.post("/v1/chat/completions", json=body)
                statuses.append(resp.status_code)

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()

        def added_with_requests() -> str | None:  # an added prefill worker that served
            for name, w in cluster.workers().items():
                if name.startswith("prefill-") and name != "prefill-0" and w.get("up") \
                        and w.get("prefill_requests_total", 0) > 0:  # fmt: skip
                    return name
            return None

        try:
            cluster.wait(lambda: added_with_requests() is not None, 180,
                         "an added prefill worker serving requests")  # fmt: skip
            added = added_with_requests()
            assert added is not None
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        ups = metric_value(httpx.get(f"{scaler}/metrics").text,
                           "radixserve_autoscaler_decisions_total", role="prefill",
                           direction="up")  # fmt: skip
        assert ups >= 1
        # the load is gone: back to one prefill worker, the added one drained and exited 0
        cluster.wait(lambda: cluster.supervisor.retired.get(added) is not None, 90,
                     f"{added} to be retired")  # fmt: skip
        assert cluster.supervisor.retired[added] == 0
        cluster.wait(lambda: added not in cluster.workers(), 20, f"{added} to leave")
        metrics = httpx.get(f"{scaler}/metrics").text
        assert metric_value(metrics, "radixserve_autoscaler_decisions_total", role="prefill",
                            direction="down") >= 1  # fmt: skip
        assert metric_value(metrics, "radixserve_autoscaler_desired_replicas", role="prefill") == 1
        assert httpx.get(f"{cluster.control_url}/v1/pools/prefill").json()["spec"]["replicas"] == 1
        health = httpx.get(f"{scaler}/health")
        assert health.status_code == 200 and health.json()["connector"] == "local"
        gateway = httpx.get(f"{cluster.url}/metrics").text  # the workers' per-request split
        assert metric_value(gateway, "radixserve_worker_prefill_wait_seconds_count") > 0
        _infeasible_prompt_adds_no_worker(cluster, http, scaler, gateway, capfd)
        deadline = time.monotonic() + 30
        while not holds_nothing(cluster.debug_cache()):
            assert time.monotonic() < deadline, cluster.debug_cache()
            time.sleep(0.2)
    assert statuses and all(s == 200 for s in statuses), statuses


def _infeasible_prompt_adds_no_worker(
    cluster: LocalCluster, http: httpx.Client, scaler: str, gateway: str, capfd
) -> None:
    """One prompt of ~3x the tokens a prefill worker computes in the 0.1 s TTFT target
    (at the rate it measured under the load): logged infeasible, no worker added."""
    tokens = metric_value(gateway, "radixserve_worker_engine_prefill_tokens_total", role="prefill")
    seconds = metric_value(gateway, "radixserve_worker_engine_prefill_seconds_total",
                           role="prefill")  # fmt: skip
    length = min(max(int(0.3 * tokens / seconds), 2000), 7000)  # within the 8k context
    assert length / (tokens / seconds) > 0.15, "the prefill rate leaves no prompt infeasible"

    def scaler_metric(name: str, **labels: str) -> float:
        return metric_value(httpx.get(f"{scaler}/metrics").text, name, **labels)

    ups = scaler_metric("radixserve_autoscaler_decisions_total", role="prefill", direction="up")
    # (on a slow machine the load's prompts were over the 0.1 s target already)
    before = scaler_metric("radixserve_autoscaler_infeasible_requests_total", slo="ttft")
    capfd.readouterr()  # what the processes logged so far
    body = {
        "model": "default",
        "max_tokens": 2,
        "temperature": 0,
        "messages": chat("Hi", "[long] " + SYSTEM * (length // 230)),
    }  # ~230 tokens each
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text

    cluster.wait(lambda: scaler_metric("radixserve_autoscaler_infeasible_requests_total",
                                       slo="ttft") == before + 1,
                 30, "the autoscaler to count the long prompt infeasible")  # fmt: skip
    time.sleep(2)  # two more intervals: none of them adds a worker
    assert scaler_metric("radixserve_autoscaler_decisions_total", role="prefill",
                         direction="up") == ups  # fmt: skip
    assert scaler_metric("radixserve_autoscaler_desired_replicas", role="prefill") == 1
    assert [n for n in cluster.workers() if n.startswith("prefill-")] == ["prefill-0"]
    assert "prefill: 1 infeasible request(s)" in capfd.readouterr().err
