"""Log-probabilities in the OpenAI shapes: the completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and chat's `content` entries (`token`,
`logprob`, `bytes`, `top_logprobs`). A token's text is its bytes decoded as UTF-8 (a
token holding part of a character shows U+FFFD; its `bytes` are exact)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from radixserve.engine.outputs import TokenLogprob
from radixserve.model.tokenizer import Tokenizer


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.token_bytes = functools.lru_cache(maxsize=65536)(tokenizer.token_bytes)

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0
    ) -> tuple[dict[str, Any], int]:
        """The completions `logprobs` object for ``token_ids`` (an entry None: the first
        prompt token, which has no log-probability), offsets from ``offset``; and the
        offset after the last token."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, lp in zip(token_ids, entries):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(lp.logprob)
            top: dict[str, float] = {}
            for alt, value in zip(lp.top_ids, lp.top_logprobs):
                top.setdefault(self.text(alt), value)
            tops.append(top)
        body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip
        return body, offset

    def chat(self, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's `logprobs.content` entries."""
        return [
            {
                **self._chat_token(lp.token_id, lp.logprob),
                "top_logprobs": [
                    self._chat_token(alt, value) for alt, value in zip(lp.top_ids, lp.top_logprobs)
                ],
            }
            for lp in entries
        ]

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}  # fmt: skip
