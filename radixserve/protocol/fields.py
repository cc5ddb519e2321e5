"""The wire protocol's shared limits and field specs: what `messages`, `host_messages`
and `view_messages` build their fields from."""

from __future__ import annotations

from typing import Literal, get_args

from radixserve.protocol.wire import (
    INT64_MAX,
    MAX_TOKENS_PER_MESSAGE,
    TOKEN_ID,
    BytesSpec,
    FloatSpec,
    HashesSpec,
    IntSpec,
    ListSpec,
    StatsSpec,
    StrSpec,
)

MAX_PAGE_ID = 2**31 - 1
MAX_PAGES_PER_MESSAGE = 1 << 20
MAX_ID_CHARS = 256
MAX_NAME_CHARS = 128
MAX_ERROR_CHARS = 4096
MAX_LOAD_STATS = 256
MAX_BLOB_BYTES = 1 << 20

Role = Literal["gateway", "prefill", "decode", "kvstore"]
ErrorType = Literal["invalid_request", "capacity", "internal", "timeout", "peer_lost", "draining"]
FinishReason = Literal["stop", "length", "abort"]
ROLES: frozenset[str] = frozenset(get_args(Role))
ERROR_TYPES: frozenset[str] = frozenset(get_args(ErrorType))
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))
ROUTES: frozenset[str] = frozenset({"", "local", "host", "remote"})  # `Admission.route`


COUNT = IntSpec()
REQUEST_ID = StrSpec(MAX_ID_CHARS, min_chars=1)
PEER_NAME = StrSpec(MAX_NAME_CHARS, min_chars=1)
ERROR_TEXT = StrSpec(MAX_ERROR_CHARS)
DURATION_MS = FloatSpec()
TOKEN_IDS = ListSpec(TOKEN_ID, MAX_TOKENS_PER_MESSAGE)
# whose KV a request may share (`radixserve.cache.block_hash.cache_scope`); "" = default
CACHE_SCOPE = StrSpec(1024)
PROMPT_IDS = ListSpec(TOKEN_ID, MAX_TOKENS_PER_MESSAGE, min_len=1)
PAGE_HASHES = HashesSpec(MAX_PAGES_PER_MESSAGE)  # 128-bit hashes, 16 bytes each
PARENT_HASH = HashesSpec(1)  # a page's parent: none (the first page) or one hash
NAMESPACE = BytesSpec(64)
ROLE = StrSpec(MAX_NAME_CHARS, choices=ROLES)
LOAD_STATS = StatsSpec(
    MAX_LOAD_STATS, StrSpec(MAX_NAME_CHARS, 1), IntSpec(-INT64_MAX), FloatSpec(-1e300, 1e300)
)
