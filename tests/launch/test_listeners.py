"""Listening sockets bound by the supervisor and inherited by its processes: every
service gets a port of its own however many start at once, keeps it across its
restarts, and a port in use is refused by address before anything starts."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from radixserve.cli import main
from radixserve.launch.cluster import ClusterConfig, ClusterSockets, cluster_specs
from radixserve.launch.listeners import Listener
from radixserve.launch.supervisor import ProcessSpec, Supervisor
from radixserve.launch.warm import WarmServer, available

pytestmark = pytest.mark.timeout(120)

CHILD = "tests.launch.listen_child"
#: the services of a cluster of 2 prefill and 2 decode workers with the autoscaler
NAMES = ("kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "gateway", "autoscaler")


def _spec(name: str) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-m", CHILD], {"LISTEN_CHILD_NAME": name},
                       sockets={"LISTEN_CHILD_FD": Listener()})  # fmt: skip


def _port(spec: ProcessSpec) -> int:
    return spec.sockets["LISTEN_CHILD_FD"].port


def _ask(port: int) -> str | None:
    """The line the service on ``port`` answers, None while nothing accepts there."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            return conn.makefile().readline().strip() or None
    except OSError:
        return None


def _wait(supervisors: list[Supervisor], condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for sup in supervisors:
            sup.poll()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def _port_grabber() -> Iterator[list[int]]:
    """Another program on the machine taking any free port it is given, over and over
    (what takes a port probed and handed on before its service binds it); the ports it
    got."""
    got: list[int] = []
    stop = threading.Event()

    def grab() -> None:
        while not stop.is_set():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                sock.listen()
                got.append(sock.getsockname()[1])
                time.sleep(0.001)

    thread = threading.Thread(target=grab, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        stop.set()
        thread.join()


def _answers(ports: dict[str, int]) -> dict[str, str]:
    return {name: answer for name, port in ports.items() if (answer := _ask(port))}


def _start_and_check(supervisors: list[Supervisor], grabbed: list[int]) -> None:
    """Start ``supervisors`` together; every service answers on its own port, and one
    killed in each comes back on its port."""
    specs = {name: sup.spec(name) for sup in supervisors for name in sup.names()}
    ports = {name: _port(spec) for name, spec in specs.items()}
    for sup in supervisors:
        sup.start()
    answers: dict[str, str] = {}

    def all_answered() -> bool:
        answers.update(_answers(ports))
        return len(answers) == len(ports)

    _wait(supervisors, all_answered, 60, "every service to answer")
    assert len(set(ports.values())) == len(ports) == len(supervisors) * len(NAMES)
    assert {n: a.split()[0] for n, a in answers.items()} == {n: n for n in ports}
    assert not set(ports.values()) & set(grabbed)  # none taken by the other program
    assert all(n == 0 for sup in supervisors for n in sup.restarts.values())
    killed = [f"{c}/kvstore" for c in range(len(supervisors))]
    for sup, name in zip(supervisors, killed):
        pid = sup.pid(name)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    for sup, name in zip(supervisors, killed):  # restarted, on the same port
        _wait([sup], lambda s=sup, n=name: s.restarts[n] == 1 and s.alive(n), 30, "a restart")
        again = _ask(ports[name])
        assert again is not None and again.split()[0] == name and again != answers[name]


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_services_started_at_once_each_serve_on_their_own_port_and_keep_it(warm, capfd):
    """Three clusters' worth of services started together while another program takes
    free ports (tests/cluster/test_listeners_cluster.py, a benchmark, starts whole
    clusters twenty times): each answers on its own port (no two share one,
    none is taken), none crashes; a service killed comes back on the same port; once
    the supervisor stops, its ports are closed."""
    if warm and not available():
        pytest.skip("warm starts are Linux only")
    with _port_grabber() as grabbed:
        supervisors = [Supervisor([_spec(f"{c}/{n}") for n in NAMES], restart_backoff_s=0.1,
                                  warm=WarmServer((CHILD,)) if warm else None)
                       for c in range(3)]  # fmt: skip
        listeners = [sup.spec(n).sockets["LISTEN_CHILD_FD"] for sup in supervisors
                     for n in sup.names()]  # fmt: skip
        try:
            _start_and_check(supervisors, grabbed)
        finally:
            for sup in supervisors:
                sup.stop()
    assert all(_ask(listener.port) is None for listener in listeners)  # closed
    with pytest.raises(OSError, match="is closed"):
        listeners[0].fileno()
    out = capfd.readouterr()
    assert "already in use" not in out.out + out.err


def test_a_listener_on_port_0_holds_its_port_until_closed():
    """Bound at once: no other socket can bind its port meanwhile; until its service
    listens, a connection to it is refused (as to a service not started yet)."""
    listeners = [Listener() for _ in range(50)]
    ports = {listener.port for listener in listeners}
    assert len(ports) == 50 and 0 not in ports
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", listeners[0].port))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", listeners[0].port), timeout=2).close()
    for listener in listeners:
        listener.close()


def test_a_given_port_in_use_is_refused_by_address_before_anything_starts(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sockets = ClusterSockets.of(ClusterConfig(port=port))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            sockets.bind()
        assert main(["up", "--port", str(port), "--no-kvstore"]) == 1
        assert f"error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_services_own_port_in_use_is_refused_by_address_and_setting(capsys, monkeypatch):
    """``radixserve kvstore`` on a port another socket holds: a one-line error naming the
    address, the reason and the setting that moves it, exit 2 (no traceback)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("RADIXSERVE_KVSTORE_PORT", str(port))
        assert main(["kvstore"]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: the kvstore's control socket cannot listen on tcp://127.0.0.1:{port}: "
        "Address already in use (RADIXSERVE_KVSTORE_PORT or --port sets its port" in err
    ), err
    assert "Traceback" not in err


def test_every_service_of_a_cluster_has_its_socket_and_is_told_the_others_ports():
    """Port 0 everywhere: the autoscaler's URL the gateway gets is its bound port, and
    each service's port setting is its socket's."""
    config = ClusterConfig(num_prefill=2, num_decode=2, port=0, autoscale=True,
                           autoscaler_env={"RADIXSERVE_AUTOSCALER_PORT": "0"})  # fmt: skip
    sockets = ClusterSockets.of(config)
    specs = cluster_specs(config, sockets=sockets)
    ports = []
    for spec in specs:
        [(setting, listener)] = spec.sockets.items()
        prefix = setting.removesuffix("LISTEN_FD")
        assert spec.env[f"{prefix}PORT"] == str(listener.port) != "0"
        ports.append(listener.port)
    assert sockets.autoscaler is not None
    ports.append(sockets.autoscaler.port)
    assert len(set(ports)) == len(ports) == 7
    [gateway] = [s for s in specs if s.name == "gateway"]
    assert gateway.env["RADIXSERVE_GATEWAY_AUTOSCALER_URL"] == (
        f"http://127.0.0.1:{sockets.autoscaler.port}"
    )
    assert gateway.sockets["RADIXSERVE_GATEWAY_LISTEN_FD"] is sockets.gateway


def test_a_retired_process_socket_is_closed_once_it_has_exited():
    """A worker a pool retires frees its port (its socket is closed with it), while the
    others keep theirs."""
    supervisor = Supervisor([_spec("retired"), _spec("kept")], restart_backoff_s=0.1)
    ports = {name: _port(supervisor.spec(name)) for name in supervisor.names()}
    try:
        supervisor.start()
        _wait([supervisor], lambda: len(_answers(ports)) == 2, 30, "both to answer")
        supervisor.retire("retired", timeout_s=10)
        _wait([supervisor], lambda: "retired" not in supervisor.names(), 30, "the retirement")
        assert _ask(ports["retired"]) is None
        assert (_ask(ports["kept"]) or "").startswith("kept ")
    finally:
        supervisor.stop()
