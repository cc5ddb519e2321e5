"""Decode attention on CPU, block by block, reading runs of pages where they lie.

Same signature and result as `reference.decode_attention` (see it for the layout). Each
sequence's context is cut at fixed positions into blocks of `block_pages(page_size)`
pages (`BLOCK_TOKENS` tokens):

    tokens  0          256        512        768   800      (page size 16: 16 pages a block)
            |---full---|---full---|---full---|edge-|
             in place    gathered   in place   gathered, padded to a block and masked

A full block whose pages have consecutive ids is attended in place, as a zero-copy view
of the pool (a sequence's consecutive such blocks in one call, as a batch of views). The
other full blocks are gathered, slot by slot, into one tensor of the same layout and
attended in one call. Edge blocks (a sequence's last, partial block, and with a sliding
window the block the window starts in) are gathered padded to a whole block, the padding
re-reading an owned slot, and attended in one call with a mask; pages wholly before a
window are not read. A sequence's blocks are merged by their log-sum-exps, in order.

A block's result is the same bits however it was read and whatever else is in the
batch: a view and a gathered copy hold the same values in the same layout; the flash
kernel treats each batch entry alone; the query group is padded to a multiple of 8 rows,
which keeps each of the kernel's per-thread buffers 64-byte aligned (on a misaligned one
MKL's float32 GEMM rounds differently, so a block's bits would depend on the thread it
lands on); and the merge adds a sequence's blocks in order, missing ones weighing 0. So
a sequence's output does not depend on where its pages lie, and the page allocator's
runs (`radixserve/cache/page_allocator.py`) change the speed only.

The plan (which blocks, which slots) depends only on the page table, the lengths and the
window, which every layer of a step shares: the last plan for each window is kept with
copies of the first two and reused while they are equal (one comparison instead of some
thirty small ops per layer; a model that alternates local and global layers keeps two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.kernels import reference

# One attention call over a block costs about what gathering its 256 tokens does
# (kernels/bench_cpu_decode.py), so shorter blocks would not pay for their calls.
BLOCK_TOKENS = 256
GROUP_ROWS = 8  # the query group is padded to a multiple of this (see the module notes)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def block_pages(page_size: int) -> int:
    """Pages in a block: `BLOCK_TOKENS` worth, at least one."""
    return max(1, BLOCK_TOKENS // page_size)


@dataclass(frozen=True)
class DecodePlan:
    """How one batch's contexts are read, block by block."""

    page_table: torch.Tensor  # (B, W) copy, the key the plan was made for
    seq_lens: torch.Tensor  # (B,) copy
    page_size: int
    num_blocks: int  # blocks of the longest context: the merge grid's width
    views: list[tuple[int, int, int]]  # (b, first page id, blocks) per run read in place
    gather_pages: torch.Tensor | None  # (N * bp,) the gathered full blocks' pages
    gather_rows: torch.Tensor | None  # (N,) their sequences
    edge_slots: torch.Tensor | None  # (E * T,) the edge blocks' slots, padding re-reads
    edge_rows: torch.Tensor | None  # (E,) their sequences
    edge_mask: torch.Tensor | None  # (E, 1, 1, T) float32, 0 or -inf
    part_index: torch.Tensor  # (P,) each part's place b * num_blocks + block in the grid
    one_part_each: bool  # part b is sequence b's only block for every b: no merge needed


_last: dict[int, DecodePlan] = {}  # window -> the last plan made for it


def forget_plan() -> None:
    """Drop the kept plans (benchmarks time the planning with it)."""
    _last.clear()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, D): softmax(q k^T * scale) v over the tokens each b's query sees.
    Off the CPU this is the reference."""
    if q.device.type != "cpu":
        return reference.decode_attention(
            q, k_cache, v_cache, page_table, seq_lens, num_splits, window=window, scale=scale
        )
    batch, heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1:3]
    group = heads // num_kv_heads
    plan = _plan(page_table, seq_lens, page_size, window)
    rows_q = q.view(batch, num_kv_heads, group, head_dim)  # (B, H_kv, G, D)
    rows_q = F.pad(rows_q, (0, 0, 0, -group % GROUP_ROWS))  # (B, H_kv, G8, D)
    block = block_pages(page_size) * page_size
    outs, lses = [], []
    for b, page, count in plan.views:
        pages = slice(page, page + count * block // page_size)
        k = k_cache[pages].view(count, block, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache[pages].view(count, block, num_kv_heads, head_dim).transpose(1, 2)
        out, lse = _flash(rows_q[b : b + 1].expand(count, -1, -1, -1), k, v, scale=scale)
        outs.append(out)
        lses.append(lse)
    # Gathers index rows of a 2-D view, a page or a slot each: float32 index_select of
    # (slots, H_kv, D) rows runs about 10x slower than of the same bytes as (slots, H_kv * D).
    for rows, index, per, mask in (
        (plan.gather_rows, plan.gather_pages, k_cache.shape[0], None),
        (plan.edge_rows, plan.edge_slots, k_cache.shape[0] * page_size, plan.edge_mask),
    ):
        if rows is None or index is None:
            continue
        shape = (rows.numel(), block, num_kv_heads, head_dim)
        k = k_cache.view(per, -1).index_select(0, index).view(shape).transpose(1, 2)
        v = v_cache.view(per, -1).index_select(0, index).view(shape).transpose(1, 2)
        attn_mask = None if mask is None else mask.to(q.dtype)
        out, lse = _flash(rows_q[rows], k, v, attn_mask=attn_mask, scale=scale)  # (N, H_kv, T, D)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (P, H_kv, G8, D)
    if not plan.one_part_each:
        lse = lses[0] if len(lses) == 1 else torch.cat(lses)
        out = _merge(out, lse, plan.part_index, batch, plan.num_blocks)
    return out[:, :, :group].reshape(q.shape)


def _plan(
    page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, window: int
) -> DecodePlan:
    """The kept plan if it was made for these contents, else a new one (then kept)."""
    kept = _last.get(window)
    if kept is not None and _same(kept, page_table, seq_lens, page_size):
        return kept
    plan = _make_plan(page_table, seq_lens, page_size, window)
    _last[window] = plan
    return plan


def _same(
    plan: DecodePlan, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> bool:
    return (
        plan.page_size == page_size
        and torch.equal(plan.seq_lens, seq_lens)
        and torch.equal(plan.page_table, page_table)
    )


def _make_plan(
    page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, window: int
) -> DecodePlan:
    per_block = block_pages(page_size)
    block = per_block * page_size
    batch = seq_lens.numel()
    width = int((seq_lens.max() + block - 1) // block) if batch else 0
    first = (seq_lens - window).clamp(min=0) if window else torch.zeros_like(seq_lens)
    start = torch.arange(width)[None, :] * block  # (1, NB) each block's first token
    end = torch.minimum(start + block, seq_lens[:, None])  # (B, NB)
    live = end > torch.maximum(start, first[:, None])  # (B, NB) blocks with a token read
    full = live & (start >= first[:, None]) & (end - start == block)
    table = F.pad(page_table, (0, max(0, width * per_block - page_table.shape[1])))
    pages = table[:, : width * per_block].reshape(batch, width, per_block)  # (B, NB, bp)
    in_place = full & (pages[..., 1:] == pages[..., :-1] + 1).all(-1)  # (B, NB)
    views, view_index = _views(in_place, pages, width)
    gather_b, gather_j = (full & ~in_place).nonzero(as_tuple=True)  # (N,) each
    edge_b, edge_j = (live & ~full).nonzero(as_tuple=True)  # (E,) each
    edge_slots, edge_mask = _edge_slots(table, seq_lens, first, edge_b, edge_j, page_size, block)
    part_index = torch.cat([view_index, gather_b * width + gather_j, edge_b * width + edge_j])
    return DecodePlan(
        page_table=page_table.clone(), seq_lens=seq_lens.clone(), page_size=page_size,
        num_blocks=width, views=views,
        gather_pages=pages[gather_b, gather_j].flatten() if gather_b.numel() else None,
        gather_rows=gather_b if gather_b.numel() else None,
        edge_slots=edge_slots if edge_b.numel() else None,
        edge_rows=edge_b if edge_b.numel() else None,
        edge_mask=edge_mask if edge_b.numel() else None,
        part_index=part_index,
        one_part_each=width == 1 and torch.equal(part_index, torch.arange(batch)),
    )  # fmt: skip


def _views(
    in_place: torch.Tensor, pages: torch.Tensor, width: int
) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """The runs of blocks read in place, (b, first page, blocks) each: a sequence's
    consecutive in-place blocks whose pages continue one another; and the grid places
    of their blocks, in order (V,)."""
    follows = torch.zeros_like(in_place)  # (B, NB) block continues the one before it
    follows[:, 1:] = in_place[:, 1:] & in_place[:, :-1] & (pages[:, 1:, 0] == pages[:, :-1, -1] + 1)
    starts = in_place & ~follows
    run = (starts.long().cumsum(1) - 1).clamp(min=0)  # (B, NB) each block's run in its row
    counts = torch.zeros_like(run).scatter_add_(1, run, in_place.long())  # (B, NB)
    b_idx, j_idx = starts.nonzero(as_tuple=True)  # (R,) each
    count = counts[b_idx, run[b_idx, j_idx]]  # (R,) blocks per run
    views = list(zip(b_idx.tolist(), pages[b_idx, j_idx, 0].tolist(), count.tolist()))
    first = (b_idx * width + j_idx).repeat_interleave(count)  # (V,) each block's run start
    offset = torch.arange(first.numel()) - (count.cumsum(0) - count).repeat_interleave(count)
    return views, first + offset


def _edge_slots(
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    first: torch.Tensor,
    rows: torch.Tensor,
    blocks: torch.Tensor,
    page_size: int,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For E edge blocks (sequence `rows`, index `blocks`): their slots padded to whole
    blocks (E * T,), a padded position re-reading the block's first token read, and the
    additive mask (E, 1, 1, T) keeping tokens first[b]..seq_lens[b] - 1."""
    token = blocks[:, None] * block + torch.arange(block)  # (E, T)
    valid = (token < seq_lens[rows, None]) & (token >= first[rows, None])
    token = torch.where(valid, token, token.gather(1, valid.long().argmax(1, keepdim=True)))
    slots = table[rows[:, None], token // page_size] * page_size + token % page_size
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    return slots.flatten(), mask[:, None, None, :]


def _merge(
    outs: torch.Tensor, lses: torch.Tensor, index: torch.Tensor, batch: int, width: int
) -> torch.Tensor:
    """(B, H_kv, G, D) from blocks over disjoint keys: outputs (P, H_kv, G, D), their
    log-sum-exps (P, H_kv, G) float32 and places `index` (P,) b * width + block in a
    (B, width) grid. Each sequence's blocks are added in block order (a cumulative sum
    along the grid row, blocks it lacks weighing 0); a sequence without blocks is 0."""
    if width == 1:  # one block each: its output as it is (the merge would give the same)
        return outs.new_zeros((batch, *outs.shape[1:])).index_copy_(0, index, outs)
    grid_lse = lses.new_full((batch * width, *lses.shape[1:]), float("-inf"))
    grid_lse = grid_lse.index_copy_(0, index, lses).view(batch, width, *lses.shape[1:])
    grid_out = torch.zeros((batch * width, *outs.shape[1:]))
    grid_out = grid_out.index_copy_(0, index, outs.float()).view(batch, width, *outs.shape[1:])
    top = grid_lse.amax(1, keepdim=True)  # (B, 1, H_kv, G)
    weight = (grid_lse - top.masked_fill(top == float("-inf"), 0.0)).exp()  # (B, NB, H_kv, G)
    total = weight.cumsum(1)[:, -1]  # (B, H_kv, G)
    merged = (grid_out * weight[..., None]).cumsum(1)[:, -1]  # (B, H_kv, G, D)
    return (merged / total.clamp(min=1e-30)[..., None]).to(outs.dtype)
