"""A step's inputs are one int64 buffer (one host-to-device copy) holding the flat
attention metadata; padding rows write no KV and change no real row's logits."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.forward_batch import SequenceChunk, buffer_len, build_forward_batch
from tests.engine.engine_helpers import make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

CPU = torch.device("cpu")


def test_layout_of_a_mixed_step():
    chunks = [
        SequenceChunk([11, 12, 13], 5, [7, 3, 9], True),  # prefix ends mid-page (size 4)
        SequenceChunk([21, 22], 0, [4], False),  # a middle chunk of a longer prompt
        SequenceChunk([31], 9, [1, 2, 8], True),  # a decode
    ]
    fb = build_forward_batch(chunks, 4, CPU)
    meta = fb.attn
    assert fb.input_ids.tolist() == [11, 12, 13, 21, 22, 31]
    assert fb.positions.tolist() == [5, 6, 7, 0, 1, 9]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 16, 17, 8 * 4 + 1]
    assert fb.logits_indices.tolist() == [2, 5]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert meta.prefix_lens.tolist() == [5, 0, 9]
    assert meta.seq_lens.tolist() == [8, 2, 10]
    assert meta.page_table.tolist() == [[7, 3, 0], [4, 0, 0], [1, 2, 8]]
    assert (meta.num_extends, meta.num_extend_tokens) == (2, 5)
    assert (meta.max_query_len, meta.max_seq_len) == (3, 10)
    storage = {t.untyped_storage().data_ptr() for t in (fb.input_ids, meta.page_table)}
    assert len(storage) == 1  # every tensor is a view of the one copied buffer


def test_scored_prompt_rows_follow_the_sampling_rows():
    chunks = [
        SequenceChunk([11, 12, 13], 0, [7], False, scored_rows=3),  # a prompt's first chunk
        SequenceChunk([21, 22, 23], 4, [4, 5], True, scored_rows=2),  # its last: 2 scored
        SequenceChunk([31], 9, [1, 2, 8], True),  # a decode
    ]
    fb = build_forward_batch(chunks, 4, CPU)
    # sampling rows in chunk order, then each chunk's scored rows in chunk order
    assert fb.logits_indices.tolist() == [5, 6, 0, 1, 2, 3, 4]
    with pytest.raises(AssertionError, match="nothing scored"):
        build_forward_batch([SequenceChunk([1], 3, [0], False, 1)], 4, CPU, pad_to=2)


def test_decodes_must_follow_extends():
    chunks = [SequenceChunk([1], 3, [0], True), SequenceChunk([2, 3], 0, [1], True)]
    with pytest.raises(AssertionError, match="extends must come before decodes"):
        build_forward_batch(chunks, 4, CPU)


def test_padding_to_a_bucket_into_a_static_buffer():
    chunks = [SequenceChunk([5], 6, [2, 3], True), SequenceChunk([6], 0, [1], False)]
    static = torch.full((buffer_len(4, 4, 4, 3),), -7, dtype=torch.int64)
    fb = build_forward_batch(chunks, 4, CPU, pad_to=4, table_width=3, out=static)
    assert fb.input_ids.untyped_storage().data_ptr() == static.untyped_storage().data_ptr()
    assert fb.attn.slot_mapping.tolist() == [3 * 4 + 2, 4, -1, -1]
    assert fb.attn.seq_lens.tolist() == [7, 1, 0, 0]
    assert fb.logits_indices.tolist() == [0, 1, 2, 3]  # every row, in row order
    assert fb.attn.page_table.tolist() == [[2, 3, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert fb.attn.max_seq_len == 12  # the table's reach, fixed for a captured graph
    assert not (static == -7).any()


def test_padded_decode_gives_the_same_logits_and_leaves_the_pool_alone(tmp_path):
    engine = make_engine(
        str(write_tiny_checkpoint(tmp_path)), page_size=4, kv_cache_memory_gib=0.002
    )
    pages = engine.allocator.alloc(6)
    with torch.inference_mode():
        ids = list(range(3, 22))  # two prompts: 11 and 8 tokens
        prefill = [SequenceChunk(ids[:11], 0, pages[:3], True),
                   SequenceChunk(ids[11:], 0, pages[3:], True)]  # fmt: skip
        fb = build_forward_batch(prefill, 4, engine.device)
        engine.model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn, fb.logits_indices)
        decodes = [
            SequenceChunk([40], 11, pages[:3], True),
            SequenceChunk([41], 8, pages[3:], True),
        ]
        logits = []
        for pad_to in (None, 5):
            for page, slot in ((pages[2], 3), (pages[5], 0)):  # marked: the step writes them
                engine.kv_pool.kv[:, :, page, slot] = 1234.0
            before = engine.kv_pool.kv.clone()
            fb = build_forward_batch(decodes, 4, engine.device, pad_to=pad_to, table_width=7)
            out = engine.model(
                fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn, fb.logits_indices
            )
            changed = (engine.kv_pool.kv != before).flatten(4).any(-1)  # (L, 2, P, slot)
            assert changed.nonzero()[:, 2:].unique(dim=0).tolist() == [[pages[2], 3], [pages[5], 0]]
            logits.append(out)
    assert logits[1].shape[0] == 5
    torch.testing.assert_close(logits[1][:2], logits[0], atol=1e-6, rtol=1e-6)
    assert torch.isfinite(logits[1]).all()
    engine.allocator.decref(pages)
