"""A link set given a page geometry refuses a worker whose pages differ (another page
size, another page-hash namespace, another pool layout, a tensor-parallel size pages
cannot move to or from): their page hashes or bytes would not match ours. It logs why once and takes the worker back once it is fixed."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import zmq.asyncio

from radixserve.cache.block_hash import hash_namespace
from radixserve.model.identity import ModelIdentity
from radixserve.protocol import HelloAck
from radixserve.protocol.fields import Role
from radixserve.runtime.links import LinkIdentity, LinkSet
from radixserve.runtime.page_geometry import LearnedGeometry, PageGeometry

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


A = ModelIdentity("sha256:" + "a1" * 32, "int4", "bfloat16")
B = ModelIdentity("sha256:" + "b2" * 32, "none", "float32")


def ack_of(name: str, role: Role, identity: ModelIdentity | None, generation: int = 1,
           namespace: bytes | None = None) -> HelloAck:  # fmt: skip
    """A worker's hello answer: its namespace derives from its identity unless given."""
    if namespace is None:
        namespace = hash_namespace(identity.key) if identity else NS
    return HelloAck(name, role, generation, page_size=16, hash_namespace=namespace,
                    model_identity=identity.key if identity else "")  # fmt: skip


def test_a_worker_of_another_model_identity_is_refused_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = zmq.asyncio.Context()
    pages = PageGeometry(16, hash_namespace(A.key), identity=A)
    links = LinkSet(context, ["tcp://127.0.0.1:9"], ME, on_message=lambda link, msg: None,
                    pages=pages)  # fmt: skip
    [link] = links.links
    try:
        with caplog.at_level(logging.ERROR, logger="radixserve.runtime.links"):
            links._acked(link, ack_of("p0", "prefill", B))
        assert not link.up
        [record] = caplog.records
        message = record.getMessage()
        assert "model identity" in message
        assert "b2b2b2b2b2b2/none/float32" in message and "a1a1a1a1a1a1/int4/bfloat16" in message
        # the same identity under another cache salt: the namespace says so
        salted = ack_of("p0", "prefill", A, 2, hash_namespace(A.key, "other-salt"))
        assert "the same model identity, another cache_salt" in pages.mismatch(salted)
        assert "model identity or cache_salt" in pages.mismatch(ack_of("p0", "prefill", None))
        bad = dataclasses.replace(ack_of("p0", "prefill", A), model_identity="{}")
        assert "cannot be read" in pages.mismatch(bad)
        links._acked(link, ack_of("p0", "prefill", A, 3))
        assert link.up
    finally:
        link.channel.close()
        context.term()


def test_a_learned_geometry_follows_the_first_decode_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A process with no weights takes the namespace and identity of the first decode
    worker; a prefill worker met before is checked then; a worker of another identity
    is refused naming both; with no decode worker left the next one sets it again."""
    context = zmq.asyncio.Context()
    learned: list[tuple[bytes, ModelIdentity | None]] = []
    pages = LearnedGeometry(16, lambda ns, identity: learned.append((ns, identity)))
    decodes = LinkSet(context, ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"], ME,
                      on_message=lambda link, msg: None, pages=pages)  # fmt: skip
    prefills = LinkSet(context, ["tcp://127.0.0.1:11"], ME, on_message=lambda link, msg: None,
                       pages=pages)  # fmt: skip
    [d0, d1], [p0] = decodes.links, prefills.links
    try:
        prefills._acked(p0, ack_of("p0", "prefill", B))  # before any decode: page size only
        assert p0.up and pages.hash_namespace is None and learned == []
        decodes._acked(d0, ack_of("d0", "decode", A))
        assert d0.up and learned == [(hash_namespace(A.key), A)]
        assert (pages.hash_namespace, pages.identity) == (hash_namespace(A.key), A)
        with caplog.at_level(logging.ERROR, logger="radixserve.runtime.links"):
            prefills.recheck()
            decodes._acked(d1, ack_of("d1", "decode", B))
        assert not p0.up and not d1.up
        assert len(caplog.records) == 2
        for record in caplog.records:
            assert "b2b2b2b2b2b2/none/float32" in record.getMessage()
            assert "a1a1a1a1a1a1/int4/bfloat16" in record.getMessage()
        decodes.mark_down(d0, "stopped")
        pages.forget()
        decodes._acked(d1, ack_of("d1", "decode", B, 2))
        assert d1.up and pages.identity == B and learned[-1] == (hash_namespace(B.key), B)
        short = ack_of("d0", "decode", A, 5)
        assert "hold 16 tokens, ours 8" in LearnedGeometry(8).mismatch(short)  # fixed size
    finally:
        for each in decodes.links + prefills.links:
            each.channel.close()
        context.term()
