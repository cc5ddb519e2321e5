"""A link set given a page geometry refuses a worker whose pages differ (another page
size, another page-hash namespace, another pool layout, a tensor-parallel size pages
cannot move to or from): their page hashes or bytes would not match ours. It logs why once and takes the worker back once it is fixed."""

from __future__ import annotations

import logging

import pytest
import zmq.asyncio

from radixserve.protocol import HelloAck
from radixserve.runtime.links import LinkIdentity, LinkSet, PageGeometry

NS = b"n" * 32
ME = LinkIdentity("gw", "gateway", 1, interval_s=1.0, peer_timeout_s=5.0)


def ack(
    generation: int, page_size: int = 16, namespace: bytes = NS, pool: str = "mine", tp: int = 1
) -> HelloAck:
    return HelloAck("d0", "decode", generation, page_size=page_size, hash_namespace=namespace,
                    pool_digest=pool, tp_size=tp)  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (ack(1, page_size=32), "32 tokens"),
        (ack(1, namespace=b"o" * 32), "namespace"),
        (ack(1, pool="other"), "layout"),
        (ack(1, tp=3), "this side is TP=2, the peer TP=3"),
    ],
)
def test_a_worker_with_other_pages_is_refused(
    caplog: pytest.LogCaptureFixture, bad: HelloAck, why: str
) -> None:
    context = zmq.asyncio.Context()
    ups: list[str] = []
    links = LinkSet(
        context, ["tcp://127.0.0.1:9"], ME, on_message=lambda link, msg: None,
        on_up=lambda link: ups.append(link.name), pages=PageGeometry(16, NS, "mine", 2),
    )  # fmt: skip
    [link] = links.links
    try:
        with caplog.at_level(logging.ERROR, logger="radixserve.runtime.links"):
            for _ in range(3):  # a hello every interval, the same answer each time
                links._acked(link, bad)
        assert not link.up and ups == []
        [record] = caplog.records  # logged once, not at every hello
        assert why in record.getMessage()
        links._acked(link, ack(2, tp=4))  # restarted, fixed (TP=4 pages move to TP=2)
        assert link.up and ups == ["d0"]
        # and restarted again with the wrong pages: down at once
        links._acked(link, ack(3, page_size=8))
        assert not link.up
    finally:
        for each in links.links:
            each.channel.close()
        context.term()


def test_a_peer_without_a_pool_is_checked_on_hashes_only() -> None:
    """The gateway has no KV pool (no digest): only page size and namespace count."""
    context = zmq.asyncio.Context()
    links = LinkSet(context, ["tcp://127.0.0.1:9"], ME, on_message=lambda link, msg: None,
                    pages=PageGeometry(16, NS))  # fmt: skip
    [link] = links.links
    try:
        links._acked(link, ack(1, pool="any"))
        assert link.up
    finally:
        link.channel.close()
        context.term()


def test_a_set_without_a_geometry_checks_none() -> None:
    context = zmq.asyncio.Context()
    me = LinkIdentity("w", "decode", 1, interval_s=1.0, peer_timeout_s=5.0)
    links = LinkSet(context, ["tcp://127.0.0.1:9"], me, on_message=lambda link, msg: None)
    [link] = links.links
    try:
        links._acked(link, HelloAck("kv", "kvstore", 1))  # the kvstore has no pages
        assert link.up
    finally:
        link.channel.close()
        context.term()
