"""Structured output: a request's guide (JSON schema, JSON object, regex, choice, Lark
grammar) compiled by llguidance into a matcher over the model's vocabulary.

Per step, the masks of every guided row are computed in one parallel call
(`LLExecutor`, which releases the GIL) on a helper thread while the model runs; the
sampler then sets disallowed logits to -inf. A guided request's matcher consumes each
token it samples; once the grammar admits nothing more the request stops (finish
reason "stop"), and where it may end or go on only EOS or a continuing token is
allowed, so the output always parses (unless ``max_tokens`` cuts it short: finish
reason "length"). JSON is generated with compact separators.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from radixserve.engine.grammar import PARAM, grammar_for
from radixserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class GuideCompiler:
    """Builds matchers for one model's vocabulary; the tokenizer table is built on first
    use (about half a second) and kept."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = eos_token_id
        self._tokenizer: Any = None
        self._executor: Any = None
        self._pool: ThreadPoolExecutor | None = None

    def matcher(self, kind: str, guide: str) -> Any:
        """A fresh `llguidance.LLMatcher` for the guide (InvalidRequestError if bad)."""
        import llguidance

        grammar = grammar_for(kind, guide)
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
            )
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"cannot compile the {kind} guide: {matcher.get_error()[:500]}", param=PARAM
            )
        return matcher

    def start_masks(self, matchers: Sequence[Any]) -> Future[torch.Tensor] | None:
        """Compute the allowed-token masks of ``matchers`` on a helper thread (the model
        step runs meanwhile); the future's result is bool (R, V). None if no matcher."""
        if not matchers:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-guide")
        return self._pool.submit(self.masks, list(matchers))

    def masks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """Allowed tokens bool (R, V) for each matcher's current state, in one call."""
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = allocate_token_bitmask(len(matchers), self.vocab_size)  # (R, ceil(V/32)) int32
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], words)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # (R, 32*W)
        return torch.from_numpy(bits[:, : self.vocab_size].astype(np.bool_))  # (R, V)


def advance(matcher: Any, token_id: int) -> bool:
    """Feed a sampled token to a matcher; True when the grammar is complete and admits
    nothing more (the request then stops). A refused token is logged (the mask allowed
    it: only a row with no allowed token at all can get one)."""
    if matcher.is_stopped():
        return True
    if not matcher.consume_token(token_id):
        logger.warning("guide refused token %d: %s", token_id, matcher.get_error()[:200])
        return True
    return bool(matcher.is_stopped())
