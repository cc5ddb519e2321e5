"""Turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import dataclasses

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.engine.cuda_graph import DecodeGraphs, make_decode_graphs
from radixserve.engine.model_shard import ModelShard
from radixserve.engine.request import Request
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.engine.tp_group import TPGroup
from radixserve.model.forward_batch import SequenceChunk, forward_batch_of, pack_step
from radixserve.model.fused_decode import (
    FUSED_MAX_BATCH,
    FUSED_THREADS,
    FusedDecode,
    fused_decode_for,
)
from radixserve.model.llama import LlamaModel
from radixserve.model.lora_manager import LoraManager
from radixserve.settings import EngineSettings


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVPool,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        tp_group: TPGroup | None = None,
        fused: FusedDecode | None = None,
        loras: LoraManager | None = None,
    ) -> None:
        self.model = model
        self.tp_group = tp_group  # sent each step before this rank computes it
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.device = device
        self.graphs = graphs  # decode-only steps replay a captured graph when one fits
        self.fused = fused  # decode-only steps run the layers in one native call (CPU)
        self.loras = loras  # the adapters requests may name (steps with them run eagerly)

    @classmethod
    def build(
        cls,
        settings: EngineSettings,
        shard: ModelShard,
        device: torch.device,
        max_model_len: int,
        tp_group: TPGroup | None,
        loras: LoraManager | None = None,
    ) -> ModelRunner:
        """Rank 0's runner of ``shard``, with the decode paths ``settings`` and the device
        allow: captured graphs (not with ranks: a graph would replay without them) and
        the native decode step (CPU, one rank)."""
        model, kv_pool, graphs, fused = shard.model, shard.kv_pool, None, None
        if tp_group is None:
            graphs = make_decode_graphs(model, kv_pool, shard.attention.name, max_model_len,
                                        settings.cuda_graph_max_batch_size, device)  # fmt: skip
        if settings.fused_decode and tp_group is None and device.type == "cpu":
            batch = min(settings.max_num_seqs, FUSED_MAX_BATCH)
            fused = fused_decode_for(model, kv_pool.layers, batch, FUSED_THREADS)
        return cls(model, kv_pool, device, graphs, tp_group, fused, loras)

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[
        torch.Tensor,
        list[Request],
        list[tuple[Request, int, torch.Tensor]],
        dict[str, torch.Tensor],
    ]:
        """Compute the batch; returns logits (N, vocab) for the N requests whose chunk
        reached their newest token (they sample next), those requests in order; for
        requests scoring their prompt (`Request.scores_prompt`) (req, p, logits (k, V))
        of chunk positions p..p+k-1 whose next token is a prompt token; and for requests
        verifying a draft (`Request.draft`, k tokens after their pending one) the logits
        (k, V) of the chunk's first k positions, by request id (its last position's row
        is among the N)."""
        # Multi-token chunks (extends) first, then single-token decodes.
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] == 1)
        chunks: list[SequenceChunk] = []
        sampling: list[Request] = []
        scored: list[tuple[Request, int, int]] = []  # (req, first position, rows)
        for i in order:
            req, n = batch.requests[i], batch.num_new_tokens[i]
            lo = req.num_computed
            if req.draft:  # its pending token, then the draft: every position's logits
                assert n == 1 + len(req.draft) and lo + 1 == req.num_tokens
                tokens = [*req.token_ids[lo:], *req.draft]
                chunks.append(SequenceChunk(tokens, lo, req.page_ids, True, len(req.draft)))
                sampling.append(req)
                scored.append((req, lo, len(req.draft)))
                continue
            last = lo + n == req.num_tokens
            k = max(0, min(lo + n, len(req.prompt_ids) - 1) - lo) if req.scores_prompt else 0
            chunks.append(SequenceChunk(req.token_ids[lo : lo + n], lo, req.page_ids, last, k))
            if last:
                sampling.append(req)
            if k:
                scored.append((req, lo, k))
        lora = None
        if self.loras is not None and self.loras.adapters:  # each chunk's rows' adapter
            lora = self.loras.batch([(batch.requests[i].adapter, len(c.token_ids))
                                     for i, c in zip(order, chunks)])  # fmt: skip
        logits = self.graphs.run(chunks) if self.graphs is not None and lora is None else None
        if logits is None:
            packed = pack_step(chunks, self.page_size)
            if self.tp_group is not None:
                self.tp_group.forward(packed)
            fb = forward_batch_of(packed, self.device)
            if lora is not None:
                fb = dataclasses.replace(fb, lora_slots=lora.row_slot)
            if self.fused is not None and self.fused.applies(fb):
                logits = self.fused.forward(fb, lora)
            else:
                logits = self.model(fb.input_ids, fb.positions, self.kv_pool.layers, fb.attn,
                                    fb.logits_indices, lora)  # fmt: skip
        # rows: the sampling requests' in order, then each scored chunk's rows
        prompt_logits, draft_logits, at = [], {}, len(sampling)
        for req, lo, k in scored:
            if req.draft:
                draft_logits[req.request_id] = logits[at : at + k]
            else:
                prompt_logits.append((req, lo, logits[at : at + k]))
            at += k
        return logits[: len(sampling)], sampling, prompt_logits, draft_logits
