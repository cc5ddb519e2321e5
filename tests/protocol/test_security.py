"""The cluster secret on real sockets: only peers that hold it get a frame through; the
others are refused at the handshake (and the binding side sees it), and signed transfer
metadata opens only with the same secret."""

from __future__ import annotations

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from radixserve.protocol import Abort, Channel
from radixserve.protocol.security import HANDSHAKE_FAILURES, AuthError, ClusterKeys

SECRET = "correct horse battery staple"


def test_keys_are_derived_from_the_secret_alone():
    a, b = ClusterKeys.from_secret(SECRET), ClusterKeys.from_secret(SECRET)
    assert a == b  # every service derives the same keys: nothing else to distribute
    other = ClusterKeys.from_secret(SECRET + "!")
    assert other.server_public != a.server_public and other.mac_key != a.mac_key
    assert a.server_public != a.client_public
    with pytest.raises(ValueError, match="at least 16"):
        ClusterKeys.from_secret("short")


def test_signed_metadata_opens_only_with_the_same_secret():
    keys = ClusterKeys.from_secret(SECRET)
    signed = keys.sign(b"agent metadata")
    assert keys.open(signed) == b"agent metadata"
    with pytest.raises(AuthError):
        ClusterKeys.from_secret(SECRET + "!").open(signed)
    with pytest.raises(AuthError):
        keys.open(signed[:-1] + b"X")  # tampered
    with pytest.raises(AuthError):
        keys.open(b"agent metadata")  # unsigned


@pytest.mark.parametrize("client", ["secret", "none", "wrong"])
def test_only_holders_of_the_secret_get_frames_through(client):
    keys = ClusterKeys.from_secret(SECRET)
    client_keys = {"secret": keys, "none": None, "wrong": ClusterKeys.from_secret("x" * 20)}
    context = zmq.Context()
    server = Channel.open(context, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True, keys=keys)
    monitor = server.socket.get_monitor_socket(HANDSHAKE_FAILURES)
    try:
        dealer = Channel.open(context, zmq.DEALER, server.endpoint, bind=False,
                              keys=client_keys[client])  # fmt: skip
        try:
            dealer.send(Abort("r"), timeout_ms=1000)
        except TimeoutError:  # a refused handshake can leave the dealer no pipe to queue
            if client == "secret":  # on: for the others, what follows still must hold
                raise
        # (generous waits: they end at the frame or the event, and the cores are shared)
        got = server.recv_from(timeout_ms=5000 if client == "secret" else 1500)
        if client == "secret":
            assert got is not None and got[1] == Abort("r")
            assert not monitor.poll(200)
        else:
            assert got is None  # nothing reached the application
            assert monitor.poll(10_000)  # the failed handshake is seen where it binds
            event = parse_monitor_message(monitor.recv_multipart())
            assert event["event"] & HANDSHAKE_FAILURES
    finally:
        # the monitor stopped before any socket closes (else libzmq can block sending it
        # an event and context.term() waits forever: the suite hung here once), then
        # every socket closed at once, also after a failed assertion
        server.socket.disable_monitor()
        context.destroy(linger=0)
