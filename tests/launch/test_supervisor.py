"""The process supervisor, with real child processes (tiny `python -c` scripts)."""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from radixserve.launch import supervisor as supervisor_mod
from radixserve.launch.stderr_tail import last_error
from radixserve.launch.supervisor import ProcessSpec, Supervisor, SupervisorError

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
SLEEP_FOREVER = "import time\nwhile True: time.sleep(1)"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _sleeper(ready_file: Path | None = None, ignore_sigterm: bool = False) -> list[str]:
    """A child that sleeps forever; it writes its pid to `ready_file` once set up."""
    lines = ["import os, signal, time"]
    if ignore_sigterm:
        lines.append("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    if ready_file is not None:  # whole or not at all: the test reads it once it exists
        tmp = f"{ready_file}.tmp"
        lines.append(f"open({tmp!r}, 'w').write(str(os.getpid())); "
                     f"os.replace({tmp!r}, {str(ready_file)!r})")  # fmt: skip
    lines.append("while True: time.sleep(1)")
    return _python("\n".join(lines))


def _gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, or a zombie that some reaper still owes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_until(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return cond()


def _poll_for(sup: Supervisor, duration_s: float) -> None:
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        sup.poll()
        time.sleep(0.01)


def _restart_delays(caplog: pytest.LogCaptureFixture, name: str) -> list[float]:
    pattern = re.compile(rf"^{re.escape(name)} exited with .*; restarting in ([0-9.e+-]+)s")
    return [float(m[1]) for r in caplog.records if (m := pattern.match(r.getMessage()))]


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Supervisors a test appends here are stopped at teardown, whatever happened."""
    made: list[Supervisor] = []
    yield made
    for sup in made:
        sup.stop()


def test_start_pid_alive_stop(supervisors: list[Supervisor]) -> None:
    sup = Supervisor([ProcessSpec("a", _python(SLEEP_FOREVER)), ProcessSpec("b", _sleeper())])
    supervisors.append(sup)
    sup.start()
    pids = {name: sup.pid(name) for name in ("a", "b")}
    assert all(isinstance(p, int) for p in pids.values()) and len(set(pids.values())) == 2
    assert sup.alive("a") and sup.alive("b")
    assert sup.restarts == {"a": 0, "b": 0}

    sup.stop()
    for pid in pids.values():
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ChildProcessError):  # already reaped: no zombie left
            os.waitpid(pid, os.WNOHANG)
    assert not sup.alive("a") and sup.pid("b") is None
    sup.stop()  # idempotent
    sup.poll()  # a stopped supervisor restarts nothing
    assert sup.pid("a") is None
    with pytest.raises(KeyError, match="nope"):
        sup.pid("nope")


def test_env_is_merged_over_os_environ(supervisors: list[Supervisor], tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['RS_X'] + os.environ['PATH'])"
    sup = Supervisor([ProcessSpec("e", _python(code), env={"RS_X": "hello"}, restart=False)])
    supervisors.append(sup)
    sup.start()
    assert _wait_until(lambda: out.exists() and out.read_text() != "", 10)
    assert out.read_text() == "hello" + os.environ["PATH"]


def test_killed_child_is_restarted_after_backoff(
    supervisors: list[Supervisor], tmp_path: Path
) -> None:
    ready = tmp_path / "a.pid"
    sup = Supervisor(
        [ProcessSpec("a", _sleeper(ready)), ProcessSpec("once", _sleeper(), restart=False)],
        restart_backoff_s=0.3,
    )
    supervisors.append(sup)
    sup.start()
    old_a, old_once = sup.pid("a"), sup.pid("once")
    assert old_a is not None and old_once is not None
    assert _wait_until(ready.exists, 10)
    ready.unlink()

    killed_at = time.monotonic()
    os.kill(old_a, signal.SIGKILL)
    os.kill(old_once, signal.SIGKILL)
    while sup.pid("a") in (old_a, None) and time.monotonic() - killed_at < 10:
        sup.poll()
        time.sleep(0.01)
    assert time.monotonic() - killed_at >= 0.3  # waited for the backoff
    new_a = sup.pid("a")
    assert new_a is not None and new_a != old_a
    assert _wait_until(ready.exists, 10) and int(ready.read_text()) == new_a
    assert sup.restarts == {"a": 1, "once": 0}

    _poll_for(sup, 0.5)
    assert not sup.alive("once") and sup.pid("once") is None
    assert sup.restarts["once"] == 0
    assert _gone(old_a) and _gone(old_once)


def test_crash_loop_backs_off(
    supervisors: list[Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.launch.supervisor")
    sup = Supervisor(
        [ProcessSpec("crashy", _python("import sys; sys.exit(3)"))],
        restart_backoff_s=0.05,
        max_backoff_s=0.4,
    )
    supervisors.append(sup)
    sup.start()
    _poll_for(sup, 3.0)

    # Without backoff this would be dozens; doubling from 0.05 s capped at 0.4 s allows
    # at most ~10 in 3 s, and slow child start-up only lowers the count.
    assert 3 <= sup.restarts["crashy"] <= 12
    assert "crashy exited with code 3; restarting in 0.05s (restart #1)" in caplog.messages
    delays = _restart_delays(caplog, "crashy")
    assert len(delays) >= 3 and delays == [0.05, 0.1, 0.2, *[0.4] * (len(delays) - 3)]


def test_backoff_resets_after_a_long_life(
    supervisors: list[Supervisor],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(supervisor_mod, "_STABLE_AFTER_S", 0.2)  # "long" = 0.2 s here
    caplog.set_level(logging.INFO, logger="radixserve.launch.supervisor")
    sup = Supervisor(
        [ProcessSpec("slow", _python("import sys, time; time.sleep(0.4); sys.exit(3)"))],
        restart_backoff_s=0.05,
    )
    supervisors.append(sup)
    sup.start()
    _poll_for(sup, 1.8)
    delays = _restart_delays(caplog, "slow")
    assert len(delays) >= 2 and set(delays) == {0.05}


def test_child_ignoring_sigterm_is_killed(
    supervisors: list[Supervisor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.launch.supervisor")
    ready = tmp_path / "stubborn.pid"
    sup = Supervisor(
        [ProcessSpec("stubborn", _sleeper(ready, ignore_sigterm=True))], stop_timeout_s=0.5
    )
    supervisors.append(sup)
    sup.start()
    pid = sup.pid("stubborn")
    assert pid is not None and _wait_until(ready.exists, 10)

    started = time.monotonic()
    sup.stop()
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5
    assert any("sending SIGKILL" in m for m in caplog.messages)
    assert "stubborn stopped (code -9 (signal SIGKILL))" in caplog.messages
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_executable_names_the_process(supervisors: list[Supervisor]) -> None:
    sup = Supervisor(
        [
            ProcessSpec("first", _python(SLEEP_FOREVER)),
            ProcessSpec("ghost", ["/nonexistent/radixserve-no-such-binary"]),
        ]
    )
    supervisors.append(sup)
    with pytest.raises(SupervisorError, match="ghost.*radixserve-no-such-binary"):
        sup.start()
    assert sup.pid("first") is None  # what had started was stopped again


def test_invalid_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor([ProcessSpec("a", ["x"]), ProcessSpec("a", ["y"])])
    with pytest.raises(ValueError, match="argv"):
        Supervisor([ProcessSpec("a", [])])


# ---- run() in a driver process -------------------------------------------------------

DRIVER = textwrap.dedent(
    """
    import logging, sys
    from radixserve.launch.supervisor import ProcessSpec, Supervisor
    from radixserve.launch.warm import WarmServer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # "warm": the children forked by a warm-start server (sleepers without a report)
    warm = WarmServer(["tests.launch.warm_child"]) if sys.argv[1:] == ["warm"] else None
    child = ([sys.executable, "-m", "tests.launch.warm_child"] if warm else
             [sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"])
    specs = [ProcessSpec("a", child), ProcessSpec("b", child)]
    sup = Supervisor(specs, stop_timeout_s=5, warm=warm)
    calls = []

    def on_ready():
        calls.append(1)
        print(sup.pid("a"), sup.pid("b"), len(calls), flush=True)

    sys.exit(sup.run(ready=lambda: True, on_ready=on_ready))
    """
)


@pytest.fixture
def driver() -> Iterator[Callable[[bool], tuple[subprocess.Popen[str], list[int]]]]:
    """Starts the driver; returns it and its children's pids. Teardown kills leftovers."""
    started: list[tuple[subprocess.Popen[str], list[int]]] = []

    def launch(warm: bool) -> tuple[subprocess.Popen[str], list[int]]:
        proc = subprocess.Popen(
            _python(DRIVER) + (["warm"] if warm else []),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append((proc, []))
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 20)
        assert readable, "driver printed no pids"
        line = proc.stdout.readline().split()
        assert len(line) == 3 and line[2] == "1", line
        pids = [int(line[0]), int(line[1])]
        started[-1][1].extend(pids)
        return proc, pids

    yield launch
    for proc, pids in started:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # first: leftover children hold the driver's pipes open
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=10)


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_run_stops_children_on_signal(driver, sig: signal.Signals, code: int, warm: bool) -> None:
    proc, pids = driver(warm)
    assert all(not _gone(pid) for pid in pids)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == code, stderr
    assert "shutting down" in stderr
    assert all(_gone(pid) for pid in pids)


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_children_die_with_a_killed_supervisor(driver, warm: bool) -> None:
    assert sys.platform == "linux"  # PR_SET_PDEATHSIG is Linux-only
    proc, pids = driver(warm)
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_until(lambda: all(_gone(pid) for pid in pids), 3), "children outlived it"


# ---- fail fast: the same error twice before ready stops run() ------------------------

BOGUS = "import sys; sys.stderr.write('starting\\n'); raise ValueError('RS_MODE=bogus is refused')"


def _stop_when(cond: Callable[[], bool]) -> Callable[[], None]:
    """An `on_poll` that SIGTERMs this process (run() then returns 0) once ``cond()``."""

    def on_poll() -> None:
        if cond():
            os.kill(os.getpid(), signal.SIGTERM)

    return on_poll


def test_the_same_error_twice_before_ready_stops_run(
    supervisors: list[Supervisor], capfd: pytest.CaptureFixture[str]
) -> None:
    sup = Supervisor([ProcessSpec("good", _sleeper()), ProcessSpec("bad", _python(BOGUS))],
                     restart_backoff_s=0.05)  # fmt: skip
    supervisors.append(sup)
    assert sup.run(ready=lambda: False) == 1
    assert sup.failure == ("bad exited with code 1 twice before the cluster was ready: "
                           "ValueError: RS_MODE=bogus is refused")  # fmt: skip
    assert sup.restarts == {"good": 0, "bad": 1}  # not restarted a second time
    assert sup.pid("good") is None  # run() stopped everything
    # the children's stderr still reaches the supervisor's, line by line
    assert capfd.readouterr().err.count("ValueError: RS_MODE=bogus is refused\n") == 2


def test_different_errors_before_ready_are_restarted(
    supervisors: list[Supervisor], tmp_path: Path
) -> None:
    """Each exit says something else (a count kept in a file): no error repeats, so the
    child is restarted as ever."""
    count = tmp_path / "count"
    code = (f"from pathlib import Path; p = Path({str(count)!r}); "
            "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
            "raise SystemExit(f'attempt {n} failed')")  # fmt: skip
    sup = Supervisor([ProcessSpec("flaky", _python(code))], restart_backoff_s=0.05,
                     max_backoff_s=0.05)  # fmt: skip
    supervisors.append(sup)
    on_poll = _stop_when(lambda: sup.restarts["flaky"] >= 3)
    assert sup.run(ready=lambda: False, on_poll=on_poll) == 0
    assert sup.failure is None and sup.restarts["flaky"] >= 3


def test_after_ready_the_same_error_is_restarted(supervisors: list[Supervisor]) -> None:
    sup = Supervisor([ProcessSpec("bad", _python(BOGUS))], restart_backoff_s=0.05,
                     max_backoff_s=0.05)  # fmt: skip
    supervisors.append(sup)
    on_poll = _stop_when(lambda: sup.restarts["bad"] >= 3)
    assert sup.run(ready=lambda: True, on_poll=on_poll) == 0
    assert sup.failure is None and sup.restarts["bad"] >= 3


def test_a_poll_loop_without_run_never_fails_fast(supervisors: list[Supervisor]) -> None:
    """Callers that drive `poll()` themselves (the test clusters) restart as ever."""
    sup = Supervisor([ProcessSpec("bad", _python(BOGUS))], restart_backoff_s=0.05,
                     max_backoff_s=0.05)  # fmt: skip
    supervisors.append(sup)
    sup.start()
    assert _wait_until(lambda: (sup.poll(), sup.restarts["bad"] >= 3)[1], 20)
    assert sup.failure is None


def test_last_error_is_the_exception_else_the_last_line() -> None:
    traceback_lines = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                       "    main()", "    ^^^^^^", "pydantic_core.ValidationError: 1 error",
                       "exporter_otlp_protocol", "  Value error, OTEL_X=bogus"]  # fmt: skip
    assert last_error(["noise", *traceback_lines, ""]) == "\n".join(traceback_lines[4:])
    assert (
        last_error(["2026-01-02 03:04:05,678 ERROR svc: cannot bind", ""])
        == "ERROR svc: cannot bind"
    )
    assert last_error([]) == ""
