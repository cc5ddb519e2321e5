"""The engine streams behind one HTTP request, merged, and its choices as OpenAI shapes.

`Generation` holds one engine stream per prompt of the request, started together (one
continuous batch in the engine), and yields their outputs in arrival order, so
streamed choices interleave by ``index`` as OpenAI's do. Closing it closes every
stream, which aborts what is unfinished in the engine.

Its pumps read the engine streams as fast as they come (the engine, and a cluster
client's link reader, never wait for one request's HTTP client), into one queue of at
most ``max_buffered`` outputs per prompt: a stream whose client falls further behind is
aborted (`ClientTooSlow`), not buffered without bound. `end` stops the request early,
for its deadline (`deadline.Deadline`) or its client's disconnect; `abort_reason` says
why it ended unfinished, for ``radixserve_gateway_aborted_requests_total``.

`ChoiceBook` accumulates each choice (text, tokens, log-probabilities, finish reason)
and builds the choice objects: choice ``index`` = prompt number x n + choice. With
``best_of`` > n the n choices of highest total log-probability are kept per prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.outputs import RequestOutput, TokenLogprob
from radixserve.metrics import RequestTimer, ServingMetrics
from radixserve.services.gateway.openai_api.logprobs import LogprobFormatter
from radixserve.services.gateway.openai_api.plan import Plan
from radixserve.services.gateway.server.deadline import Deadline
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.tools.reasoning import ReasoningStream, split_reasoning
from radixserve.services.gateway.tools.tool_stream import ToolCallStream, split_message

_DISCONNECT_POLL_S = 0.25  # how often a request waiting for its first token checks the client


class ClientGone(Exception):
    """The client closed its connection before the request finished."""


class ClientTooSlow(OpenAIError):
    """The client read a stream too slowly: it fell ``max_buffered`` outputs behind."""

    def __init__(self, limit: int) -> None:
        super().__init__(503, f"the client read the stream too slowly: {limit} outputs "
                         "were waiting to be sent (stream_buffer_outputs); aborted")  # fmt: skip


class Generation:
    """The engine streams of one HTTP request (one per prompt)."""

    def __init__(
        self,
        streams: list[AsyncIterator[RequestOutput]],
        metrics: ServingMetrics,
        deadline: Deadline | None = None,
        max_buffered: int = 1024,
        adapter: str = "",
    ) -> None:
        self.streams = streams
        self.timers = [RequestTimer(metrics, adapter=adapter) for _ in streams]
        self.lasts: list[RequestOutput | None] = [None] * len(streams)
        self.tokens = [0] * len(streams)  # generated tokens per stream, every choice
        self.deadline = deadline
        self.ended_by: str | None = None  # why `end` stopped it: "deadline", "disconnected"...
        self.failed = False  # an engine stream raised (no abort of the gateway's)
        self._firsts: list[RequestOutput] = []  # each stream's first output (`first`)
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._max_queued = max_buffered * len(streams)
        self._live = 0  # streams not finished yet (set by `first`)
        self._tasks: list[asyncio.Task] = []
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False

    def observe(self, job: int, out: RequestOutput) -> None:
        self.lasts[job] = out
        self.tokens[job] += len(out.new_token_ids)
        self.timers[job].tokens(len(out.new_token_ids))
        if out.finished:
            self.timers[job].finish(self.total(job), out.finish_reason or "stop")

    def total(self, job: int) -> RequestOutput:
        """The job's latest output with completion_tokens counted over every choice."""
        last = self.lasts[job]
        assert last is not None
        return dataclasses.replace(last, completion_tokens=self.tokens[job])

    async def first(self, disconnected: Callable[[], Awaitable[bool]]) -> bool:
        """Wait for every stream's first output (a `RequestError` is raised here, before
        any byte is sent); False if the client left meanwhile (a long prefill)."""
        pending = [asyncio.ensure_future(s.__anext__()) for s in self.streams]
        try:
            while True:
                wait_s = _DISCONNECT_POLL_S
                if self.deadline is not None:
                    wait_s = max(0.0, min(wait_s, self.deadline.remaining_s()))
                done, _ = await asyncio.wait(pending, timeout=wait_s,
                                             return_when=asyncio.FIRST_EXCEPTION)  # fmt: skip
                for task in done:
                    if task.exception() is not None:
                        self.failed = True
                        raise task.exception()  # type: ignore[misc]
                if len(done) == len(pending):
                    self._firsts = [t.result() for t in pending]
                    self._live = sum(not out.finished for out in self._firsts)
                    return True
                if self.deadline is not None and self.deadline.remaining_s() <= 0:
                    self.ended_by = "deadline"
                    raise self.deadline.error()
                if await disconnected():
                    self.ended_by = "disconnected"
                    return False
        finally:
            for task in pending:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(job, output) for every output, the first ones first, until all finish; the
        error that ended it early (`end`, `ClientTooSlow`), if one did, after the outputs
        queued before it."""
        queue = self._queue
        if self.deadline is not None:
            delay = max(0.0, self.deadline.remaining_s())
            self._expiry = asyncio.get_running_loop().call_later(
                delay, self.end, "deadline", self.deadline.error()
            )
        for job, out in enumerate(self._firsts):
            yield job, out
            if not out.finished and self.ended_by is None:
                self._tasks.append(asyncio.ensure_future(self._pump(job, queue)))
        while self._live:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[1].finished:
                self._live -= 1

    async def _pump(self, job: int, queue: asyncio.Queue) -> None:
        stream = self.streams[job]
        try:
            async for out in stream:
                if queue.qsize() >= self._max_queued:  # its client is not keeping up
                    await stream.aclose()  # type: ignore[attr-defined]  # aborts it now
                    self.end("too_slow", ClientTooSlow(self._max_queued))
                    return
                queue.put_nowait((job, out))
        except Exception as exc:
            self.failed = True
            queue.put_nowait(exc)

    def end(self, reason: str, error: BaseException) -> None:
        """Stop the request early: its pumps are cancelled (which aborts their engine
        streams) and `outputs` raises ``error`` after what was already queued."""
        if self.ended_by is not None or self._closed or not self._live:
            return
        self.ended_by = reason
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait(error)

    @property
    def abort_reason(self) -> str | None:
        """Why the request ended before every stream finished, where the gateway ended
        it (`end`) or its client left; None if it finished, or an engine stream failed."""
        if self.ended_by is not None:
            return self.ended_by
        if self.failed or all(last is not None and last.finished for last in self.lasts):
            return None
        return "disconnected"

    async def close(self) -> None:
        """Idempotent: stop the pumps, close every stream (aborting the unfinished)."""
        if self._closed:
            return
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job, stream in enumerate(self.streams):
            await stream.aclose()  # type: ignore[attr-defined]
            last = self.lasts[job]
            if last is not None and not last.finished:
                self.timers[job].finish(self.total(job), "abort")


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False
    tools: ToolCallStream | None = None  # with tools: the reply's calls, found as it streams
    reasoning: ReasoningStream | None = None  # a thinking model's: its reasoning split off


def _answer_deltas(c: Choice, text: str, finished: bool) -> list[dict[str, Any]]:
    """The deltas of a reply's answer text: its content or, with tools, what the
    `ToolCallStream` lets out (and the calls once the choice has finished)."""
    if c.tools is None:
        return [{"content": text}] if text else []
    deltas = c.tools.feed(text)
    if finished:
        deltas += c.tools.finish()
    return deltas


def reply_deltas(c: Choice, text: str, finished: bool) -> list[dict[str, Any]]:
    """A chat reply's message deltas for new text: with a reasoning parser, its reasoning
    as ``{"reasoning_content": ...}`` and only the answer through `_answer_deltas` (tool
    calls are looked for there, never in the reasoning)."""
    if c.reasoning is None:
        return _answer_deltas(c, text, finished)
    segments = c.reasoning.feed(text) + (c.reasoning.finish() if finished else [])
    deltas: list[dict[str, Any]] = []
    for kind, piece in segments:
        if kind == "reasoning":
            deltas.append({"reasoning_content": piece})
        else:
            deltas += _answer_deltas(c, piece, False)
    return deltas + (_answer_deltas(c, "", True) if finished else [])


class ChoiceBook:
    """Every choice of a request, keyed by (job, choice index in the engine)."""

    def __init__(self, plan: Plan, formatter: LogprobFormatter) -> None:
        self.plan = plan
        self.fmt = formatter
        self.choices: dict[tuple[int, int], Choice] = {}
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self.offsets: dict[tuple[int, int], int] = {}

    def index(self, job: int, choice: int) -> int:
        return job * self.plan.n + choice

    def add(self, job: int, out: RequestOutput) -> Choice:
        c = self.choices.get((job, out.index))
        if c is None:
            tools = self.plan.tools.stream(self.plan.stream) if self.plan.tools else None
            reasoning = self.plan.reasoning.stream() if self.plan.reasoning else None
            c = self.choices[(job, out.index)] = Choice(tools=tools, reasoning=reasoning)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[job] = out.prompt_logprobs
        if not self.plan.drop_generated:
            c.text.append(out.new_text)
            c.token_ids.extend(out.new_token_ids)
            c.logprobs.extend(out.logprobs or ())
        if out.finish_reason is not None:
            c.finish_reason = "length" if self.plan.drop_generated else out.finish_reason
        return c

    # -- the pieces of a choice ----------------------------------------------------------

    def echo_text(self, job: int) -> str:
        return self.plan.jobs[job].prompt_text if self.plan.echo else ""

    def completion_logprobs(
        self, job: int, key: tuple[int, int], ids: list[int], lps: list[TokenLogprob],
        echo: bool,
    ) -> dict[str, Any] | None:  # fmt: skip
        """The completions logprobs object for these tokens (the prompt's first if echo),
        text offsets continuing from the choice's last."""
        if self.plan.top_logprobs is None:
            return None
        entries: list[TokenLogprob | None] = list(lps)
        if echo:
            prompt = self.plan.jobs[job].prompt_ids
            scored = self.prompt_logprobs.get(job, [])
            ids = [*prompt, *ids]
            entries = [None, *scored[: len(prompt) - 1], *entries]
        body, self.offsets[key] = self.fmt.completion(ids, entries, self.offsets.get(key, 0))
        return body

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.plan.top_logprobs is None:
            return None
        return {"content": self.fmt.chat(lps), "refusal": None}

    # -- whole choices (non-streaming) --------------------------------------------------

    def ranked(self) -> list[tuple[int, tuple[int, int], Choice]]:
        """(response index, key, choice) in index order; best_of keeps the n best."""
        out: list[tuple[int, tuple[int, int], Choice]] = []
        for job in range(len(self.plan.jobs)):
            keys = sorted(k for k in self.choices if k[0] == job)
            if self.plan.best_of > self.plan.n:
                keys.sort(key=lambda k: -sum(lp.logprob for lp in self.choices[k].logprobs))
                keys = keys[: self.plan.n]
            out.extend((self.index(job, rank), k, self.choices[k]) for rank, k in enumerate(keys))
        return out

    def full_choices(self) -> list[dict[str, Any]]:
        result = []
        for index, key, c in self.ranked():
            text = "".join(c.text)
            if self.plan.kind == "completion":
                logprobs = self.completion_logprobs(key[0], key, c.token_ids, c.logprobs,
                                                    self.plan.echo)  # fmt: skip
                result.append({"index": index, "text": self.echo_text(key[0]) + text,
                               "logprobs": logprobs, "finish_reason": c.finish_reason})  # fmt: skip
            else:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = c.finish_reason
                if c.reasoning is not None:
                    reasoning, text = split_reasoning(c.reasoning, text)
                    message.update(content=text, reasoning_content=reasoning or None)
                if c.tools is not None:
                    message["content"], calls = split_message(c.tools, text)
                    if calls:
                        message["tool_calls"], reason = calls, "tool_calls"
                result.append({"index": index, "message": message,
                               "logprobs": self.chat_logprobs(c.logprobs),
                               "finish_reason": reason})  # fmt: skip
        return result
