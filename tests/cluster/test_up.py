"""`radixserve up` as a user runs it: prints the URL once the cluster serves, answers
requests, and a Ctrl-C (SIGINT) stops every process it started. Here without the
kvstore, so the workers are wired by static address lists; `test_membership` runs it
with the kvstore (membership, joins) and stops it with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from radixserve.engine.cores import board_path
from tests.cluster.cluster_helpers import descendants, gone


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
