"""PoolCompat and the agent-level checks that run before any transfer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch

from radixserve.transfer import PoolCompat, TransferError
from radixserve.transfer.zmq import ZmqTransferAgent
from tests.transfer.peer_process import make_pool

BASE = PoolCompat("tiny", "float32", 2, 2, 8, 4)


def test_digest_is_stable_and_canonical() -> None:
    assert BASE.digest == PoolCompat.from_dict(dict(reversed(BASE.to_dict().items()))).digest
    assert len(BASE.digest) == 64 and BASE.layout == "L2PSHD"
    pool, compat = make_pool()
    assert compat == BASE and compat.digest == BASE.digest


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "other"},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 16},
        {"page_size": 8},
        {"layout": "LP2SHD"},
        {"identity": "ab" * 32},
    ],
)
def test_every_field_changes_the_digest(change: dict[str, object]) -> None:
    other = replace(BASE, **change)  # type: ignore[arg-type]
    assert other.digest != BASE.digest
    (field,) = change
    assert [m.split(":")[0] for m in BASE.mismatches(other)] == [field]


def test_from_dict_rejects_unknown_or_missing_fields() -> None:
    with pytest.raises(ValueError):
        PoolCompat.from_dict({**BASE.to_dict(), "extra": 1})
    data = BASE.to_dict()
    del data["head_dim"]
    with pytest.raises(ValueError):
        PoolCompat.from_dict(data)


def test_a_descriptor_from_before_identities_reads_as_stating_none() -> None:
    """A slab header or a peer written before pools carried a model identity reads as
    identity "" (so it matches no pool that states one) rather than failing to parse."""
    data = replace(BASE, identity="ab" * 32).to_dict()
    del data["identity"]
    old = PoolCompat.from_dict(data)
    assert old == BASE and old.identity == ""
    assert old.digest != replace(BASE, identity="ab" * 32).digest


def test_a_peer_of_another_model_identity_is_refused(
    pair: tuple[ZmqTransferAgent, ZmqTransferAgent],
) -> None:
    """Same shapes and dtype, other weights: no page of theirs is read."""
    a, b = pair
    theirs = replace(BASE, identity="cd" * 32)
    metadata = _edit(a.metadata(), compat=theirs.to_dict(), compat_hash=theirs.digest)
    with pytest.raises(TransferError, match=f"identity: '' != '{'cd' * 32}'"):
        b.add_peer("a", 1, metadata)
    assert b.peers == {}


def test_check_tensor_rejects_wrong_shape_dtype_or_strides() -> None:
    pool, compat = make_pool()
    compat.check_tensor(pool.kv)
    with pytest.raises(ValueError, match="does not match"):
        replace(compat, head_dim=4).check_tensor(pool.kv)
    with pytest.raises(ValueError, match="dtype"):
        compat.check_tensor(pool.kv.to(torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        compat.check_tensor(pool.kv.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="pool tensor"):
        compat.check_tensor(pool.kv[0])


@pytest.fixture
def pair() -> Iterator[tuple[ZmqTransferAgent, ZmqTransferAgent]]:
    a_pool, compat = make_pool()
    b_pool, _ = make_pool()
    a, b = ZmqTransferAgent("a", a_pool.kv, compat), ZmqTransferAgent("b", b_pool.kv, compat)
    yield a, b
    b.close()
    a.close()


def _edit(metadata: bytes, **changes: object) -> bytes:
    env = msgpack.unpackb(metadata, raw=False)
    env.update(changes)
    return msgpack.packb(env, use_bin_type=True)


def test_add_peer_rejects_bad_metadata(pair: tuple[ZmqTransferAgent, ZmqTransferAgent]) -> None:
    a, b = pair
    md = a.metadata()
    cases = [
        (b"\xc1not msgpack", "malformed"),
        (_edit(md, backend="nixl"), "backend"),
        (_edit(md, name="z"), "not 'a'"),
        (_edit(md, compat=replace(BASE, model_name="x").to_dict()), "model_name"),
        (_edit(md, compat_hash="0" * 64), "compat hash"),
        (_edit(md, v=1), "metadata version 1, this side 2: run the same radixserve release"),
        (msgpack.packb([1, 2]), "malformed"),
    ]
    for metadata, reason in cases:
        with pytest.raises(TransferError, match=reason):
            b.add_peer("a", 1, metadata)
    assert b.peers == {}
    b.add_peer("a", 1, md)
    b.add_peer("a", 1, md)  # same generation, same metadata: no-op
    assert b.peers == {"a": 1}


def test_read_pages_validates_page_ids(pair: tuple[ZmqTransferAgent, ZmqTransferAgent]) -> None:
    a, b = pair
    b.add_peer("a", 1, a.metadata())
    for remote, local in [([], []), ([1, 2], [1]), ([1, 2], [3, 3]), ([16], [0]), ([0], [-1])]:
        with pytest.raises(TransferError):
            b.read_pages("a", remote, local)
    b.close()
    with pytest.raises(TransferError, match="closed"):
        b.read_pages("a", [0], [0])
