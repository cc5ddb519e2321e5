"""Turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.engine.request import Request
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.model.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from radixserve.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.device = device

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, list[Request], list[tuple[Request, int, torch.Tensor]]]:
        """Compute the batch; returns logits (N, vocab) for the N requests whose chunk
        reached their newest token (they sample next), those requests in order, and for
        requests scoring their prompt (`Request.scores_prompt`) (req, p, logits (k, V))
        of chunk positions p..p+k-1 whose next token is a prompt token."""
        # Multi-token chunks (prefill spans) first, then single-token decodes.
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        decode_reqs: list[Request] = []
        sampling: list[Request] = []
        logits_rows: list[int] = []
        scored: list[tuple[Request, int, list[int]]] = []
        ps = self.page_size
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            start, lo = len(ids), req.num_computed
            ids.extend(req.token_ids[lo : lo + n])
            pos = range(lo, lo + n)
            positions.extend(pos)
            slots.extend(req.page_ids[p // ps] * ps + p % ps for p in pos)
            if n == 1:
                decode_reqs.append(req)
            else:
                pages = torch.tensor(req.page_ids[: -(-(lo + n) // ps)], dtype=torch.int64)
                spans.append(PrefillSpan(start, start + n, lo, pages.to(self.device)))
            if lo + n == req.num_tokens:
                sampling.append(req)
                logits_rows.append(len(ids) - 1)
            if req.scores_prompt:
                hi = min(lo + n, len(req.prompt_ids) - 1)
                if hi > lo:
                    scored.append((req, lo, list(range(start, start + hi - lo))))
        prompt_from = len(logits_rows)
        for _, _, rows in scored:
            logits_rows.extend(rows)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            prefills=tuple(spans),
            decode=self._decode_batch(decode_reqs, len(ids) - len(decode_reqs)),
        )
        logits = self.model(
            self._tensor(ids),
            self._tensor(positions),
            self.kv_pool,
            meta,
            self._tensor(logits_rows),
        )
        prompt_logits = []
        for req, lo, rows in scored:
            prompt_logits.append((req, lo, logits[prompt_from : prompt_from + len(rows)]))
            prompt_from += len(rows)
        return logits[: len(sampling)], sampling, prompt_logits

    def _decode_batch(self, reqs: list[Request], start: int) -> DecodeBatch | None:
        if not reqs:
            return None
        context_lens = [r.num_computed + 1 for r in reqs]
        max_pages = -(-max(context_lens) // self.page_size)
        table = torch.zeros((len(reqs), max_pages), dtype=torch.int64)  # (B, max_pages)
        for row, (req, length) in enumerate(zip(reqs, context_lens)):
            pages = req.page_ids[: -(-length // self.page_size)]
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        return DecodeBatch(start, table.to(self.device), self._tensor(context_lens))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
