"""Who is asking: the tenant and role an API key stands for.

`Gateway.authorize(request)` returns the caller's `Principal`; every route that stores or
reads state (stored responses, the request log, traces, the explorer) scopes it by
``principal.tenant``, operator routes require ``principal.is_admin``, and the KV cache
scope of a request is ``principal.cache_scope(salt)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from radixserve.cache.block_hash import cache_scope

Role = Literal["user", "admin"]

#: The tenant of every request when no API keys are configured (one tenant, shared cache).
DEFAULT_TENANT = ""


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request, as its API key says."""

    tenant: str = DEFAULT_TENANT
    role: Role = "admin"
    cache_group: str = ""  # a shared salt group the tenant opted into ("": none)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def cache_scope(self, salt: str = "") -> str:
        """The KV scope of this caller's request with ``cache_salt`` ``salt``: its tenant
        (or its shared group), narrowed by the salt (`radixserve.cache.block_hash.cache_scope`)."""
        return cache_scope(tenant=self.tenant, group=self.cache_group, salt=salt)


#: The caller when no API keys are configured: one tenant, every route open, as before.
ANONYMOUS = Principal()
