"""Which decode steps replay a CUDA graph, and which settings are refused. Capture itself
needs a GPU; everything it depends on is decided here, on CPU."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.cuda_graph import (
    bucket_for,
    graph_batch_sizes,
    make_decode_graphs,
    padded_batch_size,
)
from radixserve.errors import ConfigurationError
from radixserve.model.forward_batch import SequenceChunk
from tests.engine.engine_helpers import make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint


def test_bucket_sizes():
    assert graph_batch_sizes(0) == ()
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    sizes = graph_batch_sizes(32)
    assert [bucket_for(sizes, b) for b in (1, 3, 8, 9, 31, 32, 33)] == [1, 4, 8, 16, 32, 32, None]


def test_only_decode_steps_that_fit_replay_a_graph():
    sizes = graph_batch_sizes(8)
    decode = SequenceChunk([1], 4, [0, 1], True)
    prefill = SequenceChunk([1, 2], 4, [0, 1], True)
    assert padded_batch_size(sizes, [decode] * 3) == 4
    assert padded_batch_size(sizes, [decode] * 8) == 8
    assert padded_batch_size(sizes, [decode] * 9) is None  # too many: eager
    assert padded_batch_size(sizes, [prefill, decode]) is None  # a prefill chunk: eager
    scoring = SequenceChunk([1], 4, [0, 1], False, scored_rows=1)  # a prompt token scored
    assert padded_batch_size(sizes, [decode, scoring]) is None  # its row's logits: eager
    assert padded_batch_size(sizes, []) is None


def test_graphs_are_refused_where_they_cannot_be_captured(tmp_path):
    cpu = torch.device("cpu")
    assert make_decode_graphs(None, None, "triton", 64, 0, cpu) is None  # off
    with pytest.raises(ConfigurationError, match="needs a CUDA device"):
        make_decode_graphs(None, None, "triton", 64, 8, cpu)
    with pytest.raises(ConfigurationError, match="needs attention_backend 'triton'"):
        make_decode_graphs(None, None, "torch", 64, 8, torch.device("cuda"))
    with pytest.raises(ConfigurationError, match="cuda_graph_max_batch_size=8 needs a CUDA device"):
        make_engine(
            str(write_tiny_checkpoint(tmp_path)),
            cuda_graph_max_batch_size=8,
            kv_cache_memory_gib=0.002,
        )
