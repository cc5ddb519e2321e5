"""The LoRA scenario's one-request measurements (`bench/lora.py`): cached chat turns per
adapter with the cross-check that adapters never share KV (`measure_chat`), and the
cost of bringing an adapter to the device (`measure_swaps`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixserve.bench.synthetic import synthetic_ids
from radixserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.bench.lora_engine import LoraOptions, Stream
    from radixserve.engine.engine import Engine

#: the chat's questions, one per turn (past the last: numbered follow-ups)
QUESTIONS = (
    "Summarize these notes in one sentence.",
    "Which three words come up most often in them?",
    "Write a short title for the notes.",
)


#: the prompt whose answers show that each adapter changes the model (`measure_divergence`)
OPEN_PROMPT = "Write a short story about a lighthouse keeper and a storm."


def run_one(engine: Engine, prompt: list[int], adapter: str, max_tokens: int,
            min_tokens: int = 0) -> Stream:  # fmt: skip
    """One request alone, greedy, to its end (not before ``min_tokens``)."""
    from radixserve.bench.lora_engine import run_batch

    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.0,
                            ignore_eos=min_tokens > 0)  # fmt: skip
    [stream], _ = run_batch(engine, [(prompt, adapter)], params)
    return stream


def measure_divergence(engine: Engine, names: Sequence[str], tokens: int) -> dict[str, Any]:
    """`OPEN_PROMPT` answered by the base model and each adapter of ``names`` (``tokens``
    each, greedy): where each adapter's answer first departs from the base model's
    (None: the same tokens) and its text, to read that it is still language."""
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": OPEN_PROMPT}])
    base = run_one(engine, prompt, "", tokens, tokens)
    rows = []
    for adapter in names:
        answer = run_one(engine, prompt, adapter, tokens, tokens)
        pairs = zip(answer.token_ids, base.token_ids)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        rows.append({"adapter": adapter, "first_different_token": first, "text": answer.text})
    return {"prompt": OPEN_PROMPT, "tokens": tokens, "base_text": base.text, "adapters": rows}


def _turn_row(turn: int, stream: Stream) -> dict[str, Any]:
    return {"turn": turn + 1, "prompt_tokens": stream.prompt_tokens,
            "cached_tokens": stream.cached_tokens, "ttft_ms": stream.ttft_ms,
            "answer_tokens": len(stream.token_ids)}  # fmt: skip


def measure_chat(engine: Engine, options: LoraOptions, names: Sequence[str]) -> dict[str, Any]:
    """A chat of ``options.chat_turns`` turns with the base model and with each adapter of
    ``names`` (each its own notes), turn by turn across them, one request at a time; then
    the first adapter's next prompt given to the second adapter, the base model and the
    first adapter itself (cached tokens: 0, 0, most of it)."""
    tokenizer = engine.tokenizer
    histories: dict[str, list[dict[str, str]]] = {}
    for i, adapter in enumerate(["", *names]):
        notes = tokenizer.decode(synthetic_ids(tokenizer, options.chat_context_tokens,
                                               options.seed * 100 + 50 + i))  # fmt: skip
        histories[adapter] = [{"role": "system", "content": "Notes: " + notes}]
    rows: dict[str, list[dict[str, Any]]] = {adapter: [] for adapter in histories}
    for turn in range(options.chat_turns):
        question = QUESTIONS[turn] if turn < len(QUESTIONS) else f"Follow-up {turn}: say more."
        for adapter, history in histories.items():
            history.append({"role": "user", "content": question})
            stream = run_one(engine, tokenizer.encode_chat(history), adapter,
                             options.chat_answer_tokens)  # fmt: skip
            history.append({"role": "assistant", "content": stream.text})
            rows[adapter].append(_turn_row(turn, stream))
    first, second = names[0], names[1]
    ask = {"role": "user", "content": "Now write a short story that uses these notes."}
    prompt = tokenizer.encode_chat([*histories[first], ask])
    cross = []
    for adapter in (second, "", first):  # the owner last: the others run on its prompt first
        stream = run_one(engine, prompt, adapter, options.chat_answer_tokens)
        cross.append({"prompt_of": first, "adapter": adapter, "prompt_tokens": stream.prompt_tokens,
                      "cached_tokens": stream.cached_tokens, "ttft_ms": stream.ttft_ms})  # fmt: skip
    return {"conversations": [{"adapter": a, "turns": r} for a, r in rows.items()],
            "cross_check": cross}  # fmt: skip


def _timed(engine: Engine, prompt: list[int], adapter: str) -> dict[str, Any]:
    """A one-token request's wall time (its one step: prefill and the first token), TTFT
    and the copies into device slots it caused."""
    loads = engine.loras.num_loads
    started = time.perf_counter()
    stream = run_one(engine, prompt, adapter, 1)
    wall_ms = (time.perf_counter() - started) * 1e3
    return {"adapter": adapter, "step_ms": wall_ms, "ttft_ms": stream.ttft_ms,
            "copies": engine.loras.num_loads - loads}  # fmt: skip


def measure_swaps(engine: Engine, options: LoraOptions, folder: Path,
                  names: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """Per repeat, every slot held: `load_lora` of a fresh adapter (disk → host), a
    request with it (its first use: it evicts the least recently used adapter), one with
    an adapter already resident, and one with the adapter just evicted (back to the
    device), and one with the base model; then the copy into a slot alone
    (`LoraManager.batch` of an evicted adapter)."""
    from radixserve.bench.lora_engine import make_adapters

    loras = engine.loras
    fresh = [f"fresh-{i:02d}" for i in range(options.swap_repeats)]
    load_s = make_adapters(engine, folder, fresh, options, options.seed * 1000 + 500)
    held = [(synthetic_ids(engine.tokenizer, 8, 7000 + i), n)
            for i, n in enumerate(names[: loras.max_loras])]  # fmt: skip
    from radixserve.bench.lora_engine import run_batch

    run_batch(engine, held, SamplingParams(max_tokens=1, temperature=0.0))  # every slot held
    rows: dict[str, list[dict[str, Any]]] = {"first_use": [], "resident": [], "returning": [],
                                             "base": []}  # fmt: skip
    for i, name in enumerate(fresh):
        prompts = [synthetic_ids(engine.tokenizer, options.prompt_tokens, 8000 + 10 * i + k)
                   for k in range(4)]  # fmt: skip
        victim = next(iter(loras.resident))  # the least recently used: the one evicted next
        rows["first_use"].append(_timed(engine, prompts[0], name))
        rows["first_use"][-1]["evicted"] = victim if victim not in loras.resident else None
        rows["resident"].append(_timed(engine, prompts[1], next(iter(loras.resident))))
        rows["returning"].append(_timed(engine, prompts[2], victim))
        rows["base"].append(_timed(engine, prompts[3], ""))  # the same step without an adapter
    copy_ms = []
    for _ in range(options.swap_repeats):
        name = next(n for n in loras.adapters if n not in loras.resident)
        started = time.perf_counter()
        with torch.inference_mode():  # as the runner calls it (the stacks are inference tensors)
            loras.batch([(name, 1)])
        copy_ms.append((time.perf_counter() - started) * 1e3)
    return {
        "slots": loras.max_loras,
        "prompt_tokens": options.prompt_tokens,
        "adapters_loaded": len(loras.adapters),
        "load_ms": [s * 1e3 for s in load_s],
        "copy_in_ms": copy_ms,
        "requests": rows,
        "median_ms": {
            "load": statistics.median(load_s) * 1e3,
            "copy_in": statistics.median(copy_ms),
            **{
                f"{kind}_step": statistics.median(r["step_ms"] for r in runs)
                for kind, runs in rows.items()
            },
        },  # fmt: skip
    }
