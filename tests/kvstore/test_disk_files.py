"""The disk tier's files on a real filesystem (the test's tmp directory), through both
I/O paths (``O_DIRECT`` and the page cache): records written in runs come back byte-
exact from any order; a flipped byte, a torn record (a crash mid-overwrite) or a record
of another layout is refused by `check`, a slot never written reads as empty; a slab of
another layout is refused by name and its records only counted; a file the kernel
refuses to grow (a real RLIMIT_FSIZE, as close to a full disk as a test may get on a
shared machine) leaves nothing behind."""

from __future__ import annotations

import contextlib
import random
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.cache.page_proof import PageProof, pack_tokens
from radixserve.services.kvstore.disk_files import (
    HEADER_BYTES,
    RecordBuffer,
    SlabFiles,
    check,
    count_records,
    empty,
    record_bytes,
    record_header_bytes,
    seal,
)
from radixserve.transfer import PoolCompat

# (L, 2, S, H, D) = (2, 2, 4, 2, 8) float32: a page is 1 KiB, a record 8 KiB
COMPAT = PoolCompat("disk-files-test", "float32", 2, 2, 8, 4)


def page_of(page_hash: int, compat: PoolCompat = COMPAT) -> torch.Tensor:
    """A page whose every element depends on its hash (a misplaced page shows)."""
    shape = (compat.num_layers, 2, compat.page_size, compat.num_kv_heads, compat.head_dim)
    return (
        torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        + page_hash % 100_003
    )


NAMESPACE = hash_namespace("disk-files-test")
BIG = 2**100  # page hashes are 128-bit: records keep every bit


def proof_of(page_hash: int, parent: int | None = None) -> PageProof:
    return PageProof(NAMESPACE, parent, pack_tokens([page_hash % 997 + k for k in range(4)]))


def sealed(buffer: RecordBuffer, i: int, page_hash: int, seq: int = 1) -> memoryview:
    buffer.page(i).copy_(page_of(page_hash))
    view = buffer.view(i)
    seal(view, page_hash, seq, bytes.fromhex(COMPAT.digest), COMPAT.page_bytes,
         proof_of(page_hash, page_hash - 1))  # fmt: skip
    return view


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """The kernel refuses to grow any file of this process past ``nbytes`` (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_records_written_in_runs_read_back_exact_in_any_order(tmp_path: Path, direct: bool):
    files = SlabFiles(tmp_path, COMPAT, direct=direct)
    files.add_slab(24)
    files.add_slab(16)  # slots 24..39: a run crosses into the second file
    assert files.direct == direct and files.num_slots == 40
    assert files.size_bytes == 2 * HEADER_BYTES + 40 * record_bytes(COMPAT.page_bytes, 4)
    out = RecordBuffer(40, COMPAT)
    slots = list(range(40))
    random.Random(0).shuffle(slots)  # record i goes to slots[i]: runs form only when sorted
    files.write(slots, [sealed(out, i, BIG + i, seq=i + 1) for i in range(40)])
    back = RecordBuffer(40, COMPAT)
    order = list(range(40))
    random.Random(1).shuffle(order)
    files.read([slots[i] for i in order], [back.view(k) for k in range(40)])
    for k, i in enumerate(order):
        found = (BIG + i, i + 1, proof_of(BIG + i, BIG + i - 1))
        assert check(back.view(k), files.digest, COMPAT.page_bytes, 4) == found
        assert torch.equal(back.page(k), page_of(BIG + i))
    files.close()


def test_a_flipped_byte_a_torn_record_and_another_layout_fail_their_check(tmp_path: Path):
    digest, size = bytes.fromhex(COMPAT.digest), COMPAT.page_bytes
    buffer = RecordBuffer(3, COMPAT)
    good = sealed(buffer, 0, 7)
    assert check(good, digest, size, 4) == (7, 1, proof_of(7, 6))
    flipped = sealed(buffer, 1, 7)
    flipped[record_header_bytes(4) + 100] ^= 0x01  # one bit of the page
    assert check(flipped, digest, size, 4) is None
    flipped = sealed(buffer, 1, 7)
    flipped[135] ^= 0x01  # one bit of the stored tokens (after the 133-byte header)
    assert check(flipped, digest, size, 4) is None
    torn = sealed(buffer, 1, 8)  # page 8's record, half overwritten by page 9's
    newer = RecordBuffer(1, COMPAT)
    half = record_header_bytes(4) + size // 2
    torn[:half] = sealed(newer, 0, 9, seq=2)[:half]
    assert check(torn, digest, size, 4) is None
    other = PoolCompat("another-model", "float32", 2, 2, 8, 4)
    assert check(good, bytes.fromhex(other.digest), size, 4) is None
    assert empty(buffer.view(2)) and not empty(good)


def test_a_slab_of_another_layout_is_refused_by_name_and_its_records_counted(tmp_path: Path):
    other = PoolCompat("disk-files-test", "float32", 2, 2, 16, 4)  # head_dim 16
    theirs = SlabFiles(tmp_path, other)
    slab = theirs.add_slab(4)
    buffer = RecordBuffer(2, other)
    for i in range(2):
        seal(buffer.view(i), 50 + i, 1, bytes.fromhex(other.digest), other.page_bytes,
             proof_of(50 + i))  # fmt: skip
    theirs.write([0, 2], [buffer.view(0), buffer.view(1)])
    theirs.close()
    ours = SlabFiles(tmp_path, COMPAT)
    mine, others = ours.listing()
    assert mine == [] and others == [slab.path]
    assert count_records(slab.path) == 2
    with pytest.raises(ValueError, match="head_dim: 8 != 16"):
        ours.open_slab(slab.path)


def test_a_slab_the_kernel_refuses_to_grow_leaves_nothing_behind(tmp_path: Path):
    files = SlabFiles(tmp_path, COMPAT)
    with file_size_limit(64 * 1024), pytest.raises(OSError):  # 40 slots: 324 KiB
        files.add_slab(40)
    assert files.slabs == [] and list(tmp_path.iterdir()) == []
    slab = files.add_slab(4)  # the limit lifted: the next file is made (a new number)
    assert slab.path.name.endswith("-00001.kv") and files.listing()[0] == [slab.path]
    files.close()


def test_a_record_keeps_the_proof_its_hash_is_recomputed_from(tmp_path: Path):
    tokens = [11, 12, 13, 14, 21, 22, 23, 24]
    first, second = page_hashes(tokens, 4, NAMESPACE)
    proof = PageProof(NAMESPACE, first, pack_tokens(tokens[4:]))
    buffer = RecordBuffer(1, COMPAT)
    buffer.page(0).copy_(page_of(1))
    seal(buffer.view(0), second, 1, bytes.fromhex(COMPAT.digest), COMPAT.page_bytes, proof)
    page_hash, _, back = check(buffer.view(0), bytes.fromhex(COMPAT.digest), COMPAT.page_bytes, 4)
    assert page_hash == second and back == proof and back.verifies(second)
    assert back.token_ids == tokens[4:]
    other = PageProof(NAMESPACE, first, pack_tokens([11, 12, 13, 15]))  # one token differs
    assert not other.verifies(second)
    assert not PageProof(hash_namespace("another"), first, proof.tokens).verifies(second)
