"""Who is asking: the tenant and role an API key stands for.

`Gateway.authorize(request)` returns the caller's `Principal`; every route that stores or
reads state (stored responses, the request log, traces, the explorer) scopes it by
``principal.tenant``, operator routes require ``principal.is_admin``, and the KV cache
scope of a request is ``principal.cache_scope(salt)``.

API keys are configured as entries (`ApiKey`, from ``RADIXSERVE_GATEWAY_API_KEYS`` and
the key file): a bare key string is its own tenant (named by a digest of the key, never
the key) with role ``user``; an object names its tenant, role and shared cache group.
Several keys of one tenant see the same stored responses and share its cache. Keys are
`SecretStr`: they print masked wherever settings are printed or logged.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from radixserve.cache.block_hash import cache_scope
from radixserve.protocol.security import is_placeholder

Role = Literal["user", "admin"]

#: The tenant of every request when no API keys are configured (one tenant, shared cache).
DEFAULT_TENANT = ""
MIN_KEY_CHARS = 16
#: a tenant or group name as written in a key entry (no ':': derived names use one)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
KEY_SETTINGS = "RADIXSERVE_GATEWAY_API_KEYS / --api-key / --api-key-file"


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

    def owns(self, tenant: str) -> bool:
        """Whether this caller may see state stored by ``tenant`` (its own; admins: all)."""
        return self.is_admin or tenant == self.tenant


#: The caller when no API keys are configured: one tenant, every route open, as before.
ANONYMOUS = Principal()


def key_tenant(key: str) -> str:
    """The tenant of a bare key: a digest of it (stable across restarts, not the key)."""
    return "key:" + hashlib.sha256(b"radixserve tenant\x00" + key.encode()).hexdigest()[:16]


def masked(key: str) -> str:
    """How a key is shown in messages: its length and the first characters of its digest."""
    return f"<key of {len(key)} chars, sha256 {hashlib.sha256(key.encode()).hexdigest()[:8]}>"


class ApiKey(BaseModel):
    """One accepted API key: a bare string, or ``{"key", "tenant", "role", "cache_group"}``
    (any other field is refused by name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    key: SecretStr = Field(description="The `Authorization: Bearer` key (16+ characters).")
    tenant: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="The tenant it acts for (keys of one tenant share its stored responses "
        "and cache); default: a tenant of its own, named by a digest of the key.",
    )
    role: Role = Field("user", description="user: the API; admin: also /debug/* and /explorer.")
    cache_group: str = Field(
        "",
        pattern=rf"{NAME_PATTERN}|^$",
        description="A shared cache group: tenants naming the same one share cached "
        "prefixes (and see each other's hits in cached_tokens); '' = none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, value: Any) -> Any:
        return {"key": value} if isinstance(value, str) else value

    @field_validator("key")
    @classmethod
    def _long_enough(cls, key: SecretStr) -> SecretStr:
        value = key.get_secret_value()
        if len(value) < MIN_KEY_CHARS or value != value.strip():
            raise ValueError(
                f"an API key ({KEY_SETTINGS}) must be at least {MIN_KEY_CHARS} characters with "
                f"no surrounding spaces; got {'an empty one' if not value else masked(value)}"
            )
        if is_placeholder(value):
            raise ValueError(f"an API key ({KEY_SETTINGS}) is still the example's placeholder: "
                             "make your own (openssl rand -hex 32)")  # fmt: skip
        return key

    def principal(self) -> Principal:
        tenant = self.tenant or key_tenant(self.key.get_secret_value())
        return Principal(tenant=tenant, role=self.role, cache_group=self.cache_group)


class Keyring:
    """The accepted keys, each to its `Principal`; a token is compared in constant time
    against every key."""

    def __init__(self, entries: list[ApiKey]) -> None:
        self._keys = [(e.key.get_secret_value().encode(), e.principal()) for e in entries]
        seen: set[bytes] = set()
        for key, _ in self._keys:
            if key in seen:
                raise ValueError(f"an API key is listed twice ({masked(key.decode())}): "
                                 f"{KEY_SETTINGS} must list each key once")  # fmt: skip
            seen.add(key)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def principal(self, token: str) -> Principal | None:
        """The caller ``token`` stands for; None if it is no key."""
        found = None
        raw = token.encode()
        for key, principal in self._keys:  # no early exit: the time says nothing of which
            if hmac.compare_digest(raw, key):
                found = principal
        return found
