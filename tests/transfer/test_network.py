"""Transfer agents bound to an address other than 127.0.0.1, as containers bind theirs.

A page owner in a second process binds 127.0.0.2 (a loopback address that is not the
default one, standing in for a pod IP) with a fixed port range; a reader here, bound to
127.0.0.3, pulls pages from it over ZMQ and over NIXL. NIXL runs with ``UCX_TLS=tcp`` so
the pages really cross a TCP connection (shared memory would otherwise carry them on
one host), and the owner's UCX listeners must sit on the loopback interface only and
in the range. What a process listens on is read from /proc (Linux).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from typing import Any

import pytest
import torch

from radixserve.runtime.network import transfer_network
from radixserve.runtime.settings import ServiceSettings
from radixserve.transfer import TransferError, TransferNetwork, create_agent
from radixserve.transfer.network import interface_addresses, interface_of
from tests.transfer.peer_process import PeerProcess, _pages, fill_pattern, make_pool

OWNER = TransferNetwork("127.0.0.2", port_min=47310, port_max=47319)
READER = TransferNetwork("127.0.0.3")
REMOTE, LOCAL = [5, 2, 3, 11, 0], [9, 14, 15, 1, 6]


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every IPv4 TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # 0A: LISTEN
                address, port = fields[1].split(":")
                ip = ipaddress.IPv4Address(bytes.fromhex(address)[::-1])
                out.append((str(ip), int(port, 16)))
    return out


@pytest.fixture
def peer(request: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    backend = request.param
    if backend == "nixl":
        monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: TCP only
    owner = PeerProcess(backend, "owner", seed=3, network=OWNER)
    yield backend, owner
    owner.stop()


@pytest.mark.parametrize("peer", ["zmq", "nixl"], indirect=True)
def test_pages_move_between_agents_on_other_addresses(peer: Any) -> None:
    backend, owner = peer
    pool, compat = make_pool()
    pool.kv.fill_(-1.0)
    reader = create_agent(
        backend, "reader", pool.kv, compat, default_timeout_s=10.0, network=READER
    )
    try:
        reader.add_peer("owner", 1, owner.metadata)
        reader.wait(reader.read_pages("owner", REMOTE, LOCAL))
        expected, _ = make_pool()
        fill_pattern(expected.kv, 3)
        assert torch.equal(_pages(reader.kv, LOCAL), _pages(expected.kv, REMOTE))
    finally:
        reader.close()
    sockets = listening(owner.process.pid)
    assert sockets, "the owner listens on nothing"
    for address, port in sockets:
        assert ipaddress.ip_address(address).is_loopback, sockets
        assert OWNER.port_min <= port <= OWNER.port_max, sockets
    if backend == "zmq":  # an address, not only an interface: 127.0.0.2 exactly
        assert [a for a, _ in sockets] == ["127.0.0.2"]
        assert b"tcp://127.0.0.2:" in owner.metadata


def test_zmq_advertises_its_advertise_host_and_binds_every_interface() -> None:
    pool, compat = make_pool()
    agent = create_agent("zmq", "a", pool.kv, compat, network=TransferNetwork("0.0.0.0", "pod-a"))
    try:
        found = re.search(rb"tcp://pod-a:(\d+)", agent.metadata())
        assert found is not None
        assert ("0.0.0.0", int(found[1])) in listening(os.getpid())
    finally:
        agent.close()


def test_zmq_takes_the_first_free_port_of_its_range() -> None:
    pool, compat = make_pool()
    net = TransferNetwork("127.0.0.2", port_min=47330, port_max=47331)
    first = create_agent("zmq", "a", pool.kv, compat, network=net)
    second = create_agent("zmq", "b", pool.kv, compat, network=net)
    try:
        assert b"tcp://127.0.0.2:47330" in first.metadata()
        assert b"tcp://127.0.0.2:47331" in second.metadata()
        with pytest.raises(TransferError, match="ports 47330-47331"):
            create_agent("zmq", "c", pool.kv, compat, network=net)
    finally:
        first.close()
        second.close()


def test_ucx_environment_follows_the_bind_address() -> None:
    loopback = interface_of("127.0.0.1")
    assert interface_of("127.0.0.2") == interface_of("localhost") == loopback
    assert TransferNetwork().ucx_env() == {"UCX_NET_DEVICES": loopback}
    assert TransferNetwork("0.0.0.0", port_min=7100, port_max=7115).ucx_env() == {
        "UCX_TCP_PORT_RANGE": "7100-7115"
    }
    for name, address in interface_addresses().items():  # every address maps back
        assert interface_of(str(address)) == name
    with pytest.raises(ValueError, match="no network interface holds 198.51.100.7"):
        interface_of("198.51.100.7")  # TEST-NET-2: on no interface here
    with pytest.raises(ValueError, match="port range"):
        TransferNetwork(port_min=7100)
    pool, compat = make_pool()
    with pytest.raises(TransferError, match="no network interface holds"):
        create_agent("nixl", "x", pool.kv, compat, network=TransferNetwork("198.51.100.7"))
    with pytest.raises(TransferError, match="cannot bind the ZMQ KV agent"):
        create_agent("zmq", "x", pool.kv, compat, network=TransferNetwork("198.51.100.7"))


def test_service_settings_make_the_network() -> None:
    net = transfer_network(ServiceSettings(host="0.0.0.0", advertise_host="10.1.2.3"))
    assert (net.bind_host, net.advertised, net.port_range) == ("0.0.0.0", "10.1.2.3", None)
    net = transfer_network(ServiceSettings(host="0.0.0.0"))
    assert net.advertised == socket.gethostname()  # a compose container's name
    net = transfer_network(
        ServiceSettings(transfer_host="127.0.0.5", transfer_port_min=9000, transfer_port_max=9009)
    )
    assert (net.bind_host, net.advertised, net.port_range) == (
        "127.0.0.5",
        "127.0.0.5",
        "9000-9009",
    )
    with pytest.raises(ValueError, match="port range"):
        ServiceSettings(transfer_port_min=9000, transfer_port_max=8000)
