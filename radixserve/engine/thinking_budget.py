"""A request's thinking-token budget: where its reasoning is, and when to end it.

A reasoning reply opens its reasoning at its start (the prompt ended inside it:
``thinking_open``, as after DeepSeek-R1's generation prompt ``...<think>``) or where it
writes the start marker (``thinking_start_ids``: Qwen3's ``<think>``), and closes it
where it writes the end marker (``thinking_end_ids``: ``</think>``). Every token
generated between the two counts toward ``thinking_token_budget``, over every
reasoning segment of the reply. Once the count reaches the budget while the reasoning
is open, the next tokens are the end marker's, one per step (`forced`: the sampler
masks every other token, `radixserve.engine.sampler`); the model then answers from
there, as it would have after writing the marker itself.

The state is a function of the tokens fed (`add`), in order: a preempted request keeps
it with its output, a resumed one (`Engine._resume`) rebuilds it from the tokens it
resumes after, and a choice forked from a prompt starts from the request's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.engine.sampling_params import SamplingParams


@dataclass
class ThinkingBudget:
    budget: int  # most reasoning tokens
    start_ids: tuple[int, ...]  # the start marker's ids ((): reasoning opens only at the start)
    end_ids: tuple[int, ...]  # the end marker's ids (at least one)
    inside: bool  # the reasoning is open
    num_thinking: int = 0  # reasoning tokens generated so far
    _recent: list[int] = field(default_factory=list)  # the last tokens, for the markers

    @classmethod
    def of(cls, params: SamplingParams) -> ThinkingBudget | None:
        """The budget of a request with ``params``; None when it has none."""
        if params.thinking_token_budget is None:
            return None
        return cls(params.thinking_token_budget, params.thinking_start_ids,
                   params.thinking_end_ids, params.thinking_open)  # fmt: skip

    def _ends_with(self, marker: Sequence[int]) -> bool:
        n = len(marker)
        return n == 0 or (len(self._recent) >= n and self._recent[-n:] == list(marker))

    def add(self, token: int) -> None:
        """Account for the reply's next token."""
        self._recent.append(token)
        del self._recent[: -max(len(self.start_ids), len(self.end_ids))]
        if self.inside:
            if self._ends_with(self.end_ids):
                self.inside = False
            else:
                self.num_thinking += 1
        elif self.start_ids and self._ends_with(self.start_ids):
            self.inside = True

    def forced(self) -> int | None:
        """The token the next step must take: the end marker's next id once the budget is
        spent inside the reasoning (after the part of it already written); else None."""
        if not self.inside or self.num_thinking < self.budget:
            return None
        written = next(k for k in range(len(self.end_ids) - 1, -1, -1)
                       if self._ends_with(self.end_ids[:k]))  # fmt: skip
        return self.end_ids[written]
