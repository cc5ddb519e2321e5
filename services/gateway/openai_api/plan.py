"""From a validated request body to what the engine runs: one `Job` per prompt.

A request's prompts (completions accept a list) become one engine request each, all
submitted at once so they run as one continuous batch; each asks for ``best_of``
choices (``n`` unless best_of is larger), which the engine forks after computing the
prompt once. The `Plan` says how to present them: echo, how many top log-probabilities,
whether to drop the one generated token of a ``max_tokens: 0`` echo request (prompt
scoring, as evaluation harnesses send it).

max_tokens policy: an explicit ``max_tokens`` (or ``max_completion_tokens``) larger than
the context left after the prompt is refused with a 400 saying how many tokens are
left (as vLLM does); without one, completions generate up to 16 tokens and chat up to
``default_max_tokens``, both capped by what is left.

Preparation: the size caps (`limits`) are checked first; the CPU steps (grammar
compilation, chat template, tokenization) then run in the gateway's `Preparer` pool
under one deadline per request, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from radixserve.engine.grammar import grammar_for
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import InvalidRequestError
from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway.openai_api.limits import PrepareLimits
from radixserve.services.gateway.openai_api.preparer import Preparation
from radixserve.services.gateway.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.services.gateway.tools.reasoning import ReasoningFormat, ReasoningPlan
from radixserve.services.gateway.tools.tool_request import (
    ToolFormat,
    ToolPlan,
    ToolRequest,
    template_inputs,
    tool_request,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Job:
    """One prompt: its ids, the engine parameters, and (echo) the prompt text."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""


@dataclass(frozen=True)
class Plan:
    kind: str  # "completion" | "chat"
    jobs: list[Job]
    n: int  # choices returned per prompt
    best_of: int  # choices generated per prompt (>= n)
    echo: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the response
    drop_generated: bool = False  # max_tokens 0 with echo: score the prompt only
    stream: bool = False
    include_usage: bool = False
    tools: ToolPlan | None = None  # chat with tools: replies are searched for calls
    cache_salt: str = ""  # only requests with the same salt (and tenant) share KV
    prompt_cache_key: str = ""  # a routing hint (`DecodeRouter` affinity)
    priority: int | None = None  # asked for (`Principal.share`); None: the key's class
    reasoning: ReasoningPlan | None = None  # chat: how replies split off their reasoning


def _room(client: EngineClient, prompt_ids: list[int], param: str = "prompt") -> int:
    room = client.max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequestError(
            f"{param} has {len(prompt_ids)} tokens; the model's context is "
            f"{client.max_model_len} tokens and at least one must be left to generate: "
            "shorten it",
            param=param,
        )
    return room


def _max_tokens(requested: int | None, default: int, room: int, param: str) -> int:
    if requested is None:
        return max(1, min(default, room))
    if requested > room:
        raise InvalidRequestError(
            f"{param} is {requested}, but only {room} tokens are left in the context after "
            "the prompt; lower it",
            param=param,
        )
    return requested


def compile_guide(param: str, kind: str, guide: str) -> None:
    """Compile a guide, refusing a malformed one before routing; errors name the request
    field `param`. CPU work: run it in the `Preparer`."""
    try:
        grammar_for(kind, guide)
    except InvalidRequestError as exc:
        message = str(exc) if param in str(exc) else f"{param}: {exc}"
        raise InvalidRequestError(message, param=param) from None


async def checked_guide(
    req: GenerationRequest, limits: PrepareLimits, prep: Preparation, field: str = ""
) -> tuple[str, str]:
    """(guide_kind, guide) of the request's structured output: its size checked against
    `limits` first, then compiled in the pool. `field` names it in errors (default: the
    field it came from)."""
    param, kind, guide = req.guided()
    if kind:
        param = field or param
        limits.check_guide(param, kind, guide)
        await prep.run(param, compile_guide, param, kind, guide)
    return kind, guide


async def job_guide(
    req: GenerationRequest, tools: ToolRequest | None, limits: PrepareLimits,
    prep: Preparation, field: str = "",
) -> tuple[str, str]:  # fmt: skip
    """The guide a chat job is held to: a forced tool call's, else the request's own
    (`checked_guide`); sizes checked before anything is compiled."""
    if tools is None or not tools.forced:
        return await checked_guide(req, limits, prep, field)
    text = await prep.run("tools", tools.guide)
    limits.check_tool_guide(text)
    await prep.run("tools", tools.compile_guide, text)
    return "json_schema", text


def _params(
    req: GenerationRequest, max_tokens: int, guide: tuple[str, str], **extra: object
) -> SamplingParams:
    """The engine parameters; `guide` (kind, text) was checked by `checked_guide`."""
    kind, text = guide
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=() if req.stop is None else req.stop,  # type: ignore[arg-type]
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=tuple(sorted(req.bias().items())),
        guide_kind=kind,
        guide=text,
        **extra,  # type: ignore[arg-type]
    )


def _choices(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    count = n or 1
    best = best_of or count
    if best < count:
        raise OpenAIError(400, f"best_of ({best}) must be at least n ({count})", "best_of")
    if best > count and stream:
        raise OpenAIError(400, "best_of larger than n cannot be streamed", "stream")
    return count, best


def _check_choices(total: int, limit: int) -> None:
    if total > limit:
        raise OpenAIError(
            400, f"the request asks for {total} choices (prompts x n or best_of); at most "
            f"{limit} are served per request", "n",
        )  # fmt: skip


def _encode_prompts(client: EngineClient, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's ids: text gets the tokenizer's special tokens; ids are checked by
    the engine. CPU work: run it in the `Preparer`."""
    return [client.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


async def completion_plan(
    req: CompletionRequest, client: EngineClient, max_choices: int, limits: PrepareLimits,
    prep: Preparation,
) -> Plan:  # fmt: skip
    n, best_of = _choices(req.n, req.best_of, bool(req.stream))
    prompts = req.prompts()
    _check_choices(len(prompts) * best_of, max_choices)
    echo = bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
    if any(isinstance(prompt, str) and not prompt for prompt in prompts):
        raise OpenAIError(400, "prompt is empty", "prompt")
    k = req.logprobs
    guide = await checked_guide(req, limits, prep)
    jobs = []
    for prompt, ids in zip(prompts, await prep.run("prompt", _encode_prompts, client, prompts)):
        room = _room(client, ids)
        max_tokens = _max_tokens(req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, room, "max_tokens")
        params = _params(
            req,
            max(max_tokens, 1),
            guide,
            n=best_of,
            logprobs=k if k is not None else (0 if best_of > n else None),
            prompt_logprobs=k if echo and k is not None else None,
        )
        text = ""
        if echo:
            text = prompt if isinstance(prompt, str) else await prep.run(
                "prompt", client.tokenizer.decode, ids)  # fmt: skip
        jobs.append(Job(ids, params, text))
    return Plan("completion", jobs, n, best_of, echo=echo, top_logprobs=k,
                drop_generated=req.max_tokens == 0, stream=bool(req.stream),
                include_usage=req.include_usage, priority=req.priority,
                cache_salt=req.cache_salt or "",
                prompt_cache_key=req.prompt_cache_key or "")  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    """A chat prompt before tokenization: the template's messages and variables, the
    checked tools, and the request fields errors about its length name."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    tools: ToolRequest | None
    max_tokens: int | None  # as requested (None: the default)
    max_tokens_param: str
    prompt_param: str


async def conversation_job(
    req: GenerationRequest, conv: Conversation, client: EngineClient, default_max_tokens: int,
    guide: tuple[str, str], prep: Preparation, tool_format: ToolFormat,
    reasoning: ReasoningFormat | None, **extra: object,
) -> tuple[Job, ToolPlan | None, ReasoningPlan | None]:  # fmt: skip
    """The engine job of a chat prompt: its ids (the template rendered and tokenized in
    the pool), and sampling from `req`'s fields held to `guide` (from `job_guide`),
    the tool and reasoning markers kept in its text; and how its replies split off
    their tool calls and their reasoning (`reasoning_of`)."""
    tool_plan = conv.tools.plan(tool_format) if conv.tools else None
    kept = tool_plan.kept_token_ids(client.tokenizer) if tool_plan else ()
    if reasoning is not None:
        kept += reasoning.kept_token_ids(client.tokenizer)
    encode = partial(client.tokenizer.encode_chat, conv.messages, **conv.template_kwargs)
    ids = await prep.run(conv.prompt_param, encode)  # InvalidRequestError if malformed
    room = _room(client, ids, conv.prompt_param)
    max_tokens = _max_tokens(conv.max_tokens, default_max_tokens, room, conv.max_tokens_param)
    if max_tokens < 1:
        raise InvalidRequestError(f"{conv.max_tokens_param} must be >= 1",
                                  param=conv.max_tokens_param)  # fmt: skip
    job = Job(ids, _params(req, max_tokens, guide, kept_special_ids=kept, **extra))
    return job, tool_plan, reasoning_of(reasoning, client, job)


def reasoning_of(fmt: ReasoningFormat | None, client: EngineClient, job: Job
                 ) -> ReasoningPlan | None:  # fmt: skip
    """How a chat job's replies split off their reasoning: `fmt`'s parser, started where
    the prompt's last tokens leave it (inside an open think block or not)."""
    if fmt is None or fmt.parser == "none":
        return None
    return fmt.plan(client.tokenizer.decode(job.prompt_ids[-16:], skip_special_tokens=False))


def with_thinking_budget(
    job: Job, split: ReasoningPlan | None, budget: int | None, client: EngineClient, param: str
) -> Job:
    """`job` with its reasoning capped at `budget` tokens (None: as it is); a model whose
    replies have no reasoning to cap (`split` None) is refused naming `param`."""
    if budget is None:
        return job
    if split is None:
        raise OpenAIError(400, f"{param} is not served: this model does not think (its chat "
                          "template has no reasoning format); leave it out", param)  # fmt: skip
    try:
        params = replace(job.params, **split.budget_fields(client.tokenizer, budget))
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc).replace("thinking_token_budget", param), param) from None
    return replace(job, params=params)


def effort_variables(
    fmt: ReasoningFormat | None, effort: str | None, kwargs: dict[str, Any], param: str
) -> dict[str, Any]:
    """`kwargs` with the template variables of a requested reasoning effort; a variable
    set both ways is refused naming `param`."""
    extra = (fmt or ReasoningFormat("none")).effort_variables(effort, param)
    for name in extra:
        if name in kwargs:
            raise OpenAIError(400, f"{param} cannot be combined with chat_template_kwargs "
                              f"{name!r}: both set the template's thinking switch", param)  # fmt: skip
    return {**kwargs, **extra}


async def chat_plan(
    req: ChatCompletionRequest,
    client: EngineClient,
    default_max_tokens: int,
    max_choices: int,
    tool_format: ToolFormat,
    limits: PrepareLimits,
    prep: Preparation,
    reasoning: ReasoningFormat | None = None,
) -> Plan:
    n, _ = _choices(req.n, None, bool(req.stream))
    _check_choices(n, max_choices)
    tools = tool_request(req, limits)
    guide = await job_guide(req, tools, limits, prep)
    messages, template_kwargs = await prep.run("messages", template_inputs, req, tools,
                                               tool_format)  # fmt: skip
    template_kwargs = effort_variables(reasoning, req.reasoning_effort, template_kwargs,
                                       "reasoning_effort")  # fmt: skip
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    conv = Conversation(messages, template_kwargs, tools, req.requested_max_tokens, param,
                        "messages")  # fmt: skip
    k = req.num_top_logprobs()
    job, tool_plan, split = await conversation_job(
        req, conv, client, default_max_tokens, guide, prep, tool_format, reasoning, n=n, logprobs=k
    )
    job = with_thinking_budget(job, split, req.thinking_token_budget, client,
                               "thinking_token_budget")  # fmt: skip
    return Plan("chat", [job], n, n, top_logprobs=k, stream=bool(req.stream),
                include_usage=req.include_usage, tools=tool_plan, priority=req.priority,
                reasoning=split, cache_salt=req.cache_salt or "",
                prompt_cache_key=req.prompt_cache_key or "")  # fmt: skip
