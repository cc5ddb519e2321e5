"""`CachedTokens`: a prompt's cache hits by tier, their one record on the wire, in engine
outputs, metrics and the gateway's request log."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from radixserve.protocol.fields import COUNT
from radixserve.protocol.wire import NestedSpec, WireStruct
from radixserve.protocol.wire import field_spec as _spec


@dataclass(frozen=True)
class CachedTokens(WireStruct):
    """Tokens of a request's prompt whose KV came from a cache instead of the model, by
    the tier that served them; no token counts in two tiers:

    - ``device``: in the serving engine's own cache (its radix tree) at admission
      (behind a prefill worker: the prefill engine's);
    - ``peer``: read for it from another worker's device cache (`PeerRead`);
    - ``host``: loaded for it from the kvstore's host memory;
    - ``disk``: loaded for it from the kvstore's disk tier (through host memory, but
      never counted in ``host``).

    The tiers are the fields, fastest first (`TIERS`), also their order in the prompt: the
    device's prefix, then the pages read past it (from a peer or the kvstore). A new tier
    is a new field with default 0. ``total`` is what usage reports (OpenAI ``cached_tokens``, Anthropic
    ``cache_read_input_tokens``); the prompt's other tokens were computed.
    """

    device: int = field(default=0, metadata=_spec(COUNT))
    peer: int = field(default=0, metadata=_spec(COUNT))
    host: int = field(default=0, metadata=_spec(COUNT))
    disk: int = field(default=0, metadata=_spec(COUNT))

    @property
    def total(self) -> int:
        return sum(self.by_tier().values())

    def by_tier(self) -> dict[str, int]:
        """Tier name -> tokens, fastest tier first."""
        return {name: getattr(self, name) for name in TIERS}

    def with_total(self, total: int) -> CachedTokens:
        """These hits as a cached prefix of ``total`` tokens: tokens past their sum were
        on the device; a shorter prefix loses the slowest tiers' (the prompt's last) first."""
        tiers, cut = self.by_tier(), max(0, self.total - total)
        tiers["device"] += max(0, total - self.total)
        for name in reversed(TIERS):
            taken = min(cut, tiers[name])
            tiers[name], cut = tiers[name] - taken, cut - taken
        return CachedTokens(**tiers)

    def __add__(self, other: CachedTokens) -> CachedTokens:
        return CachedTokens(**{k: n + getattr(other, k) for k, n in self.by_tier().items()})

    def as_dict(self) -> dict[str, int]:
        """The JSON form: every tier and the ``total``."""
        return {**self.by_tier(), "total": self.total}


TIERS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CachedTokens))  # fastest first
CACHED = NestedSpec(CachedTokens)  # a message's ``cached`` field
