"""The model identity: a content fingerprint of the weights (cached per file, so a
restart reads none of them again), the loaded quantization, the compute dtype and the
adapter, and the page-hash namespace built from it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from radixserve.cache.block_hash import hash_namespace
from radixserve.engine.info import EngineInfo
from radixserve.model.identity import (
    RACY_S,
    FingerprintCache,
    ModelIdentity,
    cache_dir,
    model_identity,
    quantization_summary,
    weights_fingerprint,
)
from radixserve.model.model_files import resolve_model_path
from tests.engine.engine_helpers import make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

PAST_NS = 1_600_000_000 * 10**9  # an mtime long before any fingerprint is taken


def settled_file(path: Path, data: bytes) -> Path:
    """``data`` written to ``path`` with an mtime well in the past (a file not being
    written, whose digest the cache may keep)."""
    path.write_bytes(data)
    os.utime(path, ns=(PAST_NS, PAST_NS))
    return path


def hf_dir(root: Path, shards: list[bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    settled_file(root / "config.json", b'{"model_type": "llama"}')
    for i, data in enumerate(shards):
        settled_file(root / f"model-{i:05d}.safetensors", data)
    settled_file(root / "tokenizer.json", b"{}")  # not part of the weights
    return root


def test_one_changed_byte_changes_the_fingerprint_and_a_copy_keeps_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = bytes(range(256)) * 4096
    a = settled_file(tmp_path / "a.gguf", data)
    copy = settled_file(tmp_path / "copy.gguf", data)
    changed = settled_file(tmp_path / "b.gguf", data[:1000] + b"\xff" + data[1001:])
    fingerprint = weights_fingerprint(a, cache)
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
    assert weights_fingerprint(copy, cache) == fingerprint
    assert weights_fingerprint(changed, cache) != fingerprint


def test_a_directory_is_fingerprinted_by_its_config_and_safetensors(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    base = hf_dir(tmp_path / "base", [b"\x01" * 5000, b"\x02" * 5000])
    same = hf_dir(tmp_path / "same", [b"\x01" * 5000, b"\x02" * 5000])
    other = hf_dir(tmp_path / "other", [b"\x01" * 5000, b"\x02" * 4999 + b"\x03"])
    fingerprint = weights_fingerprint(base, cache)
    assert weights_fingerprint(same, cache) == fingerprint
    assert weights_fingerprint(other, cache) != fingerprint
    settled_file(same / "tokenizer.json", b'{"another": "tokenizer"}')  # no weight
    assert weights_fingerprint(same, cache) == fingerprint
    settled_file(same / "config.json", b'{"model_type": "llama", "rope_theta": 1}')
    assert weights_fingerprint(same, cache) != fingerprint


def test_a_restart_reads_no_weights_until_the_file_changes(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    weights = settled_file(tmp_path / "w.gguf", b"w" * 100_000)
    first = FingerprintCache(root)
    digest = first.digest(weights)
    assert first.files_hashed == 1
    entry = first.entry(weights)
    assert entry is not None
    assert entry["sha256"] == digest
    stat = weights.stat()
    assert (entry["size"], entry["mtime_ns"], entry["inode"], entry["ctime_ns"]) == (
        stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)  # fmt: skip
    restarted = FingerprintCache(root)  # a new process: only the file on disk is shared
    assert restarted.digest(weights) == digest and restarted.files_hashed == 0
    # the same bytes with another mtime: not trusted, read again
    os.utime(weights, ns=(PAST_NS + 10**9, PAST_NS + 10**9))
    again = FingerprintCache(root)
    assert again.digest(weights) == digest and again.files_hashed == 1
    # other bytes, same size: another digest
    settled_file(weights, b"v" * 100_000)
    other = FingerprintCache(root).digest(weights)
    assert other != digest
    # rewritten in place (same inode and size) with its old mtime put back: the change
    # time, which no write keeps, tells
    time.sleep(0.05)  # past the filesystem's timestamp tick (a few ms)
    with weights.open("r+b") as f:
        f.write(b"u" * 100_000)
    os.utime(weights, ns=(PAST_NS, PAST_NS))
    assert FingerprintCache(root).digest(weights) not in (digest, other)


def test_a_file_hashed_just_after_it_was_written_is_checked_again(tmp_path: Path) -> None:
    """A filesystem's timestamps are coarse: a file rewritten in place within one tick
    keeps size, inode and mtime, so an entry taken that close to the mtime is not
    trusted (the next start reads the file again)."""
    root = tmp_path / "cache"
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"a" * 4096)
    stamp = weights.stat().st_mtime_ns
    assert time.time_ns() - stamp < RACY_S * 1e9
    digest = FingerprintCache(root).digest(weights)
    with weights.open("r+b") as f:  # the same inode and size, the same mtime
        f.write(b"b" * 4096)
    os.utime(weights, ns=(stamp, stamp))
    cache = FingerprintCache(root)
    assert cache.digest(weights) != digest and cache.files_hashed == 1


def test_a_corrupt_cache_is_recomputed_and_an_unwritable_one_only_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = settled_file(tmp_path / "w.gguf", b"x" * 10_000)
    root = tmp_path / "cache"
    digest = FingerprintCache(root).digest(weights)
    (root / "fingerprints.json").write_text("{not json")
    cache = FingerprintCache(root)
    with caplog.at_level(logging.WARNING, logger="radixserve.model.identity"):
        assert cache.digest(weights) == digest and cache.files_hashed == 1
    assert "ignoring the weights fingerprint cache" in caplog.text
    assert json.loads((root / "fingerprints.json").read_text())["version"] == 1  # rewritten
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve.model.identity"):
        assert FingerprintCache(blocked / "cache").digest(weights) == digest
    assert "cannot write the weights fingerprint cache" in caplog.text


def test_the_cache_directory_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RADIXSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "radixserve"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_every_component_changes_the_key_and_the_namespace() -> None:
    base = ModelIdentity("sha256:" + "ab" * 32, "int4", "bfloat16")
    others = [
        ModelIdentity("sha256:" + "cd" * 32, "int4", "bfloat16"),
        ModelIdentity(base.weights, "none", "bfloat16"),
        ModelIdentity(base.weights, "int4", "float32"),
        ModelIdentity(base.weights, "int4", "bfloat16", adapter="sql-lora"),
    ]
    keys = {base.key, *(other.key for other in others)}
    namespaces = {hash_namespace(key) for key in keys}
    assert len(keys) == len(namespaces) == 5
    assert hash_namespace(base.key, "salt") != hash_namespace(base.key)
    # fields are tagged: a value cannot stand in for another field
    assert ModelIdentity("x", "int4", "").key != ModelIdentity("x", "", "int4").key
    assert ModelIdentity.from_key(others[3].key) == others[3]
    assert base.short == "abababababab/int4/bfloat16"
    assert others[3].short.endswith("/adapter=sql-lora")
    with pytest.raises(ValueError):
        ModelIdentity.from_key('["radixserve.model-identity.v0", {}]')
    with pytest.raises(ValueError):
        ModelIdentity.from_key("not json")


def test_the_quantization_summary_is_canonical() -> None:
    assert quantization_summary({}) == "none"
    assert quantization_summary({"a": "int4", "b": "int4"}) == "int4"
    plan = {"layers.0.qkv": "int4", "layers.1.qkv": "int4", "embed": "int8"}
    assert quantization_summary(plan) == "int4 (embed int8)"
    assert quantization_summary(dict(reversed(plan.items()))) == "int4 (embed int8)"
    many = {f"layers.{i}.mlp": "int4" for i in range(20)}
    one = {**many, **{f"layers.{i}.mlp": "int8" for i in range(5)}}
    two = {**many, **{f"layers.{i}.mlp": "int8" for i in range(1, 6)}}
    assert quantization_summary(one).startswith("int4 (+5 int8 #")
    assert quantization_summary(one) != quantization_summary(two)  # same counts, other layers


def test_the_default_model_is_fingerprinted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model_path("default")
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    os.utime(copy, ns=(PAST_NS, PAST_NS))
    cache = FingerprintCache(tmp_path / "cache")
    assert cache.digest(path) == cache.digest(copy) and cache.files_hashed == 2
    restarted = FingerprintCache(tmp_path / "cache")
    assert restarted.digest(path) == cache.digest(path) and restarted.files_hashed == 0
    identity = model_identity(copy, {"embed": "int8", "layers.0.qkv": "int4"}, "bfloat16")
    assert identity.weights == "sha256:" + cache.digest(path)


def test_an_engine_names_its_pages_by_what_it_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The namespace of an engine's pages is its identity's (with the cache salt), and
    its pool's compat carries the identity: another quantization or dtype of the same
    files is another identity."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_tiny_checkpoint(tmp_path / "tiny"))
    engines = {
        (quantization, dtype): make_engine(path, quantization=quantization, dtype=dtype,
                                           kv_cache_memory_gib=0.01, cache_salt="s")
        for quantization, dtype in (("none", "float32"), ("int8", "float32"),
                                    ("none", "bfloat16"))
    }  # fmt: skip
    identities = {key: EngineInfo.of(engine).identity for key, engine in engines.items()}
    assert all(identities.values())
    assert identities[("none", "float32")] == ModelIdentity(
        weights_fingerprint(Path(path), tmp_path / "cache"), "none", "float32"
    )
    assert identities[("int8", "float32")].quantization == "int8"  # type: ignore[union-attr]
    assert identities[("none", "bfloat16")].dtype == "bfloat16"  # type: ignore[union-attr]
    assert len({identity.key for identity in identities.values() if identity}) == 3
    for engine in engines.values():
        info = EngineInfo.of(engine)
        identity = info.identity
        assert identity is not None
        assert info.hash_namespace == hash_namespace(identity.key, "s")
        assert info.geometry.identity == identity.digest
