"""Which weights computed a KV page: `ModelIdentity`, part of every page-hash namespace.

Two processes may share KV pages only if the same numbers came out of the same model:
the same weights (a content fingerprint of the checkpoint, not its name or path), the
same quantization of them as loaded, the same compute dtype and the same adapter. The
engine's namespace is ``hash_namespace(identity.key, cache_salt)``, the identity's digest
is part of its pool's `PoolCompat`, and every handshake between workers (and the
gateway's, the kvstore's host and disk tiers) compares them, naming both sides by
``short`` when they differ.

The fingerprint is SHA-256 over the bytes of the GGUF file, or of a Hugging Face
directory's config.json and *.safetensors files in sorted order (so any change to the
weights or to the architecture they are read with changes it). Reading 100 GB takes a
minute, so each file's digest is kept in ``fingerprints.json`` under the cache directory
(`cache_dir`), keyed by (absolute path, size, mtime_ns, inode, and ctime_ns, which no
write can keep: a file rewritten in place with its old mtime restored is read again): a
restart reads none of them again. An entry recorded less than `RACY_S` after its file's mtime is not trusted
(as git's index: a file rewritten within the filesystem's timestamp granularity would
keep size, inode and mtime). A missing or corrupt cache file is recomputed, an
unwritable one only warned about.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

IDENTITY_VERSION = "radixserve.model-identity.v1"
_WEIGHTS_DOMAIN = b"radixserve.weights.v1"
_CHUNK_BYTES = 16 << 20  # large reads: the digest, not the syscalls, sets the pace
_PROGRESS_BYTES = 1 << 30  # files past this log their progress
_PROGRESS_EVERY_S = 10.0
RACY_S = 2.0  # an entry this close to its file's mtime is re-checked (see the module doc)
_MAX_ENTRIES = 4096
_CACHE_VERSION = 1
_SHORT_HEX = 12


@dataclass(frozen=True)
class ModelIdentity:
    """What a KV page's numbers depend on besides its tokens.

    ``weights``: "sha256:<hex>" of the checkpoint (`weights_fingerprint`);
    ``quantization``: the scheme the weights were loaded in (`quantization_summary`);
    ``dtype``: the compute dtype ("bfloat16"); ``adapter``: "" for the base model.
    """

    weights: str
    quantization: str
    dtype: str
    adapter: str = ""

    @property
    def key(self) -> str:
        """Canonical, versioned encoding of every component (JSON with sorted keys, so a
        value can never be mistaken for another field): the namespace's model part."""
        return json.dumps([IDENTITY_VERSION, asdict(self)], sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """SHA-256 hex of `key` (what `PoolCompat.identity` holds)."""
        return hashlib.sha256(self.key.encode("utf-8")).hexdigest()

    @property
    def short(self) -> str:
        """For people: the weights fingerprint's first hex digits, quantization, dtype
        (and adapter), e.g. "3f2a9c0b11de/int4/bfloat16"."""
        parts = [self.weights.partition(":")[2][:_SHORT_HEX] or self.weights, self.quantization,
                 self.dtype]  # fmt: skip
        return "/".join(parts + ([f"adapter={self.adapter}"] if self.adapter else []))

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_key(cls, key: str) -> ModelIdentity:
        """Inverse of `key`; ValueError if ``key`` is not one."""
        try:
            version, fields = json.loads(key)
            if version != IDENTITY_VERSION:
                raise ValueError(f"unknown identity version {version!r}")
            identity = cls(**fields)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a model identity key: {key[:80]!r}") from exc
        if not all(isinstance(v, str) for v in identity.to_dict().values()):
            raise ValueError(f"not a model identity key: {key[:80]!r}")
        return identity


def model_identity(
    path: Path, plan: Mapping[str, str], dtype: str, adapter: str = ""
) -> ModelIdentity:
    """The identity of the checkpoint at ``path`` (a GGUF file or a Hugging Face
    directory) loaded with the per-matrix schemes ``plan`` in ``dtype``."""
    started = time.monotonic()
    weights = weights_fingerprint(path)
    identity = ModelIdentity(weights, quantization_summary(plan), dtype, adapter)
    logger.info("model identity %s (weights fingerprinted in %.2f s)", identity.short,
                time.monotonic() - started)  # fmt: skip
    return identity


def quantization_summary(plan: Mapping[str, str]) -> str:
    """A canonical name of per-matrix schemes: "int4" when all are int4, else the most
    common with the others named ("int4 (embed int8)"), or, past four others, counted
    with a digest of the whole plan ("int4 (+40 int8 #1a2b3c4d)")."""
    counts = collections.Counter(plan.values())
    if not counts:
        return "none"
    main = min(counts, key=lambda scheme: (-counts[scheme], scheme))
    others = sorted((key, scheme) for key, scheme in plan.items() if scheme != main)
    if not others:
        return main
    if len(others) <= 4:
        return f"{main} ({', '.join(f'{key} {scheme}' for key, scheme in others)})"
    canonical = json.dumps(sorted(plan.items()), separators=(",", ":")).encode()
    tally = ", ".join(f"+{n} {s}" for s, n in sorted(counts.items()) if s != main)
    return f"{main} ({tally} #{hashlib.sha256(canonical).hexdigest()[:8]})"


def weights_fingerprint(path: Path, cache_root: Path | None = None) -> str:
    """ "sha256:<hex>" of the checkpoint's bytes (module doc); each file's digest comes
    from the cache under ``cache_root`` (default `cache_dir()`) when it is still valid."""
    files = checkpoint_files(path)
    cache = FingerprintCache(cache_root if cache_root is not None else cache_dir())
    if len(files) == 1 and files[0] == path:
        return "sha256:" + cache.digest(path)
    combined = hashlib.sha256(_WEIGHTS_DOMAIN)
    for file in files:
        name = file.relative_to(path).as_posix().encode()
        combined.update(len(name).to_bytes(4, "big") + name + bytes.fromhex(cache.digest(file)))
    return "sha256:" + combined.hexdigest()


def checkpoint_files(path: Path) -> list[Path]:
    """The files whose bytes the fingerprint covers: ``path`` itself (a GGUF), or a
    directory's config.json and *.safetensors, sorted by name."""
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    config = path / "config.json"
    return ([config] if config.is_file() else []) + files


def cache_dir() -> Path:
    """``RADIXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixserve``, else
    ``~/.cache/radixserve``."""
    if os.environ.get("RADIXSERVE_CACHE_DIR"):
        return Path(os.environ["RADIXSERVE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "radixserve"


class FingerprintCache:
    """File digests kept in ``<root>/fingerprints.json``, one writer at a time (a lock
    file: processes starting together on one machine hash each file once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "fingerprints.json"
        self.files_hashed = 0  # files read by this object (not answered by the cache)

    def digest(self, file: Path) -> str:
        """SHA-256 hex of ``file``'s bytes, from the cache if still valid."""
        file = file.resolve()
        with self._locked():
            stat = file.stat()
            entry = self._load().get(str(file))
            if entry is not None and _valid(entry, stat):
                return str(entry["sha256"])
            hashed_at_ns = time.time_ns()
            value = _hash_file(file, stat.st_size)
            self.files_hashed += 1
            self._store(str(file), {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                    "inode": stat.st_ino, "ctime_ns": stat.st_ctime_ns,
                                    "hashed_at_ns": hashed_at_ns, "sha256": value})  # fmt: skip
            return value

    def entry(self, file: Path) -> dict[str, Any] | None:
        """The cache's record of ``file``, if any."""
        return self._load().get(str(file.resolve()))

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != _CACHE_VERSION or not isinstance(data["files"], dict):
                return {}
            return data["files"]
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
            logger.warning("ignoring the weights fingerprint cache %s: %s", self.path, exc)
            return {}

    def _store(self, name: str, entry: dict[str, Any]) -> None:
        files = self._load()  # re-read: another process may have added to it
        files[name] = entry
        if len(files) > _MAX_ENTRIES:
            oldest = sorted(files, key=lambda n: files[n].get("hashed_at_ns", 0))
            for stale in oldest[: len(files) - _MAX_ENTRIES]:
                del files[stale]
        text = json.dumps({"version": _CACHE_VERSION, "files": files}, indent=1, sort_keys=True)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".fingerprints.", suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("cannot write the weights fingerprint cache %s (%s): the next "
                           "start reads the weights again", self.path, exc)  # fmt: skip

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / "fingerprints.lock", "a")  # noqa: SIM115
        except OSError:
            yield  # no cache to share: nothing to lock
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


def _valid(entry: Mapping[str, Any], stat: os.stat_result) -> bool:
    same = (entry.get("size"), entry.get("mtime_ns"), entry.get("inode"),
            entry.get("ctime_ns")) == (stat.st_size, stat.st_mtime_ns, stat.st_ino,
                                       stat.st_ctime_ns)  # fmt: skip
    settled = int(entry.get("hashed_at_ns", 0)) - stat.st_mtime_ns > RACY_S * 1e9
    return same and settled and isinstance(entry.get("sha256"), str)


def _hash_file(file: Path, size: int) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    done, started, logged = 0, time.monotonic(), time.monotonic()
    if size > _PROGRESS_BYTES:
        logger.info("fingerprinting %s (%.1f GiB, once: the digest is cached)", file, size / 2**30)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib releases the GIL for large buffers
            done += n
            if size > _PROGRESS_BYTES and time.monotonic() - logged > _PROGRESS_EVERY_S:
                logged = time.monotonic()
                logger.info("fingerprinting %s: %.1f of %.1f GiB", file.name, done / 2**30,
                            size / 2**30)  # fmt: skip
    if size > _PROGRESS_BYTES:
        logger.info("fingerprinted %s in %.1f s", file.name, time.monotonic() - started)
    return digest.hexdigest()


def checkpoint_identity(
    checkpoint: Any, plan: Mapping[str, str], dtype: str, adapter: str = ""
) -> ModelIdentity:
    """`model_identity` of a loaded `radixserve.model.checkpoint.Checkpoint`; a source
    with no files (random weights) names itself by its ``fingerprint()`` if it has one,
    else by its path ("unhashed:random:tiny")."""
    fingerprint = getattr(checkpoint.source, "fingerprint", None)
    if fingerprint is None and checkpoint.path.exists():
        return model_identity(checkpoint.path, plan, dtype, adapter)
    weights = fingerprint() if fingerprint is not None else f"unhashed:{checkpoint.path}"
    return ModelIdentity(weights, quantization_summary(plan), dtype, adapter)


def identity_card(identity: ModelIdentity | None) -> dict[str, str] | None:
    """``identity``'s fields and short form, for JSON views (/v1/models, /debug/cache);
    None when it is not known."""
    return None if identity is None else {**identity.to_dict(), "short": identity.short}
