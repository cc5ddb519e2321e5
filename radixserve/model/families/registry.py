"""The model families, found by their names: a config.json's architecture, a GGUF
file's ``general.architecture`` or `ModelConfig.architecture`.

Every module of this package that names a `Family` instance ``FAMILY`` is one, found on
the first lookup (no import-time side effects); `register` adds one defined elsewhere
(a plug-in, a test) and `unregister` takes it out again.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from radixserve.errors import ModelLoadError
from radixserve.model.families.family import Family, PreTokenizer

_PACKAGE = __name__.rpartition(".")[0]
# families added by `register`, beside the package's own (name → family)
_registered: dict[str, Family] = {}


@functools.cache
def _package_families() -> tuple[Family, ...]:
    """The package's modules' ``FAMILY`` instances (imported once, sorted by name)."""
    found = []
    for info in pkgutil.iter_modules(importlib.import_module(_PACKAGE).__path__):
        family = getattr(importlib.import_module(f"{_PACKAGE}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return tuple(sorted(found, key=lambda f: f.name))


def families() -> list[Family]:
    """Every family: the package's, then the registered ones."""
    return [*_package_families(), *_registered.values()]


def register(family: Family) -> None:
    """Add a family defined outside this package (ValueError if one of its names is taken)."""
    taken = {f.name for f in families()}
    taken |= {a for f in families() for a in f.hf_architectures}
    clash = {family.name, *family.hf_architectures} & taken
    if clash:
        raise ValueError(f"model family names already taken: {sorted(clash)}")
    _registered[family.name] = family


def unregister(name: str) -> None:
    """Take out a family `register` added."""
    _registered.pop(name, None)


def by_name(name: str) -> Family:
    """The family of `ModelConfig.architecture` ``name`` (KeyError if none)."""
    for family in families():
        if family.name == name:
            return family
    raise KeyError(f"no model family {name!r}")


def for_hf(architectures: list[str]) -> Family:
    """The family of a config.json's ``architectures`` (the first one known)."""
    known = {a: f for f in families() for a in f.hf_architectures}
    for arch in architectures:
        if arch in known:
            return known[arch]
    raise ModelLoadError(f"unsupported architecture {architectures!r} "
                         f"(supported: {', '.join(known)})")  # fmt: skip


def for_gguf(arch: object, experts: bool) -> Family:
    """The family of a GGUF file of ``general.architecture`` ``arch``, with or without
    experts: the one of that arch whose `Family.experts` matches, else its first."""
    candidates = [f for f in families() if arch in f.gguf_archs]
    if not candidates:
        supported = dict.fromkeys(a for f in families() for a in f.gguf_archs)
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(supported)})")  # fmt: skip
    return next((f for f in candidates if f.experts == experts), candidates[0])


def pre_tokenizer(pre: str) -> PreTokenizer | None:
    """The pre-tokenizer a family gives GGUF vocabularies named ``pre`` (None: none does)."""
    return next((f.pre_tokenizers[pre] for f in families() if pre in f.pre_tokenizers), None)
