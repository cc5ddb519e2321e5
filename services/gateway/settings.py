"""Gateway settings: one pydantic-settings class, environment prefix ``RADIXSERVE_GATEWAY_``.

Built once by the entry point (``radixserve serve`` or ``python -m
radixserve.services.gateway``) and passed to `create_app`; never mutated.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from radixserve.engine.sampling_params import MAX_GUIDE_CHARS
from radixserve.protocol.security import InsecureBindError, dial_host, is_loopback, require_secret
from radixserve.runtime.settings import PeerSettings
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.tenancy.admission import Admission
from radixserve.services.gateway.tenancy.key_file import read_key_file
from radixserve.services.gateway.tenancy.tenants import ApiKey, Keyring


class GatewaySettings(PeerSettings):
    """How the OpenAI-compatible HTTP gateway listens, authenticates and bounds its load."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_GATEWAY_", frozen=True,
                                      extra="forbid", hide_input_in_errors=True)  # fmt: skip

    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="Listen address.")
    port: int = Field(8000, ge=0, le=65535, description="Listen port (0 = any free port).")
    listen_fd: int | None = Field(
        None,
        ge=0,
        description="A listening TCP socket inherited from the process that started this "
        "one (radixserve up's supervisor binds it and keeps it, so the port stays across "
        "restarts): served on instead of binding host:port.",
    )
    api_keys: list[ApiKey] = Field(
        default_factory=list,
        max_length=1024,
        description="Accepted `Authorization: Bearer` keys, from the environment as a JSON "
        'list: a bare key (16+ characters; a tenant of its own, role user) or {"key", '
        '"tenant", "role": "user" | "admin", "cache_group", "tokens_per_minute", '
        '"requests_per_minute"}; none here nor in '
        "api_key_file = no authentication (loopback only, unless allow_unauthenticated).",
    )
    api_key_file: Path | None = Field(
        None,
        validation_alias=AliasChoices("api_key_file", "RADIXSERVE_GATEWAY_API_KEYS_FILE"),
        description="A file of more keys (a mounted Secret): the same JSON list as api_keys, "
        "or one bare key per line ('#' starts a comment line). Read at start.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve on a non-loopback host with no API keys (anyone who reaches the "
        "port may use the API, /debug and /explorer); off, such a gateway refuses to start.",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Most sequences in flight (queued or running; each choice of each prompt "
        "of a request counts, as each is a sequence an engine decodes); more get 429 (a "
        "request with more than it: 400).",
    )
    max_queued_work_tokens: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 40,
        description="Most work in flight at the gateway, in tokens: each request is charged "
        "its prompt tokens plus choices x max_tokens, from admission until its response "
        "ends; more get 429, and a request bigger than it (or than its tenant's share) a "
        "400. The default is max_queued_requests' 256 requests of 4096 tokens each.",
    )
    tenant_work_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="With API keys naming two or more tenants, the fraction of "
        "max_queued_work_tokens and of max_queued_requests one tenant may hold at once "
        "(past it: 429 naming the share, while other tenants are admitted); a single "
        "tenant (no keys) may hold all of them.",
    )
    max_body_bytes: int = Field(
        8 << 20, ge=1024, le=1 << 30, description="Largest request body accepted; more get 413."
    )
    header_timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="A connection that has not sent a whole request head (request line and "
        "headers) this long after it opened, or after its last response, is closed.",
    )
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A request body not fully received this long after its headers gets "
        "408 and its connection is closed; nothing of it is admitted.",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="Most open HTTP connections; one more is answered 503 and closed at "
        "once (the open ones are served as before).",
    )
    max_header_bytes: int = Field(
        16384,
        ge=1024,
        le=1 << 20,
        description="Largest request head (request line and headers); more get 400.",
    )
    stream_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A response whose client has read none of it this long (the "
        "connection's send buffer stays full) is cut, and its request aborted: its slot, "
        "pages and locks are returned.",
    )
    stream_buffer_outputs: int = Field(
        1024,
        ge=16,
        le=1 << 20,
        description="Most engine outputs (one a step, per choice) a streamed request holds "
        "at the gateway, not yet written to its client, per prompt; a client that falls "
        "further behind has its request aborted (the engine does not wait for one reader).",
    )
    stream_ping_interval_s: float = Field(
        10.0,
        ge=0.001,
        le=600,
        description="A /v1/messages stream sends Anthropic's ping event after this many "
        "seconds without another event (a long prefill, a stalled worker), so clients and "
        "proxies see the connection alive.",
    )
    max_request_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86400,
        description="Longest deadline a request may set (the `timeout` body field or the "
        "X-Request-Timeout header, in seconds); longer is a 400. A request that sets none "
        "has no deadline.",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        pattern=r"^[^,\s]+(,[^,\s]+)*$",
        description="Model ids clients may send, comma-separated (the first is reported in "
        "responses; 'default' is always accepted too); None = derived from the checkpoint's "
        "file or directory name, e.g. SmolLM2-135M-Instruct.",
    )
    decode_workers: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="Control addresses (tcp://host:port) of decode workers to serve "
        "through, besides those the kvstore's membership lists; with neither this nor "
        "kvstore, an engine runs inside the gateway. From the environment as a JSON list.",
    )
    prefill_workers: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="Control addresses of prefill workers, besides those the kvstore's "
        "membership lists (for prefill routing and /metrics, /debug/cache). From the "
        "environment as a JSON list.",
    )
    kvstore: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Control address of the cluster's kvstore: where the gateway finds the "
        "workers (membership).",
    )
    kvstores: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Control addresses of every kvstore of a cluster with one per node: the "
        "gateway watches the membership of each, so losing one loses no worker. From the "
        "environment as a JSON list.",
    )
    max_migrations: int = Field(
        3,
        ge=0,
        le=16,
        description="Times one request may move to another decode worker when its worker "
        "dies or drains past its grace (the stream continues there, nothing lost or "
        "repeated); 0 = a lost worker fails its requests.",
    )
    migration_wait_s: float = Field(
        30.0,
        ge=0,
        le=600,
        description="How long a request whose decode worker was lost waits for another one "
        "to be up (e.g. the lost one's restart) before it fails.",
    )
    decode_load_weight: float = Field(
        4.0,
        ge=0,
        description="Decode routing: pages of cached prefix one in-flight request is worth "
        "(cost = uncached pages + weight * in-flight requests).",
    )
    max_choices_per_request: int = Field(
        256,
        ge=1,
        le=1 << 16,
        description="Most choices one request may generate (its prompts times n, or "
        "best_of); more get 400.",
    )
    default_max_tokens: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="Chat completions without max_tokens generate up to this many tokens "
        "(capped by the context left).",
    )
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How tool calls are found in a reply: hermes (<tool_call>{json}"
        '</tool_call>), llama3_json ({"name", "parameters"}), mistral ([TOOL_CALLS][...]); '
        "auto = the chat template's own format (hermes when it renders no tools).",
    )
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1", "gpt_oss"] = Field(
        "auto",
        description="How a reply's reasoning is split from its answer (chat's "
        "reasoning_content, the Responses API's reasoning items): qwen3 (a reply opening "
        "<think>...</think>), deepseek_r1 (reasoning until </think>), gpt_oss (the harmony "
        "analysis channel), none (all answer); auto = the chat template's own format "
        "(deepseek_r1 when its generation prompt ends in <think>, none without think markers).",
    )
    prepare_workers: int = Field(
        4,
        ge=1,
        le=64,
        description="Threads that prepare requests off the event loop (chat templates, "
        "tokenization, grammar compilation); more requests at once wait for one.",
    )
    prepare_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Most seconds one request's preparation may take (waiting for a "
        "worker included); past it the request gets a 400 naming the field being prepared "
        "(or a 429 if it never got a worker). The step itself cannot be interrupted: it "
        "finishes in the background, holding its worker, and its result is dropped.",
    )
    max_schema_bytes: int = Field(
        256 << 10,
        ge=1 << 10,
        le=MAX_GUIDE_CHARS,
        description="Largest JSON schema compiled for structured output (response_format, "
        "guided_json, text.format.schema, or a forced tool call's schema), in bytes as "
        "serialized; larger ones get a 400 before anything is compiled.",
    )
    max_tools: int = Field(
        128,
        ge=1,
        le=1024,
        description="Most tools one request may list (OpenAI's bound is 128); more get a 400.",
    )
    max_tool_parameters_bytes: int = Field(
        64 << 10,
        ge=1 << 10,
        le=MAX_GUIDE_CHARS,
        description="Largest parameters schema of one tool, in bytes as serialized; a larger "
        "one gets a 400 naming that tool.",
    )
    max_guided_choices: int = Field(
        256, ge=1, le=4096, description="Most alternatives in guided_choice; more get a 400."
    )
    max_guided_choice_chars: int = Field(
        1024,
        ge=1,
        le=1 << 16,
        description="Longest alternative of guided_choice, in characters; longer get a 400.",
    )
    max_guided_regex_chars: int = Field(
        4096,
        ge=16,
        le=MAX_GUIDE_CHARS,
        description="Longest guided_regex, in characters; longer get a 400.",
    )
    max_guided_grammar_chars: int = Field(
        65536,
        ge=16,
        le=MAX_GUIDE_CHARS,
        description="Longest guided_grammar (Lark), in characters; longer get a 400.",
    )
    response_store_size: int = Field(
        1024,
        ge=0,
        le=1 << 20,
        description="Responses API: most responses kept for GET /v1/responses/{id} and "
        "previous_response_id, the oldest evicted first; 0 = keep none. Each holds its "
        "conversation's new items (which fit the model's context).",
    )
    response_store_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=30 * 86400,
        description="Responses API: seconds a stored response is kept after it was made.",
    )
    explorer_prompt_text: bool = Field(
        False,
        description="The /explorer page shows the first words of each cached prefix's text; "
        "off, it shows token counts only and no prompt text leaves the workers.",
    )
    explorer_request_log_size: int = Field(
        512,
        ge=0,
        le=1 << 16,
        description="Recent requests the gateway keeps for /explorer (token counts, route, "
        "latencies, trace id; no text); 0 = none.",
    )
    autoscaler_url: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        pattern=r"^https?://",
        description="The autoscaler's HTTP address (its /health lists its recent decisions), "
        "shown on /explorer; None = no autoscaler.",
    )
    trace_buffer: int = Field(
        512,
        ge=0,
        le=1 << 16,
        description="Traces of the last requests kept in memory for /debug/traces and "
        "/explorer (their spans on the gateway and the workers; token counts, no text); "
        "0 = none kept, and with no OTEL_EXPORTER_OTLP_ENDPOINT either, tracing is off.",
    )

    allow_runtime_lora: bool = Field(
        False,
        description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) load and "
        "unload LoRA adapters on every engine at run time (admin keys only where keys are "
        "configured); off, both answer 403. Needs lora_dir. With lora_load_on_demand, a "
        "request naming an adapter directory in lora_dir loads it too.",
    )
    lora_dir: Path | None = Field(
        None,
        description="The directory run-time adapter loads may read from: a lora_path is "
        "resolved (relative paths against it, symbolic links followed) and refused unless it "
        "lies inside; with lora_load_on_demand, <lora_dir>/<model> is what a request's model "
        "names. The engines must see it at the same path.",
    )
    lora_load_on_demand: bool = Field(
        False,
        description="A request whose model names no served adapter but a directory "
        "<lora_dir>/<model> holding adapter_config.json loads it first on every engine, as "
        "/v1/load_lora_adapter does (same confinement and checks; concurrent requests for "
        "the same name share one load), then is served; off, such a request is a 404. Any "
        "caller may trigger a load, and an adapter unloaded while its directory stays is "
        "loaded again by the next request naming it. Needs allow_runtime_lora.",
    )

    @model_validator(mode="after")
    def _runtime_lora_has_a_dir(self) -> GatewaySettings:
        if self.allow_runtime_lora and self.lora_dir is None:
            raise ValueError("allow_runtime_lora needs lora_dir (RADIXSERVE_GATEWAY_LORA_DIR): "
                             "the directory adapters may be loaded from")  # fmt: skip
        if self.lora_load_on_demand and not self.allow_runtime_lora:
            raise ValueError("lora_load_on_demand needs allow_runtime_lora "
                             "(RADIXSERVE_GATEWAY_ALLOW_RUNTIME_LORA=true) and lora_dir")  # fmt: skip
        if self.lora_dir is not None and not self.lora_dir.is_dir():
            raise ValueError(f"lora_dir {str(self.lora_dir)!r} is not a directory")
        return self

    @model_validator(mode="after")
    def _check_kvstores(self) -> GatewaySettings:
        if len(set(self.kvstores)) != len(self.kvstores):
            raise ValueError(f"RADIXSERVE_GATEWAY_KVSTORES lists a kvstore twice: {self.kvstores}")
        return self

    def kvstore_list(self) -> list[str]:
        """Every kvstore whose membership the gateway watches: ``kvstores`` and ``kvstore``."""
        return list(dict.fromkeys([*([self.kvstore] if self.kvstore else []), *self.kvstores]))

    @field_validator("api_key_file")
    @classmethod
    def _key_file_reads(cls, path: Path | None) -> Path | None:
        read_key_file(path)  # refused here, by name, when it cannot be read or parsed
        return path

    @model_validator(mode="after")
    def _keys_load(self) -> GatewaySettings:
        Keyring(self.key_entries())  # a bad file or a key listed twice is refused here
        return self

    def key_entries(self) -> list[ApiKey]:
        """Every configured key: ``api_keys``, then those of ``api_key_file``."""
        return [*self.api_keys, *read_key_file(self.api_key_file)]

    def keyring(self) -> Keyring:
        return Keyring(self.key_entries())

    def admission(self, keys: Keyring) -> Admission:
        """The admission ledger for ``keys``' tenants (`admission`)."""
        return Admission(self.max_queued_work_tokens, self.max_queued_requests,
                         self.tenant_work_share, keys.limits)  # fmt: skip

    def prepare_limits(self) -> PrepareLimits:
        """The size caps checked before a request is prepared (`limits`): the settings of
        the same names."""
        return PrepareLimits(**{f.name: getattr(self, f.name) for f in fields(PrepareLimits)})

    def require_secure(self) -> None:
        """Refuse to serve beyond this machine unauthenticated: a non-loopback host needs
        API keys (or ``allow_unauthenticated``), and non-loopback cluster links the cluster
        secret (`radixserve.protocol.security.InsecureBindError`)."""
        if not is_loopback(self.host) and not self.allow_unauthenticated and not self.keyring():
            raise InsecureBindError(
                f"the gateway would serve {self.host}:{self.port} with no API keys: set "
                "RADIXSERVE_GATEWAY_API_KEYS (or --api-key-file / "
                "RADIXSERVE_GATEWAY_API_KEYS_FILE), or pass --allow-unauthenticated "
                "(RADIXSERVE_GATEWAY_ALLOW_UNAUTHENTICATED=true) to serve anyone who reaches it"
            )
        links = [a for a in (*self.kvstore_list(), *self.decode_workers, *self.prefill_workers)
                 if a and not is_loopback(dial_host(a))]  # fmt: skip
        require_secret(self.cluster_secret, links, "the gateway's cluster links")
