"""A service's HTTP side (`ProbeServer`), its client (`probe`, ``radixserve probe``) and
``radixserve stop`` (the pre-stop hook), over real sockets and processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.protocol.link_messages import WorkerLoad
from radixserve.protocol.stats_messages import EngineSection, ServiceStats
from radixserve.runtime.probe import ProbeServer, probe
from radixserve.worker_metrics import service_metrics

RADIXSERVE = str(Path(sys.executable).with_name("radixserve"))


class Serving:
    """A `ProbeServer` on its own loop thread, whose health the test flips."""

    def __init__(self) -> None:
        self.ok = False
        self.loop = asyncio.new_event_loop()
        self.server = ProbeServer("127.0.0.1", 0, self._health, self._metrics)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        return self.ok, {"draining": not self.ok}

    def _metrics(self) -> bytes:
        stats = ServiceStats(engine=EngineSection(pages_used=3, kv_events_dropped_total=9))
        return service_metrics("prefill-7000", "prefill", WorkerLoad(), stats)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def serving() -> Iterator[Serving]:
    s = Serving()
    yield s
    s.close()


def raw(port: int, request: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_endpoints_answer_as_probes_expect(serving: Serving) -> None:
    url = serving.server.url
    assert probe(f"{url}/live", 5) == (True, f"{url}/live: 200")
    ok, account = probe(f"{url}/health", 5)
    assert not ok and account.startswith(f"{url}/health: 503") and '"draining": true' in account
    serving.ok = True
    assert probe(f"{url}/health", 5)[0]
    body = raw(serving.server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, text = body.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/plain; version=0.0.4" in head
    samples = {
        (s.name, s.labels["worker"], s.labels["role"]): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    assert samples[("radixserve_worker_pages_used", "prefill-7000", "prefill")] == 3
    assert samples[("radixserve_worker_kv_events_dropped_total", "prefill-7000", "prefill")] == 9
    assert samples[("radixserve_worker_up", "prefill-7000", "prefill")] == 1
    assert raw(serving.server.port, b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert raw(serving.server.port, b"POST /health HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert raw(serving.server.port, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_radixserve_probe_exits_by_the_answer(serving: Serving) -> None:
    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([RADIXSERVE, "probe", *args], capture_output=True, text=True,
                              timeout=60, env=env)  # fmt: skip

    health = f"{serving.server.url}/health"
    down = run(health)
    assert down.returncode == 1 and "503" in down.stderr
    serving.ok = True
    assert run(health).returncode == 0
    by_setting = run(env={"RADIXSERVE_PROBE_URL": health, "PATH": "/usr/bin:/bin"})
    assert by_setting.returncode == 0, by_setting.stderr
    refused = run("http://127.0.0.1:9/health", "--timeout-s", "2")
    assert refused.returncode == 1 and "refused" in refused.stderr.lower()
    assert run("file:///etc/passwd").returncode == 1


def test_radixserve_stop_waits_for_the_drain() -> None:
    """The pre-stop hook sends SIGTERM and returns once the process has exited: here a
    process that takes 1 s to "drain" after SIGTERM."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        reaper = threading.Thread(target=child.wait)  # a zombie would still "exist"
        reaper.start()
        start = time.monotonic()
        done = subprocess.run([RADIXSERVE, "stop", "--pid", str(child.pid), "--timeout-s", "20"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - start >= 1.0  # it waited for the exit
        reaper.join(10)
        assert child.returncode == 0
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait(10)


def test_radixserve_stop_gives_up_at_its_timeout() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', "
                              "flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        done = subprocess.run([RADIXSERVE, "stop", "--pid", str(child.pid), "--timeout-s", "1"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 1 and "still running after 1 s" in done.stderr
        bad = subprocess.run([RADIXSERVE, "stop", "--after-s", "-1"], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert bad.returncode == 1 and "--after-s must be 0 or more" in bad.stderr
    finally:
        child.kill()
        child.wait(10)
