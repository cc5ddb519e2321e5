"""Reference answers for the chaos benchmark: one in-process `Engine`, greedy.

Disaggregated serving is exact by design (the prefill worker's KV is the KV the decode
worker would have computed), so a cluster's greedy answer must equal what a single
process answers to the same prompt token ids; any difference is a wrong answer.
`ReferenceAnswers` builds the engine on a thread of its own (while the cluster starts)
and runs it there while the load runs: each submitted (prompt ids, max_tokens) is
answered once, prompts joining the engine's running batch as they arrive, so at the
end only the last few are left.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], int]  # (prompt token ids, max_tokens)


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    completion_tokens: int


class ReferenceAnswers:
    """Greedy answers of the engine ``build`` makes, on a background thread (started
    here, building it first)."""

    def __init__(self, build: Callable[[], Engine]) -> None:
        self._build = build
        self._engine: Engine | None = None
        self._built = threading.Event()
        self._todo: queue.Queue[Key | None] = queue.Queue()
        self._answers: dict[Key, Answer] = {}
        self._asked: set[Key] = set()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-reference", daemon=True)
        self._thread.start()

    def engine(self, timeout_s: float = 600) -> Engine:
        """The engine, once built (its tokenizer and chat template give prompt ids)."""
        if not self._built.wait(timeout_s) or self._engine is None:
            raise RuntimeError("the reference engine could not be built") from self._failure
        return self._engine

    def submit(self, prompt_ids: list[int], max_tokens: int) -> Key:
        """Ask for the answer to ``prompt_ids`` (once per distinct prompt); its key."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._asked:
            self._asked.add(key)
            self._todo.put(key)
        return key

    def progress(self) -> dict[str, int]:
        """Prompts asked for and answered so far (read from the caller's thread)."""
        return {"asked": len(self._asked), "answered": len(self._answers)}

    def step_counters(self) -> dict[str, int | float]:
        """The reference engine's `StepStats` (empty until it is built)."""
        return self._engine.step_stats.as_dict() if self._engine is not None else {}

    def finish(self, timeout_s: float) -> dict[Key, Answer]:
        """Wait until every submitted prompt is answered; every answer. Raises what the
        engine raised, or `TimeoutError`."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        if self._failure is not None:
            raise RuntimeError("the reference engine failed") from self._failure
        if self._thread.is_alive():
            raise TimeoutError(f"reference answers not done after {timeout_s:g} s")
        return dict(self._answers)

    def _run(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as exc:
            logger.exception("reference engine failed to load")
            self._failure = exc
            return
        finally:
            self._built.set()
        try:
            self._serve()
        except BaseException as exc:  # handed to finish()
            logger.exception("reference engine failed")
            self._failure = exc

    def _serve(self) -> None:
        """Add what arrives between steps and step while anything runs (one continuous
        batch, whatever each prompt's max_tokens); the answer is the concatenated text
        deltas, as a stream delivers them."""
        engine = self._engine
        assert engine is not None
        running: dict[str, Key] = {}
        parts: dict[str, list[str]] = {}
        closing = False
        while running or not closing:
            arrived = [] if running or closing else [self._todo.get()]
            while not self._todo.empty():
                arrived.append(self._todo.get_nowait())
            closing = closing or None in arrived
            for key in (k for k in arrived if k is not None):
                params = SamplingParams(max_tokens=key[1], temperature=0.0)
                rid = engine.add_request(list(key[0]), params)
                running[rid], parts[rid] = key, []
            for out in engine.step() if running else []:
                if out.request_id not in running:
                    continue
                parts[out.request_id].append(out.new_text)
                if out.finished:
                    key = running.pop(out.request_id)
                    text = "".join(parts.pop(out.request_id))
                    reason = out.finish_reason or "stop"
                    self._answers[key] = Answer(text, reason, out.completion_tokens)
