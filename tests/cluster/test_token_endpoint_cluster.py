"""The decode worker's token endpoint with real processes: the cluster of `radixserve up`
and a second gateway started beside it on the same kvstore (as a second replica is).

1. Both gateways stream greedy answers at once: each is the single-process engine's
   answer, and the decode worker's engine thread sent them on its token endpoint (its
   counter grew by every chunk but the last of each, none fell back to the control
   socket).
2. `kill -9` of the second gateway mid-stream: the decode worker ends that request once
   the gateway is silent past its peer timeout, and holds nothing; the first gateway
   serves on.

Every process serves the tiny model (`tiny_model`): the subject is the machinery.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.cluster.cluster_helpers import FAST_LIVENESS, TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 24


def stream_text(url: str, messages: list[dict[str, str]], max_tokens: int, **extra) -> str:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **extra}  # fmt: skip
    parts = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            assert '"error"' not in line, line
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


def second_gateway(cluster: TestCluster, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A gateway process on the cluster's kvstore, on a socket this test bound for it; its
    output goes to ``log``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.set_inheritable(True)
    assert cluster.processes.kvstore is not None
    env = {**os.environ, "RADIXSERVE_MODEL": model, "RADIXSERVE_DEVICE": "cpu",
           "RADIXSERVE_GATEWAY_KVSTORE": cluster.processes.kvstore,
           "RADIXSERVE_GATEWAY_LISTEN_FD": str(listener.fileno()),
           **{f"RADIXSERVE_GATEWAY_{k}": v for k, v in FAST_LIVENESS.items()}}  # fmt: skip
    try:
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "gateway"],
                                    env=env, pass_fds=(listener.fileno(),), stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        listener.close()  # the gateway holds it now
    return proc, f"http://127.0.0.1:{port}"


def decode_up_at(url: str) -> bool:
    try:
        workers = httpx.get(f"{url}/debug/cache", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return any(w["role"] == "decode" and w["up"] for w in workers.values())


def test_two_gateways_get_tokens_on_the_endpoint_and_a_killed_one_leaves_nothing_held(
    tiny_model: str, tiny_reference_chat, tmp_path: Path
):
    cluster = TestCluster(model=tiny_model)
    proc = None
    log = tmp_path / "gateway-2.log"
    try:
        proc, url2 = second_gateway(cluster, tiny_model, log)

        def serving() -> bool:
            assert proc.poll() is None, f"the second gateway exited:\n{log.read_text()}"
            return decode_up_at(url2)

        cluster.wait(serving, 120, "the second gateway with the decode worker up")
        stream_text(url2, chat(QUESTIONS[0], "[warm] " + SYSTEM), 2)  # its links are in use
        [name] = [n for n, w in cluster.workers().items() if w["role"] == "decode"]
        before = cluster.settled((name,))[name]

        # 1. greedy streams through both gateways at once
        asks = [(url, chat(q, f"[{i}] " + SYSTEM)) for i, (url, q) in
                enumerate([(cluster.url, QUESTIONS[1]), (url2, QUESTIONS[2]),
                           (cluster.url, QUESTIONS[3]), (url2, QUESTIONS[1])])]  # fmt: skip
        with ThreadPoolExecutor(len(asks)) as pool:
            texts = list(pool.map(lambda a: stream_text(a[0], a[1], MAX_TOKENS), asks))
        for (_, messages), text in zip(asks, texts):
            assert text == tiny_reference_chat(messages, MAX_TOKENS)
        after = cluster.settled((name,))[name]
        sent = after["token_endpoint_messages_total"] - before["token_endpoint_messages_total"]
        assert sent >= len(asks) * (MAX_TOKENS - 1), (before, after)
        assert after["token_fallbacks_total"] == before["token_fallbacks_total"], after

        # 2. kill -9 of the second gateway mid-stream
        long_stream = threading.Thread(
            target=lambda: _ignore_errors(stream_text, url2, chat(QUESTIONS[0], SYSTEM), 4000,
                                          ignore_eos=True),
            daemon=True,
        )  # fmt: skip
        long_stream.start()
        cluster.wait(lambda: cluster.worker(name).get("live_requests", 0) > 0, 60,
                     "the long stream running on the decode worker")  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        cluster.wait_clean()  # its request ended and every page is back
        assert time.monotonic() - killed_at < 30
        long_stream.join(30)
        assert not long_stream.is_alive()
        answer = cluster.ask(chat(QUESTIONS[2], "[after] " + SYSTEM), MAX_TOKENS)
        text = answer["choices"][0]["message"]["content"]
        assert text == tiny_reference_chat(chat(QUESTIONS[2], "[after] " + SYSTEM), MAX_TOKENS)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        cluster.stop()


def _ignore_errors(fn, *args, **kwargs) -> None:
    """Run a stream whose gateway the test kills: its end is not the subject."""
    with contextlib.suppress(httpx.HTTPError, AssertionError):
        fn(*args, **kwargs)
