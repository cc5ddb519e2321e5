"""The `radixserve` command line: generate, chat, serve (OpenAI HTTP API), bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from radixserve.errors import RadixServeError, RequestError
from radixserve.logging import setup_logging


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-gib", type=float, dest="kv_cache_memory_gib")
    g.add_argument("--page-size", type=int)
    g.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache", default=None)
    g.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_settings(args: argparse.Namespace):
    from radixserve.settings import EngineSettings

    keys = ("model", "device", "dtype", "kv_cache_memory_gib", "page_size", "prefix_cache")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    return EngineSettings(**overrides)


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


def cmd_generate(args: argparse.Namespace) -> int:
    from radixserve.engine.engine import Engine

    params = build_params(args)  # validate before the (slow) model load
    engine = Engine(build_settings(args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.chat_prompt_ids([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, params)
    token_ids: list[int] = []
    text = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            token_ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    assert final is not None
    if args.json:
        record = {
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": final.prompt_tokens,
            "cached_tokens": final.cached_tokens,
            "ttft_ms": round(final.ttft_ms or 0.0, 3),
            "finish_reason": final.finish_reason,
        }
        print(json.dumps(record))
    else:
        print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive terminal chat. Each turn re-sends the whole conversation; the radix
    cache finds the previous turns' KV, so only the new message is computed — the stats
    line after each answer shows it."""
    from radixserve.engine.engine import Engine

    params = build_params(args)
    settings = build_settings(args)
    print(f"loading {settings.model} ...", file=sys.stderr)
    engine = Engine(settings)
    print(f"radixserve chat — {engine.config.name}. {CHAT_HELP}", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
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
            answer = _chat_answer(engine, engine.chat_prompt_ids(messages), params)
            messages.append({"role": "assistant", "content": answer})


CHAT_HELP = (
    "commands: /reset clears the conversation, /exit quits (or Ctrl-D); Ctrl-C stops an answer"
)


def _chat_answer(engine, prompt: list[int], params) -> str:
    try:
        rid = engine.add_request(prompt, params)
    except RequestError as exc:
        print(f"error: {exc} (try /reset)", file=sys.stderr)
        return ""
    parts: list[str] = []
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                parts.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    print(
                        f"\n[{out.prompt_tokens} prompt tokens, {out.cached_tokens} cached, "
                        f"{out.completion_tokens} generated, TTFT {out.ttft_ms:.0f} ms]",
                        file=sys.stderr,
                    )
    except KeyboardInterrupt:
        engine.abort(rid)
        print("\n(stopped)", file=sys.stderr)
    return "".join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.scenario == "engine":
        from radixserve.bench.engine_ttft import run_engine_bench

        return run_engine_bench(build_settings(args), out_path=args.out, quick=args.quick)
    print(f"error: unknown scenario {args.scenario!r}", file=sys.stderr)
    return 2


def cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import Engine
    from radixserve.services.gateway import GatewaySettings, LocalEngineClient, serve

    keys = ("host", "port", "max_queued_requests", "served_model_name", "api_keys")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    gateway_settings = GatewaySettings(**overrides)  # validate before the (slow) model load
    client = LocalEngineClient(AsyncEngine(Engine(build_settings(args))))
    print(
        f"radixserve: serving {client.model_name} on "
        f"http://{gateway_settings.host}:{gateway_settings.port}/v1",
        flush=True,
    )
    serve(client, gateway_settings)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive terminal chat on the engine")
    chat.add_argument("--system", help="system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="run a benchmark scenario")
    bench.add_argument("--scenario", default="engine", choices=["engine"])
    bench.add_argument("--out", help="write results as JSON to this file")
    bench.add_argument("--quick", action="store_true", help="smaller contexts (a smoke run)")
    _engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP gateway on the engine")
    srv.add_argument("--host", help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="listen port (default 8000)")
    srv.add_argument(
        "--api-key", action="append", dest="api_keys", help="accepted key (repeatable)"
    )
    srv.add_argument("--max-queued-requests", type=int, help="in-flight bound; more get 429")
    srv.add_argument("--served-model-name", help="model name clients send (alias: default)")
    _engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", None))
    try:
        return args.func(args)
    except RadixServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"error: invalid setting: {problems}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
