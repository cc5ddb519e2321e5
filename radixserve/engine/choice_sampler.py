"""From one step's logits to the next token of every request that samples.

The engine's side of sampling: it forks a request with ``n`` choices into its members
at its first token (every member samples from the prompt's logits row), starts the
structured-output masks of guided rows before the model runs (`GuideCompiler`, on a
helper thread) and joins them after, builds each seeded draw's generator from (seed,
choice, tokens so far), asks each request's thinking budget whether its next token is
forced (`thinking_budget`), calls the `Sampler`, and computes the log-probabilities the
requests ask for (`logprobs`), batched over those rows only. Prompt log-probabilities
come from the logits the runner returns for prompts being scored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from radixserve.engine.logprobs import token_logprobs
from radixserve.engine.outputs import TokenLogprob
from radixserve.engine.request import Request
from radixserve.engine.sampler import Sampler, step_generator
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.engine.structured import GuideCompiler

logger = logging.getLogger(__name__)

#: (request, its new token, its log-probabilities if asked for)
Draw = tuple[Request, int, TokenLogprob | None]


#: the grammar masks of one step's guided rows, being computed: called, it waits for them
#: and gives id(request) -> bool (V,) allowed tokens
PendingMasks = Callable[[], dict[int, torch.Tensor]]


class ChoiceSampler:
    def __init__(
        self,
        sampler: Sampler,
        guides: GuideCompiler,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        self.sampler = sampler
        self.guides = guides
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device

    def start_masks(self, batch: ScheduledBatch) -> PendingMasks:
        """Start the masks of the guided requests that will sample in this step."""
        guided = [
            r
            for r, n in zip(batch.requests, batch.num_new_tokens)
            if r.guide is not None and r.num_computed + n == r.num_tokens
        ]
        future = self.guides.start_masks([r.guide for r in guided])

        def result() -> dict[int, torch.Tensor]:
            if future is None:
                return {}
            return {id(r): mask for r, mask in zip(guided, future.result())}  # rows of (G, V)

        return result

    def sample(
        self,
        logits: torch.Tensor,
        sampling: list[Request],
        masks: PendingMasks,
        fork: Callable[[Request], list[Request]],
    ) -> list[Draw]:
        """One token per member of every request in ``sampling`` (logits (N, V) in the
        same order); requests not yet forked are forked first (``fork``)."""
        rows: list[int] = []
        members: list[Request] = []
        for i, req in enumerate(sampling):
            group = [req] if req.forked else [req, *fork(req)]
            rows.extend([i] * len(group))
            members.extend(group)
        x = logits if len(rows) == len(sampling) else logits[torch.tensor(rows)]  # (M, V)
        allowed_of = masks()
        guided = [k for k, m in enumerate(members) if m.guide is not None]
        allowed = None
        if guided:
            allowed = (guided, torch.stack([allowed_of[id(sampling[rows[k]])] for k in guided]))
        params = [m.params for m in members]
        history = any(p.penalized for p in params)
        forced = [(k, t) for k, m in enumerate(members)
                  if m.thinking is not None and (t := m.thinking.forced()) is not None]  # fmt: skip
        tokens = self.sampler(
            x,
            params,
            [step_generator(p.seed, m.index, len(m.output_ids), self.device)
             for p, m in zip(params, members)],
            [len(m.output_ids) for m in members],
            self.eos_token_ids,
            prompt_ids=[m.prompt_ids for m in members] if history else None,
            output_ids=[m.output_ids for m in members] if history else None,
            allowed=allowed,
            forced=([k for k, _ in forced], [t for _, t in forced]) if forced else None,
        ).tolist()  # fmt: skip
        return list(zip(members, tokens, self.logprobs(x, members, tokens)))

    @staticmethod
    def logprobs(
        x: torch.Tensor, members: Sequence[Request], tokens: Sequence[int]
    ) -> list[TokenLogprob | None]:
        """Log-probabilities of ``tokens`` for the members that ask (None for the rest)."""
        asked = [k for k, m in enumerate(members) if m.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(members)
        if asked:
            index = torch.tensor(asked, dtype=torch.int64, device=x.device)
            lps = token_logprobs(
                x[index],
                [tokens[k] for k in asked],
                [int(members[k].params.logprobs or 0) for k in asked],
            )
            for k, lp in zip(asked, lps):
                out[k] = lp
        return out

    @staticmethod
    def score_prompt(req: Request, position: int, logits: torch.Tensor) -> None:
        """Record the log-probabilities of prompt tokens position+1 .. position+k from the
        logits (k, V) of positions position .. position+k-1 (once each: a recomputed
        chunk after a preemption adds nothing)."""
        skip = len(req.prompt_logprobs) - position
        if skip < 0:
            logger.warning("%s: prompt scores have a gap at %d", req.request_id, position)
            return
        if skip >= logits.shape[0]:
            return
        first = position + skip
        rows = logits[skip:]
        targets = req.prompt_ids[first + 1 : first + 1 + rows.shape[0]]
        k = int(req.params.prompt_logprobs or 0)
        req.prompt_logprobs.extend(token_logprobs(rows, targets, [k] * len(targets)))
