"""`radixserve chat`: an interactive terminal chat on the engine.

Each turn re-sends the whole conversation; the radix cache finds the previous turns'
KV, so only the new message is computed. The stats line after each answer shows it.
"""

from __future__ import annotations

import sys

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import RequestError
from radixserve.settings import EngineSettings

HELP = "commands: /reset clears the conversation, /exit quits (or Ctrl-D); Ctrl-C stops an answer"


def run_chat(settings: EngineSettings, params: SamplingParams, system: str | None = None) -> int:
    print(f"loading {settings.model} ...", file=sys.stderr)
    engine = Engine(settings)
    print(f"radixserve chat — {engine.config.name}. {HELP}", file=sys.stderr)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("\n> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = messages[:1] if system else []
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        answer = _answer(engine, engine.chat_prompt_ids(messages), params)
        messages.append({"role": "assistant", "content": answer})


def _answer(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
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
