"""Warm starts (`radixserve.launch.warm`): children forked from a server that imported
their module, with real processes; and the supervisor running its children that way."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.launch.supervisor import ProcessSpec, Supervisor
from radixserve.launch.warm import WarmServer
from tests.cluster.cluster_helpers import gone

pytestmark = pytest.mark.timeout(60)

MODULE = "tests.launch.warm_child"
ARGV = [sys.executable, "-m", MODULE]


@pytest.fixture
def server() -> Iterator[WarmServer]:
    warm = WarmServer([MODULE])
    yield warm
    warm.close()


def _wait_for(path: Path, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_warm_child_is_the_module_run_with_exactly_its_env(server, tmp_path) -> None:
    report = tmp_path / "report.json"
    env = {"WARM_CHILD_REPORT": str(report), "WARM_CHILD_EXIT": "3", "ONLY_HERE": "1"}
    child = server.spawn(MODULE, env, ARGV)
    assert child.wait(20) == 3 and child.poll() == 3
    state = _wait_for(report)
    assert state["pid"] == child.pid
    assert state["imported_in"] != child.pid  # forked after the import: nothing imported again
    assert state["env"] == env  # the server's own environment does not leak in
    assert state["argv"][0].endswith("warm_child/__main__.py") and state["argv"][1:] == []
    assert state["stdin"] == ""  # /dev/null


def test_the_command_line_and_session_are_the_child_own(server, tmp_path) -> None:
    report = tmp_path / "report.json"
    child = server.spawn(MODULE, {"WARM_CHILD_REPORT": str(report)}, ARGV)
    _wait_for(report)
    cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert [a.decode() for a in cmdline] == ARGV  # what ps shows
    assert os.getsid(child.pid) == child.pid  # its own session, as start_new_session gives
    child.terminate()
    assert child.wait(10) == -signal.SIGTERM
    child.kill()  # after its exit (reaped, the pid free for reuse): nothing is signalled
    assert child.poll() == -signal.SIGTERM


def test_only_the_server_modules_run(server) -> None:
    with pytest.raises(ValueError, match="not one of the warm server's modules"):
        server.spawn("json", {}, [sys.executable, "-m", "json"])


def test_a_dead_server_takes_its_children_and_the_next_spawn_starts_another(
    server, tmp_path
) -> None:
    report = tmp_path / "report.json"
    child = server.spawn(MODULE, {"WARM_CHILD_REPORT": str(report)}, ARGV)
    _wait_for(report)
    assert server._proc is not None
    os.kill(server._proc.pid, signal.SIGKILL)
    assert child.wait(10) < 0
    deadline = time.monotonic() + 5
    while not gone(child.pid):
        assert time.monotonic() < deadline, "the child outlived its server"
        time.sleep(0.02)
    again = server.spawn(MODULE, {"WARM_CHILD_EXIT": "0"}, ARGV)
    assert again.wait(20) == 0


def test_the_supervisor_restarts_a_killed_warm_child_warm(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.launch.supervisor")
    report = tmp_path / "report.json"
    spec = ProcessSpec("child", ARGV, {"WARM_CHILD_REPORT": str(report)})
    sup = Supervisor([spec], restart_backoff_s=0.1, warm=WarmServer([MODULE]))
    try:
        sup.start()
        first = _wait_for(report)["pid"]
        assert sup.pid("child") == first
        report.unlink()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not report.exists():
            sup.poll()
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.02)
        second = _wait_for(report)
        assert second["pid"] != first and second["imported_in"] != second["pid"]
        assert "child exited with code -9 (signal SIGKILL)" in " ".join(caplog.messages)
        assert sum(", warm)" in m for m in caplog.messages) == 2
        server = sup._warm._proc.pid  # type: ignore[union-attr]
    finally:
        sup.stop()
    assert gone(second["pid"]) and gone(server)  # stop() ends the server too


def test_a_request_too_large_to_send_is_refused_and_the_others_run_on(server, tmp_path) -> None:
    """An environment larger than one request may carry is an error for that child only
    (the supervisor then starts it afresh); the server and its children live on."""
    report = tmp_path / "report.json"
    running = server.spawn(MODULE, {"WARM_CHILD_REPORT": str(report)}, ARGV)
    _wait_for(report)
    with pytest.raises(OSError, match="too large"):
        server.spawn(MODULE, {"BIG": "x" * (4 << 20)}, ARGV)
    assert running.poll() is None
    again = server.spawn(MODULE, {"WARM_CHILD_EXIT": "0"}, ARGV)
    assert again.wait(20) == 0 and running.poll() is None
    running.kill()
    assert running.wait(20) == -signal.SIGKILL


def test_a_warm_child_failing_twice_before_ready_stops_run(capfd, caplog) -> None:
    """The fail fast of `Supervisor.run` on warm children: their stderr (a traceback
    printed in the forked child) reaches the supervisor through the descriptor the
    server hands each child."""
    caplog.set_level(logging.INFO, logger="radixserve.launch.supervisor")
    spec = ProcessSpec("child", ARGV, {"WARM_CHILD_RAISE": "RS_MODE=bogus is refused"})
    sup = Supervisor([spec], restart_backoff_s=0.05, warm=WarmServer([MODULE]))
    try:
        assert sup.run(ready=lambda: False) == 1
    finally:
        sup.stop()
    assert sup.failure == ("child exited with code 1 twice before the cluster was ready: "
                           "ValueError: RS_MODE=bogus is refused")  # fmt: skip
    assert sum(", warm)" in m for m in caplog.messages) == 2  # both forked, not fresh
    err = capfd.readouterr().err
    assert err.count("ValueError: RS_MODE=bogus is refused\n") == 2, err
