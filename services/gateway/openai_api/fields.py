"""The field types the API's request bodies share (chat and completions here, the
Responses API's and Anthropic's Messages too): strict integers that take an integral
float, token ids and counts, non-empty text, the cache salt, the prompt cache key, the
priority and the timeout, and `Body`, their base model."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from radixserve.protocol.messages import MAX_PRIORITY


def _integral(value: object) -> object:
    """JSON Schema's integers include 2.0: take an integral float as that int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
TOKEN_ID = Annotated[Int, Field(ge=0, le=2**31 - 1)]
TOKEN_COUNT = Annotated[Int, Field(ge=0, le=2**31 - 1)]
Text = Annotated[str, Field(min_length=1)]

MAX_CACHE_SALT_CHARS = 256

#: vLLM's ``cache_salt``: narrows KV sharing inside the caller's tenant (strict str: a
#: lone surrogate, which has no UTF-8 form to hash, is refused as invalid)
CacheSalt = Annotated[
    Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None,
    Field(
        description="Only requests with the same salt share cached KV (the prompt's "
        "prefix cache), inside the caller's tenant: a salt never reaches another tenant's "
        "cache. cached_tokens then counts only what requests with this salt computed.",
    ),
]
#: OpenAI's ``prompt_cache_key``: a routing hint, never what is cached or returned
PromptCacheKey = Annotated[
    str | None,
    Field(
        max_length=256,
        description="A routing hint: requests of one tenant with the same key go to the "
        "same decode worker while it is not overloaded, so a conversation's parallel "
        "requests find each other's cached prefix. It changes neither what is cached nor "
        "the output; who may share KV is set by the tenant and cache_salt.",
    ),
]


#: vLLM's ``priority``: where the request waits in the engines' queues
Priority = Annotated[
    Int | None,
    Field(
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="Lower is sooner: the engines admit every waiting request of a lower "
        "value first, whatever its tenant (tenants share each priority by their weights). "
        "Default: the API key's class (0 without keys); a user key may ask only for its "
        "class or higher, an admin key for any (403 otherwise).",
    ),
]

#: a request's deadline, in seconds from its arrival
RequestTimeout = Annotated[
    float | None,
    Field(
        gt=0,
        description="Seconds the request may take from its arrival (at most the "
        "gateway's max_request_timeout_s); past them it is aborted with a 408. The "
        "X-Request-Timeout header says the same.",
    ),
]


class Body(BaseModel):  # strict (no coercion); an unknown field is refused
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
