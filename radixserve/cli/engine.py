"""Engine commands: generate, chat (on an engine in this process) and serve (the HTTP
gateway on one), and the engine flags every command that starts engines shares."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from radixserve.errors import RequestError

QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")

# the engine flags' `EngineSettings` fields (each read from RADIXSERVE_<FIELD> by the services)
_ENGINE_FIELDS = ("model", "device", "dtype", "quantization", "kv_cache_memory_gib",
                  "page_size", "prefix_cache", "tp", "audit_sample_rate",
                  "audit_fail_closed", "speculative_method",
                  "speculative_max_draft_tokens")  # fmt: skip
# the LoRA flags' fields (`radixserve serve`; `radixserve up` gives them to every worker)
_LORA_FIELDS = ("lora_modules", "max_loras", "max_lora_rank")


def engine_args(p: argparse.ArgumentParser, quantization: bool = True, tp: bool = True) -> None:
    g = p.add_argument_group("engine")
    if tp:  # one engine's own (the cluster's workers take none yet)
        g.add_argument("--tp", type=int, help="tensor-parallel size: ranks (processes, one "
                       "device each) this engine's model is split over (default 1)")  # fmt: skip
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    if quantization:  # bench has its own (a list for --scenario perplexity)
        g.add_argument("--quantization", choices=QUANTIZATIONS,
                       help="weight storage: auto keeps a GGUF's quantization where this "
                       "device has a kernel (default), none is the compute dtype")  # fmt: skip
    g.add_argument("--kv-cache-gib", type=float, dest="kv_cache_memory_gib")
    g.add_argument("--page-size", type=int)
    g.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache", default=None)
    g.add_argument("--audit-sample-rate", type=_fraction, metavar="RATE",
                   help="cache audit: recompute this fraction of cache hits without the "
                   "cache when idle and compare their logits (default 0: off)")  # fmt: skip
    g.add_argument("--audit-fail-closed", action="store_true", default=None,
                   help="cache audit: after a mismatch serve nothing from the cache until "
                   "POST /debug/cache/audit/clear")  # fmt: skip
    g.add_argument("--speculative-method", choices=["off", "prompt", "radix", "both"],
                   help="draft tokens from the request's own text (prompt), from the text "
                   "this engine has cached (radix) or both, verified exactly each step "
                   "(default off)")  # fmt: skip
    g.add_argument(
        "--speculative-max-draft-tokens",
        type=int,
        metavar="K",
        help="the most draft tokens a request verifies in a step (default 8)",
    )
    g.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default)")


def _fraction(text: str) -> float:
    """A number in [0, 1], or argparse's error naming the flag."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number between 0 and 1")
    return value


TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "gpt_oss")


def auth_args(p: argparse.ArgumentParser) -> None:
    """Who may call the gateway: `radixserve serve`, `up` and `gateway`."""
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="file of accepted API keys (RADIXSERVE_GATEWAY_API_KEYS_FILE): a JSON "
                   'list of keys or {"key", "tenant", "role", "cache_group"} entries, or one '
                   "key per line")  # fmt: skip
    p.add_argument("--allow-unauthenticated", action="store_true", default=None,
                   help="serve a non-loopback --host with no API keys (anyone who reaches it "
                   "may use every route); without it such a gateway refuses to start")  # fmt: skip


def gateway_args(p: argparse.ArgumentParser) -> None:
    """The gateway's own flags, the same on `radixserve serve` and `radixserve up`."""
    auth_args(p)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model ids clients may send (default: from the checkpoint's name)",
    )
    p.add_argument(
        "--tool-parser",
        choices=TOOL_PARSERS,
        help="how tool calls are found in replies (default auto: from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="how a reply's reasoning is split from its answer (reasoning_content): qwen3 "
        "<think>...</think>, deepseek_r1 (reasoning until </think>), gpt_oss (harmony), none "
        "(default auto: from the chat template)",
    )
    p.add_argument(
        "--response-store-size",
        type=int,
        help="Responses API: most stored responses, the oldest evicted first "
        "(default 1024; 0 = none)",
    )
    p.add_argument(
        "--response-store-ttl-s",
        type=float,
        help="Responses API: seconds a stored response is kept (default 3600)",
    )
    p.add_argument(
        "--explorer-prompt-text",
        action="store_true",
        default=None,
        help="the /explorer page shows the first words of cached prefixes "
        "(default: token counts only, no prompt text)",
    )
    p.add_argument("--trace-buffer", type=int,
                   help="traces of the last requests the gateway keeps in memory for "
                   "/debug/traces and /explorer (default 512; 0 = none)")  # fmt: skip
    p.add_argument("--allow-runtime-lora", action="store_true", default=None,
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and "
                   "unload LoRA adapters at run time (admin keys; needs --lora-dir)")  # fmt: skip
    p.add_argument("--lora-dir", type=Path,
                   help="the directory run-time adapter loads may read from (paths outside "
                   "it, symbolic links included, are refused)")  # fmt: skip
    p.add_argument("--lora-load-on-demand", action="store_true", default=None,
                   help="a request whose model names an adapter directory in --lora-dir "
                   "loads it first (any caller; needs --allow-runtime-lora)")  # fmt: skip


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_env(
    args: argparse.Namespace, keys: tuple[str, ...] = (*_ENGINE_FIELDS, "log_level")
) -> dict[str, str]:
    """The engine flags given (of ``keys``) as the ``RADIXSERVE_*`` environment of the
    processes a command starts (`radixserve up`, the cluster benchmarks)."""
    env: dict[str, str] = {}
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            env[f"RADIXSERVE_{key.upper()}"] = (
                str(value).lower() if isinstance(value, bool) else str(value)
            )
    return env


def build_settings(args: argparse.Namespace):
    from radixserve.settings import EngineSettings

    fields = (*_ENGINE_FIELDS, *_LORA_FIELDS)
    given = {k: getattr(args, k) for k in fields if getattr(args, k, None) is not None}
    return EngineSettings(**given)


def build_params(args: argparse.Namespace):
    from radixserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _front(settings):  # type: ignore[no-untyped-def]
    from radixserve.engine.async_engine import AsyncEngine

    return AsyncEngine(settings)  # the engine is built and steps on its own thread


def _stream(front, prompt, params, on_output) -> None:  # type: ignore[no-untyped-def]
    """Run one request to its end on ``front``, handing each output to ``on_output``;
    Ctrl-C aborts it (and raises KeyboardInterrupt)."""

    async def run() -> None:
        async for out in front.stream(prompt, params):
            on_output(out)

    asyncio.run(run())


def cmd_generate(args: argparse.Namespace) -> int:
    params = build_params(args)  # validate before the (slow) model load
    if not args.prompt:
        from radixserve.errors import InvalidRequestError

        raise InvalidRequestError("prompt is empty")
    front = _front(build_settings(args))
    try:
        prompt = args.prompt
        if args.chat:
            prompt = front.info.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        token_ids: list[int] = []
        text: list[str] = []
        final = []

        def take(out) -> None:  # type: ignore[no-untyped-def]
            token_ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final.append(out)

        _stream(front, prompt, params, take)
    finally:
        front.close()
    last = final[0]
    if args.json:
        record = {
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached.total,
            "ttft_ms": round(last.ttft_ms or 0.0, 3),
            "finish_reason": last.finish_reason,
        }
        print(json.dumps(record))
    else:
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive terminal chat. Each turn re-sends the whole conversation; the radix
    cache finds the previous turns' KV, so only the new message is computed — the stats
    line after each answer shows it."""
    params = build_params(args)
    settings = build_settings(args)
    print(f"loading {settings.model} ...", file=sys.stderr)
    front = _front(settings)
    print(f"radixserve chat — {front.info.model_name}. {CHAT_HELP}", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    try:
        while True:
            try:
                line = input("\n> ").strip()
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                messages = list(system)
                print("(conversation cleared)", file=sys.stderr)
            elif line:
                messages.append({"role": "user", "content": line})
                prompt = front.info.tokenizer.encode_chat(messages)
                messages.append(
                    {"role": "assistant", "content": _chat_answer(front, prompt, params)}
                )
    finally:
        front.close()


CHAT_HELP = (
    "commands: /reset clears the conversation, /exit quits (or Ctrl-D); Ctrl-C stops an answer"
)


def _chat_answer(front, prompt: list[int], params) -> str:  # type: ignore[no-untyped-def]
    parts: list[str] = []

    def take(out) -> None:  # type: ignore[no-untyped-def]
        parts.append(out.new_text)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            print(
                f"\n[{out.prompt_tokens} prompt tokens, {out.cached.total} cached, "
                f"{out.completion_tokens} generated, TTFT {out.ttft_ms:.0f} ms]",
                file=sys.stderr,
            )

    try:
        _stream(front, prompt, params, take)
    except RequestError as exc:
        print(f"error: {exc} (try /reset)", file=sys.stderr)
    except KeyboardInterrupt:  # the stream was aborted on its way out
        print("\n(stopped)", file=sys.stderr)
    return "".join(parts)


def cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.services.gateway import GatewaySettings, LocalEngineClient, serve

    keys = ("host", "port", "max_queued_requests", "api_keys", "tool_parser",
            "reasoning_parser", "response_store_size", "response_store_ttl_s",
            "explorer_prompt_text", "trace_buffer", "api_key_file",
            "allow_unauthenticated", "allow_runtime_lora", "lora_dir",
            "lora_load_on_demand")  # fmt: skip
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if args.served_model_name:
        overrides["served_model_name"] = ",".join(args.served_model_name)
    gateway_settings = GatewaySettings(**overrides)  # validate before the (slow) model load
    gateway_settings.require_secure()
    engine_settings = build_settings(args)
    client = LocalEngineClient(AsyncEngine(engine_settings))  # built on its thread
    print(
        f"radixserve: serving {client.model_name} on "
        f"http://{gateway_settings.host}:{gateway_settings.port}/v1",
        flush=True,
    )
    serve(client, gateway_settings)
    return 0


def add_commands(sub: Any) -> None:
    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    engine_args(gen)
    sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive terminal chat on the engine")
    chat.add_argument("--system", help="system prompt")
    engine_args(chat)
    sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP gateway on the engine")
    srv.add_argument("--host", help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="listen port (default 8000)")
    srv.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        help="accepted key, 16+ characters, a tenant of its own with role user (repeatable; "
        "tenants and admin keys: --api-key-file or RADIXSERVE_GATEWAY_API_KEYS)",
    )
    srv.add_argument("--max-queued-requests", type=int, help="in-flight bound; more get 429")
    gateway_args(srv)
    engine_args(srv)
    lora_args(srv)
    srv.set_defaults(func=cmd_serve)


def lora_env(args: argparse.Namespace) -> dict[str, str]:
    """The LoRA flags given, as the ``RADIXSERVE_*`` environment of every worker."""
    env = engine_env(args, ("max_loras", "max_lora_rank"))
    if getattr(args, "lora_modules", None):
        env["RADIXSERVE_LORA_MODULES"] = json.dumps(list(args.lora_modules))
    return env


def lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA adapters an engine serves (`radixserve serve`)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="PEFT LoRA adapter directories served beside the base model, each "
                   "under a name requests give")  # fmt: skip
    g.add_argument("--max-loras", type=int, metavar="N",
                   help="adapters resident on the device at once (default 4)")  # fmt: skip
    g.add_argument(
        "--max-lora-rank",
        type=int,
        metavar="R",
        help="the largest adapter rank served; higher ones are refused (default 64)",
    )
