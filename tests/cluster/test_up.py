"""`radixserve up` as a user runs it: prints the URL once the cluster serves, answers
requests, restarts a worker killed after that, and a Ctrl-C (SIGINT) stops every
process it started. Here without the kvstore, so the workers are wired by static
address lists; `test_membership` runs it with the kvstore (membership, joins) and
stops it with SIGTERM. A service that fails the same way twice before the cluster is
ready stops `up` with its error (fail fast)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from radixserve.engine.cores import board_path
from tests.cluster.cluster_helpers import descendants, gone, service_pid


def test_up_without_kvstore_serves_then_ctrl_c_stops_everything():
    stop_signal = signal.SIGINT
    env = {**os.environ, "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1"}
    cmd = [sys.executable, "-m", "radixserve.cli", "up", "--port", "0", "--transport",
           "zmq", "--no-kvstore"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    children: list[int] = []
    try:
        lines = []
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "cluster up" in line:
                break
        # --port 0: any free port, bound by the supervisor and printed
        [up] = [line for line in lines if "cluster up" in line] or ["".join(lines)]
        assert "OpenAI API at http://127.0.0.1:" in up, "".join(lines)
        port = int(up.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
        processes = descendants(proc.pid)
        children = list(processes)
        # the gateway, and the workers forked by the warm-start server (four processes)
        services = sorted(m for cmd in processes.values() for m in ("gateway", "prefill", "decode")
                          if f"-m radixserve.services.{m}" in cmd)  # fmt: skip
        assert services == ["decode", "gateway", "prefill"], processes
        assert sum("radixserve.launch.warm" in cmd for cmd in processes.values()) == 1, processes
        assert len(processes) == 4, processes
        assert not any("add a worker" in line for line in lines)  # nothing to join
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        # the workers share the cores through the cluster's core board
        board = board_path(tempfile.gettempdir(), f"{proc.pid}-{port}")
        assert os.path.getsize(board) > 0
        # a crash after readiness is restarted, not failed fast (even one that repeats)
        for _ in range(2):
            killed = service_pid(proc.pid, "decode")
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not _restarted(proc.pid, "decode", killed):
                assert proc.poll() is None, proc.communicate(timeout=30)[0]
                assert time.monotonic() < deadline, "the decode worker was not restarted"
                time.sleep(0.2)
            children += list(descendants(proc.pid))
            while True:  # 503 "try again shortly" until the new worker's link is up
                resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                  timeout=120)  # fmt: skip
                if resp.status_code != 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert resp.status_code == 200, resp.text
        proc.send_signal(stop_signal)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, rest
        assert "cluster stopped" in rest
        assert all(gone(pid) for pid in children)
        assert not os.path.exists(board)  # removed at stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def _restarted(up_pid: int, service: str, old: int) -> bool:
    """Whether a new process of ``service`` runs below ``up_pid`` in place of ``old``."""
    try:
        return service_pid(up_pid, service) != old
    except ValueError:  # none yet (or the old one still listed)
        return False


def test_up_fails_fast_when_a_service_fails_the_same_way_twice():
    """A setting every worker and the gateway refuse at start (an OTLP protocol not
    spoken) stops `up` with that error and a non-zero exit, instead of restarting them
    forever."""
    env = {**os.environ, "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "bogus"}  # fmt: skip
    cmd = [sys.executable, "-m", "radixserve.cli", "up", "--port", "0"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    children: list[int] = []
    try:
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            children = list(descendants(proc.pid))
            raise
        elapsed_s = time.monotonic() - started
        print(f"radixserve up failed fast after {elapsed_s:.1f} s")
        assert proc.returncode == 1, out
        [failure] = [line for line in out.splitlines() if line.startswith("radixserve: ")
                     and "twice before the cluster was ready" in line]  # fmt: skip
        assert "exited with code 1" in failure, out
        assert "ValueError: OTEL_EXPORTER_OTLP_PROTOCOL=bogus is not supported" in failure, out
        assert "cluster up" not in out and "cluster stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in children:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
