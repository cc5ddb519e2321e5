"""A link set refuses a worker whose pages hold another number of tokens (its page hashes
would not match ours), logs why once, and takes a worker that comes back with the
right page size."""

from __future__ import annotations

import logging

import pytest
import zmq.asyncio

from radixserve.protocol import HelloAck
from radixserve.services.runtime.links import LinkSet


def test_a_worker_with_another_page_size_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    context = zmq.asyncio.Context()
    ups: list[str] = []
    links = LinkSet(
        context, ["tcp://127.0.0.1:9"], name="gw", role="gateway", generation=1,
        interval_s=1.0, peer_timeout_s=5.0, on_message=lambda link, msg: None,
        on_up=lambda link: ups.append(link.name), page_size=16,
    )  # fmt: skip
    [link] = links.links
    try:
        with caplog.at_level(logging.ERROR, logger="radixserve.services.runtime.links"):
            for _ in range(3):  # a hello every interval, the same answer each time
                links._acked(link, HelloAck("d0", "decode", 1, page_size=32))
        assert not link.up and ups == []
        [record] = caplog.records  # logged once, not at every hello
        assert "32 tokens" in record.getMessage() and "16" in record.getMessage()
        links._acked(link, HelloAck("d0", "decode", 2, page_size=16))  # restarted, fixed
        assert link.up and ups == ["d0"]
        # and restarted again with the wrong size: down at once
        links._acked(link, HelloAck("d0", "decode", 3, page_size=8))
        assert not link.up
    finally:
        for each in links.links:
            each.channel.close()
        context.term()


def test_a_set_without_a_page_size_checks_none() -> None:
    context = zmq.asyncio.Context()
    links = LinkSet(
        context, ["tcp://127.0.0.1:9"], name="w", role="decode", generation=1,
        interval_s=1.0, peer_timeout_s=5.0, on_message=lambda link, msg: None,
    )  # fmt: skip
    [link] = links.links
    try:
        links._acked(link, HelloAck("kv", "kvstore", 1))  # the kvstore has no pages
        assert link.up
    finally:
        link.channel.close()
        context.term()
