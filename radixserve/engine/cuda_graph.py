"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of B sequences runs the graph of the smallest bucket >= B: its inputs
are one static device buffer (the `forward_batch` layout at the bucket's size and a page
table wide enough for the longest context), refilled by one host-to-device copy, with
B..bucket-1 padding rows that write no KV (slot -1) and attend to nothing (seq_len 0).
Steps with a prefill chunk, a scored prompt token, or more sequences than the largest
bucket, run eagerly.

Capture needs kernels that never wait on the host: the triton set (the torch reference
syncs to filter padding slots), on a CUDA device. Bucket choice and padding are plain
Python and tested on CPU; capture and replay have not yet run on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.errors import ConfigurationError
from radixserve.model.forward_batch import SequenceChunk, buffer_len, build_forward_batch
from radixserve.model.llama import LlamaModel

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Buckets 1, 2, 4, 8, then every multiple of 8, up to and including max_batch_size."""
    if max_batch_size < 1:
        return ()
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return (*sizes, max_batch_size)


def bucket_for(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest bucket that holds `batch` sequences; None when none does."""
    return next((s for s in sizes if s >= batch), None)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # the static packed input buffer
    logits: torch.Tensor  # (bucket, vocab) float32, rewritten by every replay


class DecodeGraphs:
    """Captures the model's decode step at every bucket size at construction."""

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: KVPool,
        max_model_len: int,
        max_batch_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.device = device
        self.sizes = graph_batch_sizes(max_batch_size)
        self.table_width = -(-max_model_len // self.page_size)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _Captured] = {}
        for size in reversed(self.sizes):  # largest first: the others reuse its memory
            self._graphs[size] = self._capture(size)
        logger.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))

    @torch.inference_mode()
    def _capture(self, size: int) -> _Captured:
        inputs = torch.zeros(
            buffer_len(size, size, size, self.table_width), dtype=torch.int64, device=self.device
        )
        fb = build_forward_batch(
            [], self.page_size, self.device, pad_to=size, table_width=self.table_width, out=inputs
        )

        def step() -> torch.Tensor:
            return self.model(
                fb.input_ids, fb.positions, self.kv_pool.layers, fb.attn, fb.logits_indices
            )

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()  # compiles the Triton kernels for these shapes outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = step()
        return _Captured(graph, inputs, logits)

    def run(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor | None:
        """Logits of the chunks that want them, or None when no graph fits this step."""
        size = padded_batch_size(self.sizes, chunks)
        if size is None:
            return None
        captured = self._graphs[size]
        build_forward_batch(
            chunks, self.page_size, self.device, pad_to=size,
            table_width=self.table_width, out=captured.inputs,
        )  # fmt: skip
        captured.graph.replay()
        rows = [i for i, c in enumerate(chunks) if c.wants_logits]
        if len(rows) == len(chunks):
            return captured.logits[: len(rows)].clone()
        return captured.logits[torch.tensor(rows, device=self.device)]


def padded_batch_size(sizes: Sequence[int], chunks: Sequence[SequenceChunk]) -> int | None:
    """The bucket a step runs in: decode-only steps that fit one and score no prompt
    token; None means eager."""
    if not chunks or any(len(c.token_ids) != 1 or c.scored_rows for c in chunks):
        return None
    return bucket_for(sizes, len(chunks))


def make_decode_graphs(
    model: LlamaModel,
    kv_pool: KVPool,
    backend: str,
    max_model_len: int,
    max_batch_size: int,
    device: torch.device,
) -> DecodeGraphs | None:
    """Graphs for the `cuda_graph_max_batch_size` setting (0: none); refuses a device or
    kernel set that cannot be captured, by name."""
    if max_batch_size == 0:
        return None
    if device.type != "cuda":
        raise ConfigurationError(
            f"cuda_graph_max_batch_size={max_batch_size} needs a CUDA device, not {device}; "
            "set it to 0 on CPU"
        )
    if backend != "triton":
        raise ConfigurationError(
            f"cuda_graph_max_batch_size needs attention_backend 'triton' (got {backend!r}): "
            "the torch reference kernels synchronise with the host"
        )
    return DecodeGraphs(model, kv_pool, max_model_len, max_batch_size, device)
