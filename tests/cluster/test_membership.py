"""Elastic membership with real processes, as a user runs it: `radixserve up`, then one
more prefill and one more decode worker started by the join command it prints.

One cluster, in order:
1. the joined workers are listed at the gateway within 10 s of listening, and requests
   reach both (remote prefill on the new prefill worker, streams on the new decode one);
2. `kill -9` of decode-0 while greedy and seeded streams run on both decode workers:
   the gateway marks it down within a second (its TCP connection closes), its streams
   continue on the joined decode worker (migration) and every text equals the
   uninterrupted answer; the supervisor restarts it;
2b. `kill -9` of the joined prefill worker: it leaves routing and the listing, requests
   go on;
3. SIGTERM of the joined decode worker while it streams a long answer: the stream
   completes, requests sent during the drain go elsewhere, it exits 0 and leaves;
4. `kill -9` of the kvstore (the discovery source): serving goes on with the members
   known, and they are listed again once it is back;
5. SIGTERM of `radixserve up` stops every process it started and exits 0.
No request fails along the way, and no worker is left holding anything.

Every process serves the tiny model (the `tiny_model` fixture, as ``RADIXSERVE_MODEL`` in
the environment of `radixserve up` and of the joined workers): the subject is the
machinery, and the migrated streams are compared with reruns on the same weights. The
default model's compute was most of this test's cost; the tiny one decodes a token in
milliseconds, so the streams that the kill and the SIGTERM must land in are long
(``ignore_eos``). Its random logits are nearly flat, so its seeded streams draw from the
top 8 tokens (``top_k``), most of them still differing from the greedy token; with the
engine's defaults a migrated stream's recomputed prompt has the same bits as the
unbroken one's, so the draws are the same.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.cluster.cluster_helpers import (
    FAST_LIVENESS,
    descendants,
    gone,
    holds_nothing,
    metric_value,
    service_pid,
)
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

ENV = {
    **os.environ,
    "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1",
    "RADIXSERVE_DEVICE": "cpu",
    "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB": "0.1",
    **{f"RADIXSERVE_{role}_{k}": v for role in ("PREFILL", "DECODE", "GATEWAY", "KVSTORE")
       for k, v in FAST_LIVENESS.items()},
}  # fmt: skip


class Proc:
    """A child process whose output lines are collected on a thread. A command line is
    run as a shell would (``KEY=value`` words first are added to ``env``), but without
    one, so signals reach the process itself."""

    def __init__(self, cmd: list[str] | str, env: dict[str, str]) -> None:
        argv = shlex.split(cmd) if isinstance(cmd, str) else cmd
        env = dict(env)
        while argv and "=" in argv[0] and not argv[0].startswith("/"):
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, text: str, timeout_s: float = 180) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if text in line:
                    return line
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in:\n{''.join(self.lines)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def wait(condition, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


# streams the kill and the SIGTERM land in: on the tiny model (milliseconds a token) long
# enough to outlast the heartbeat after which the gateway sees them running (a run with
# 128 saw decode-0's streams end before the kill, nothing to migrate)
LONG_STREAM_TOKENS = 480


def ask(http: httpx.Client, question: str, max_tokens: int = 8, system: str = SYSTEM) -> dict:
    body = {"model": "default", "messages": chat(question, system), "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream_text(http: httpx.Client, body: dict, progress: list[int]) -> str:
    """The streamed answer's text; ``progress[0]`` counts its content events. Fails on
    an error event or a non-200 answer."""
    parts = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            assert '"error"' not in line, line
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        parts.append(choice["delta"]["content"])
                        progress[0] += 1
    return "".join(parts)


def kill_decode_mid_stream(http: httpx.Client, up: Proc, workers, other: str) -> None:
    """Greedy and seeded streams on both decode workers; kill -9 decode-0 while they run.
    Each stream's text equals the same request run after, uninterrupted."""
    bodies = [
        {"model": "default", "messages": chat(QUESTIONS[i % 3], f"[migrate {i}] " + SYSTEM),
         "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": True,
         **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_k": 8, "seed": 11 + i})}
        for i in range(4)
    ]  # fmt: skip
    texts: dict[int, str] = {}
    progress = [[0] for _ in bodies]

    def run(i: int) -> None:
        texts[i] = stream_text(http, bodies[i], progress[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    # (long enough that streams on both workers overlap however the 2 cores are shared,
    # and that decode-0's still run when the kill lands, a heartbeat after the gateway saw
    # them: on 2 cores that was 0.25-0.45 s in, with at most 14 tokens sent)
    wait(lambda: sum(p[0] >= 2 for p in progress) >= 2 and workers()["decode-0"].get(
        "live_requests", 0) > 0 and workers()[other].get("live_requests", 0) > 0, 120,
        "streams running on both decode workers")  # fmt: skip
    decode0 = service_pid(up.proc.pid, "decode")
    os.kill(decode0, signal.SIGKILL)
    took = wait(lambda: not workers()["decode-0"]["up"], 5, "the gateway to mark decode-0 down")
    assert took < 1.0, f"a dead decode worker was noticed after {took:.2f} s"
    for t in threads:
        t.join(180)
    assert sorted(texts) == list(range(len(bodies)))
    migrated = metric_value(http.get("/metrics").text, "radixserve_migrations_total")
    assert migrated and migrated >= 1
    wait(lambda: workers().get("decode-0", {}).get("up"), 120, "decode-0 restarted")
    # the same requests, uninterrupted (together: a batch answers as each alone would)
    with ThreadPoolExecutor(len(bodies)) as pool:
        references = list(pool.map(lambda b: http.post("/v1/chat/completions", json=b), bodies))
    for i, reference in enumerate(references):
        assert texts[i] == reference.json()["choices"][0]["message"]["content"], i


def cached_turn_counts(http: httpx.Client) -> None:
    """A cached chat turn through `radixserve up` makes each decision once: the gateway
    hashes the prompt once and only picks the decode worker; the decode worker hashes
    nothing, matches its radix tree once and, the prefix being on its device, asks the
    kvstore nothing (no host-tier lookup, no index query); no prefill worker is asked."""

    def state() -> dict:
        return http.get("/debug/cache").json()

    wait(lambda: state()["workers"]["decode-0"].get("host_attached") == 1, 60,
         "decode-0 attached to the host tier")  # fmt: skip
    messages = chat("Name three colours.", SYSTEM)
    first = http.post("/v1/chat/completions", json={"model": "default", "messages": messages,
                      "max_tokens": 24, "temperature": 0})  # fmt: skip
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]["content"]
    beats = state()["workers"]["decode-0"].get("heartbeats_total", 0)

    def settled() -> bool:  # a heartbeat sent after turn 1 ended (a whole turn of the tiny
        d = state()["workers"]["decode-0"]  # model can fit between two heartbeats)
        return d.get("heartbeats_total", 0) >= beats + 2 and d.get("live_requests") == 0

    wait(settled, 10, "turn 1 done")
    before = state()
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And three more?"}]  # fmt: skip
    second = http.post("/v1/chat/completions", json={"model": "default", "messages": messages,
                       "max_tokens": 8, "temperature": 0})  # fmt: skip
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64

    def counted() -> bool:  # the heartbeat after the turn has reached the gateway
        d = state()["workers"]["decode-0"]
        old = before["workers"]["decode-0"]
        local = d.get("local_prefills_total", 0)
        return local == old.get("local_prefills_total", 0) + 1 and d["live_requests"] == 0

    wait(counted, 10, "decode-0's counters after turn 2")
    after = state()

    def delta(worker: str, key: str) -> int:
        return after["workers"][worker].get(key, 0) - before["workers"][worker].get(key, 0)

    assert after["gateway_prompt_hashes"] - before["gateway_prompt_hashes"] == 1
    assert delta("decode-0", "prompt_hashes_total") == 0
    assert delta("decode-0", "radix_matches_total") == 1
    assert delta("decode-0", "host_lookups_total") == 0
    assert delta("decode-0", "index_queries_total") == 0
    assert delta("prefill-0", "prefill_requests_total") == 0


def test_workers_join_leave_and_drain_in_a_running_cluster(tiny_model: str):
    env = {**ENV, "RADIXSERVE_MODEL": tiny_model}  # every process: up's and the joined ones
    up = Proc([sys.executable, "-m", "radixserve.cli", "up", "--port", "0"], env)
    joined: list[Proc] = []
    http = httpx.Client(timeout=120)  # its base URL: the port `up` bound and printed

    def workers() -> dict:
        return http.get("/debug/cache").json()["workers"]

    try:
        line = up.wait_line("add a worker: ")
        url = up.wait_line("cluster up").split("OpenAI API at ", 1)[1].split("/v1", 1)[0]
        http.base_url = httpx.URL(url)
        join = line.split("add a worker: ", 1)[1].split("  (or decode", 1)[0].strip()
        assert " prefill --join tcp://127.0.0.1:" in join, join
        processes = descendants(up.proc.pid)
        # the gateway, and the warm-start server with kvstore, prefill and decode forked by it
        assert len(processes) == 5, processes

        # 0. a cached turn makes each decision once
        cached_turn_counts(http)

        # 1. two workers join by the printed command
        new_prefill = Proc(join, env)
        new_decode = Proc(join.replace(" prefill --join", " decode --join"), env)
        joined += [new_prefill, new_decode]
        names = {}
        for role, proc in (("prefill", new_prefill), ("decode", new_decode)):
            listening = proc.wait_line(f"radixserve {role} ")
            names[role] = listening.split()[2]
            took = wait(lambda r=role: workers().get(names[r], {}).get("up"), 10,
                        f"{names[role]} listed at the gateway")  # fmt: skip
            assert took <= 10
            assert workers()[names[role]]["discovered"]
        wait(lambda: workers()[names["decode"]].get("prefills_up") == 2, 10,
             "the joined decode worker's links to both prefill workers")  # fmt: skip
        # requests reach them: concurrent prompts long enough to prefill remotely
        for round_ in range(6):
            systems = [f"[{round_}.{i}] {SYSTEM}" for i in range(4)]
            threads = [threading.Thread(target=ask, args=(http, QUESTIONS[i], 4, systems[i]))
                       for i in range(4)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            w = workers()
            if (w[names["prefill"]].get("prefill_requests_total", 0) > 0
                    and w[names["decode"]].get("remote_prefills_total", 0)
                    + w[names["decode"]].get("local_prefills_total", 0) > 0):  # fmt: skip
                break
        else:
            raise AssertionError(f"requests never reached the joined workers: {workers()}")

        # 2. kill -9 of decode-0 mid-stream: its streams move to the joined decode worker
        kill_decode_mid_stream(http, up, workers, names["decode"])

        # 2b. kill -9 of the joined prefill worker: out of routing and the listing
        new_prefill.proc.send_signal(signal.SIGKILL)
        new_prefill.proc.wait(10)
        wait(lambda: names["prefill"] not in workers(), 15, "the killed worker leaving")
        for q in QUESTIONS[:2]:
            ask(http, q, system="[after kill] " + SYSTEM)

        # 3. SIGTERM of the joined decode worker while it streams (long enough to outlast
        # the drain's notice, which takes a heartbeat, and the request sent during it)
        results: dict[str, int] = {}
        length = LONG_STREAM_TOKENS

        def stream(tag: str) -> None:
            body = {"model": "default", "messages": chat("Tell me about the library.",
                    f"[{tag}] " + SYSTEM), "max_tokens": length, "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for text in r.iter_lines():
                    assert '"error"' not in text, text
                    if '"usage":{' in text:
                        results[tag] = int(text.split('"completion_tokens":')[1].split(",")[0])

        streams = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(2)]
        for t in streams:
            t.start()
        wait(lambda: workers()[names["decode"]].get("live_requests", 0) > 0, 60,
             "a stream on the joined decode worker")  # fmt: skip
        new_decode.proc.send_signal(signal.SIGTERM)
        wait(lambda: workers()[names["decode"]].get("draining"), 5, "the gateway to see it drain")
        draining = workers()[names["decode"]]
        assert draining["draining"] and draining["live_requests"] > 0, draining  # mid-stream
        # its engine thread sends the tokens on its token endpoint, through the drain too
        assert draining["token_endpoint_messages_total"] > 0, draining
        ask(http, QUESTIONS[3], system="[during drain] " + SYSTEM)  # goes to decode-0
        for t in streams:
            t.join(120)
        assert results == {"s0": length, "s1": length}
        assert new_decode.proc.wait(60) == 0, "".join(new_decode.lines)
        wait(lambda: names["decode"] not in workers(), 15, "the drained worker leaving")

        # 4. the discovery source dies: serving goes on with the known members
        kvstore = service_pid(up.proc.pid, "kvstore")
        os.kill(kvstore, signal.SIGKILL)
        for q in QUESTIONS[4:6]:
            ask(http, q)
        w = workers()
        assert w["decode-0"]["up"] and w["prefill-0"]["up"]
        wait(lambda: workers().get("kvstore", {}).get("up") and all(
            workers()[n]["up"] for n in ("decode-0", "prefill-0")), 60, "the kvstore back")  # fmt: skip
        ask(http, QUESTIONS[6])
        wait(lambda: holds_nothing(http.get("/debug/cache").json()), 30, "nothing held")

        # 5. SIGTERM stops everything radixserve up started
        children = list(descendants(up.proc.pid))
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert "cluster stopped" in "".join(up.lines)
        assert all(gone(pid) for pid in children)
    finally:
        http.close()
        for proc in [*joined, up]:
            proc.stop()
