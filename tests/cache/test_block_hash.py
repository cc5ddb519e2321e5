"""Chained page hashes: format, determinism across processes, salt sensitivity."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.block_hash import (
    hash_namespace,
    page_hashes,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(100, 140))

_CHILD_SCRIPT = """
import json
from radixserve.cache.block_hash import hash_namespace, page_hashes
namespace = hash_namespace("org/model", salt="tenant-a")
print(json.dumps({"ns": namespace.hex(), "hashes": page_hashes(list(range(100, 140)), 8, namespace)}))
"""


def _reference_hashes(tokens: list[int], page_size: int, namespace: bytes) -> list[int]:
    """The documented format, written out independently of the implementation."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        link = b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "big")
        message = (
            b"radixserve.page.v2"
            + struct.pack(">I", len(namespace))
            + namespace
            + link
            + struct.pack(f"<{page_size}I", *page)
        )
        parent = int.from_bytes(hashlib.sha256(message).digest()[:16], "big")
        out.append(parent)
    return out


def _hashes_in_subprocess(hash_seed: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(done.stdout)


def test_hashes_are_identical_across_processes() -> None:
    namespace = hash_namespace("org/model", salt="tenant-a")
    here = {"ns": namespace.hex(), "hashes": page_hashes(TOKENS, 8, namespace)}
    assert _hashes_in_subprocess("1") == here
    assert _hashes_in_subprocess("2") == here


def test_hashes_follow_the_documented_format() -> None:
    namespace = hash_namespace("m")
    assert page_hashes(TOKENS, 4, namespace) == _reference_hashes(TOKENS, 4, namespace)


def test_namespace_depends_on_model_and_salt() -> None:
    base = hash_namespace("model")
    assert len(base) == 32
    assert hash_namespace("model") == base
    assert hash_namespace("model", salt="x") != base
    assert hash_namespace("model", salt="x") != hash_namespace("model", salt="y")
    assert hash_namespace("other") != base
    # Length-prefixed parts: moving characters between name and salt changes the seed.
    assert hash_namespace("ab", "c") != hash_namespace("a", "bc")


def test_salt_changes_every_page_hash() -> None:
    a = page_hashes(TOKENS, 8, hash_namespace("model", salt="a"))
    b = page_hashes(TOKENS, 8, hash_namespace("model", salt="b"))
    assert len(a) == len(b) == 5
    assert not set(a) & set(b)


def test_only_full_pages_are_hashed() -> None:
    namespace = hash_namespace("m")
    assert page_hashes(TOKENS[:7], 8, namespace) == []
    assert page_hashes(TOKENS[:15], 8, namespace) == page_hashes(TOKENS[:8], 8, namespace)
    assert len(page_hashes(TOKENS[:16], 8, namespace)) == 2
    with pytest.raises(ValueError):
        page_hashes(TOKENS, 0, namespace)


def test_hashes_are_chained_and_128_bit() -> None:
    namespace = hash_namespace("m")
    hashes = page_hashes(TOKENS, 4, namespace)
    assert all(0 <= value < 2**128 for value in hashes)
    assert any(value >= 2**64 for value in hashes)  # not a 64-bit value widened
    changed = [TOKENS[0] + 1, *TOKENS[1:]]
    # A change in the first page changes the hash of every later page.
    assert not set(page_hashes(changed, 4, namespace)) & set(hashes)
    # The same page content under a different parent hashes differently.
    assert page_hashes(TOKENS[:4], 4, namespace, parent=0) != page_hashes(TOKENS[:4], 4, namespace)


def test_token_ids_outside_u32_are_rejected() -> None:
    with pytest.raises(OverflowError):
        page_hashes([-1, 0], 2, hash_namespace("m"))
    with pytest.raises(OverflowError):
        page_hashes([2**32, 0], 2, hash_namespace("m"))


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    page_size=st.integers(1, 6),
    split=st.integers(0, 10),
)
def test_hashing_in_pieces_equals_hashing_at_once(
    tokens: list[int], page_size: int, split: int
) -> None:
    namespace = hash_namespace("m", "s")
    whole = page_hashes(tokens, page_size, namespace)
    cut = min(split, len(tokens) // page_size) * page_size
    head = page_hashes(tokens[:cut], page_size, namespace)
    tail = page_hashes(tokens[cut:], page_size, namespace, parent=head[-1] if head else None)
    assert head + tail == whole
    assert len(whole) == len(tokens) // page_size
