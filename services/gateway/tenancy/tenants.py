"""Who is asking: the tenant and role an API key stands for.

`Gateway.authorize(request)` returns the caller's `Principal`; every route that stores or
reads state (stored responses, the request log, traces, the explorer) scopes it by
``principal.tenant``, operator routes require ``principal.is_admin``, and the KV cache
scope of a request is ``principal.cache_scope(salt)``.

API keys are configured as entries (`ApiKey`, from ``RADIXSERVE_GATEWAY_API_KEYS`` and
the key file): a bare key string is its own tenant (named by a digest of the key, never
the key) with role ``user``; an object names its tenant, role, shared cache group and
rate limits (`TenantLimits`). Several keys of one tenant see the same stored responses,
share its cache and its limits. Keys are `SecretStr`: they print masked wherever settings
are printed or logged.

Scheduling classes (`Principal.share`, carried to the engines' fair share,
`radixserve.engine.fair_share`): an entry's ``priority`` (default 0; lower = sooner) is
its key's class and the default of its requests; a request's ``priority`` may only be
equal or higher (less urgent) unless the key is an admin's, which may send any. An
entry's ``weight`` (default 1) is its tenant's share of the engines' running slots and
prefill tokens, relative to other tenants'. The engines see a digest of the tenant
(`Principal.tenant_id`), never its name or a key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from radixserve.cache.block_hash import cache_scope
from radixserve.engine.fair_share import TenantShare
from radixserve.protocol.messages import MAX_PRIORITY, MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT
from radixserve.protocol.security import is_placeholder
from radixserve.services.gateway.server.errors import OpenAIError

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
    priority: int = 0  # its key's scheduling class: its requests' default and most urgent
    weight: float = 1.0  # its tenant's share of the engines' slots and prefill tokens

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def tenant_id(self) -> str:
        """The tenant as the engines see it: a short digest ("" for `DEFAULT_TENANT`)."""
        if self.tenant == DEFAULT_TENANT:
            return ""
        return hashlib.sha256(b"radixserve share\x00" + self.tenant.encode()).hexdigest()[:16]

    def share(self, priority: int | None) -> TenantShare:
        """This caller's request's place in the engines' schedule, asking for
        ``priority`` (None: its key's class). A user key may not ask for a lower (more
        urgent) value than its key entry's ``priority``: 403 naming the field."""
        if priority is None:
            priority = self.priority
        elif priority < self.priority and not self.is_admin:
            raise OpenAIError(
                403,
                f"priority {priority} is more urgent than this key's class ({self.priority}): "
                f"a request may ask for {self.priority} or more; lower values need an admin "
                "key or a key entry with that priority",
                "priority",
            )
        return TenantShare(self.tenant_id, priority, self.weight)

    def cache_scope(self, salt: str = "") -> str:
        """The KV scope of this caller's request with ``cache_salt`` ``salt``: its tenant
        (or its shared group), narrowed by the salt (`radixserve.cache.block_hash.cache_scope`)."""
        return cache_scope(tenant=self.tenant, group=self.cache_group, salt=salt)

    def owns(self, tenant: str) -> bool:
        """Whether this caller may see state stored by ``tenant`` (its own; admins: all)."""
        return self.is_admin or tenant == self.tenant


#: The caller when no API keys are configured: one tenant, every route open, as before.
ANONYMOUS = Principal()

#: the rate limits a key entry may set, by name
LIMIT_FIELDS = ("tokens_per_minute", "requests_per_minute")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's rate limits (None: unlimited), shared by all its keys; enforced by
    `admission.Admission`."""

    tokens_per_minute: int | None = None  # charged work (`admission.work_of`) a minute
    requests_per_minute: int | None = None


def key_tenant(key: str) -> str:
    """The tenant of a bare key: a digest of it (stable across restarts, not the key)."""
    return "key:" + hashlib.sha256(b"radixserve tenant\x00" + key.encode()).hexdigest()[:16]


def masked(key: str) -> str:
    """How a key is shown in messages: its length and the first characters of its digest."""
    return f"<key of {len(key)} chars, sha256 {hashlib.sha256(key.encode()).hexdigest()[:8]}>"


class ApiKey(BaseModel):
    """One accepted API key: a bare string, or ``{"key", "tenant", "role", "cache_group",
    "tokens_per_minute", "requests_per_minute", "priority", "weight"}`` (any other field is
    refused by name)."""

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
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=1 << 40,
        strict=True,
        description="The tenant's work a minute: each request is charged its prompt tokens "
        "plus choices x max_tokens (a token bucket of this size, refilled evenly); one "
        "request over it gets 429 with Retry-After, one bigger than it a 400. None: no limit.",
    )
    requests_per_minute: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        strict=True,
        description="The tenant's generation requests a minute (a token bucket of this "
        "size, refilled evenly); past it 429 with Retry-After. None: no limit.",
    )
    priority: int = Field(
        0,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        strict=True,
        description="The key's scheduling class: its requests' default priority (lower = "
        "sooner in the engines' queues) and the most urgent one it may ask for; an admin "
        "key may ask for any.",
    )
    weight: float | None = Field(
        None,
        ge=MIN_TENANT_WEIGHT,
        le=MAX_TENANT_WEIGHT,
        description="The tenant's share of the engines' running slots and prefill tokens, "
        "relative to other tenants' (None: 1).",
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
        return Principal(tenant=tenant, role=self.role, cache_group=self.cache_group,
                         priority=self.priority, weight=self.weight or 1.0)  # fmt: skip

    def limits(self) -> TenantLimits:
        return TenantLimits(self.tokens_per_minute, self.requests_per_minute)


class Keyring:
    """The accepted keys, each to its `Principal`; a token is compared in constant time
    against every key. A limit set on any entry of a tenant is the tenant's (all its keys
    together), and so is a weight; two entries of one tenant that set one limit or weight
    differently are refused."""

    def __init__(self, entries: list[ApiKey]) -> None:
        weights = _weights(entries)
        self._keys = [
            (e.key.get_secret_value().encode(), replace(p, weight=weights.get(p.tenant, 1.0)))
            for e in entries
            for p in [e.principal()]
        ]
        seen: set[bytes] = set()
        for key, _ in self._keys:
            if key in seen:
                raise ValueError(f"an API key is listed twice ({masked(key.decode())}): "
                                 f"{KEY_SETTINGS} must list each key once")  # fmt: skip
            seen.add(key)
        self.limits: dict[str, TenantLimits] = {}  # tenant -> its limits (every tenant)
        for entry in entries:
            tenant = entry.principal().tenant
            self.limits[tenant] = _merged(tenant, self.limits.get(tenant), entry.limits())

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


def _merged(tenant: str, known: TenantLimits | None, entry: TenantLimits) -> TenantLimits:
    """``tenant``'s limits with one more of its entries' (ValueError if they differ)."""
    if known is None:
        return entry
    values = {}
    for name in LIMIT_FIELDS:
        a, b = getattr(known, name), getattr(entry, name)
        if a is not None and b is not None and a != b:
            raise ValueError(f"the key entries of tenant {tenant} set {name} to {a} and {b} "
                             f"({KEY_SETTINGS}): a tenant has one limit, set it once")  # fmt: skip
        values[name] = a if a is not None else b
    return TenantLimits(**values)


def _weights(entries: list[ApiKey]) -> dict[str, float]:
    """The weight each tenant's entries set, if they set one (ValueError if they differ)."""
    weights: dict[str, float] = {}
    for entry in entries:
        tenant = entry.principal().tenant
        known = weights.get(tenant)
        if entry.weight is not None and known is not None and not math.isclose(known, entry.weight):
            raise ValueError(f"the key entries of tenant {tenant} set weight to {known} and "
                             f"{entry.weight} ({KEY_SETTINGS}): a tenant has one weight, set it "
                             "once")  # fmt: skip
        if entry.weight is not None:
            weights[tenant] = entry.weight
    return weights
