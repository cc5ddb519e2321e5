"""Decode attention on CPU that reads long runs of pages where they lie.

Same signature and result as `reference.decode_attention` (see it for the layout). Each
sequence's pages split into runs of consecutive page ids. A run of at least
`MIN_VIEW_PAGES` pages is attended in place, as a zero-copy view of the pool. The pages
outside such runs (decode pages interleaved with other sequences', scattered pages) are
gathered slot by slot as in the reference, for all sequences in one padded tensor and one
masked attention. Every part returns its log-sum-exp, and a sequence's parts are merged
by those: softmax is invariant to the order of keys, so a part may hold pages in any
order. A view of the run holding a sequence's last page is cut at its length, and the
gather's padding re-reads an owned slot, so no slot past a sequence's end is read.

With a sliding window w > 0 the pages wholly before a sequence's last w tokens are left
out of the runs and the gather; the first page left in is cut at the window's start (a
view starts there, the gather masks the tokens before it).

The plan (which runs, which slots) depends only on the page table, the lengths and the
window, which every layer of a step shares: the last plan for each window is kept with
copies of the first two and reused while they are equal (one comparison instead of some
thirty small ops per layer; a model that alternates local and global layers keeps two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels import reference

# Shorter runs are cheaper gathered with the rest than attended alone (one attention call
# costs about what gathering 256 tokens does; kernels/bench_cpu_decode.py).
MIN_VIEW_PAGES = 16

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class DecodePlan:
    """How one batch's contexts are read: views of the pool, then one gather."""

    page_table: torch.Tensor  # (B, W) copy, the key the plan was made for
    seq_lens: torch.Tensor  # (B,) copy
    page_size: int
    views: list[tuple[int, int, int, int]]  # (b, first page id, skip, end) per long run:
    # tokens [skip, end) of the run's pages
    gather_rows: torch.Tensor | None  # (R,) sequences with pages outside long runs
    gather_slots: torch.Tensor | None  # (R * S,) their slots, padding re-reads an owned one
    gather_mask: torch.Tensor | None  # (R, 1, 1, S) float32, 0 or -inf
    part_rows: torch.Tensor  # (P,) each part's sequence: views in order, then gather rows
    one_part_each: bool  # part p is sequence p for every p: no merge needed


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
    plan = _plan(page_table, seq_lens, page_size, window)
    rows_q = q.view(batch, num_kv_heads, heads // num_kv_heads, head_dim)  # (B, H_kv, G, D)
    outs, lses = [], []
    for b, page, skip, end in plan.views:
        length = -(-end // page_size)
        k = k_cache[page : page + length].view(-1, num_kv_heads, head_dim)[skip:end]
        v = v_cache[page : page + length].view(-1, num_kv_heads, head_dim)[skip:end]
        out, lse = _flash(
            rows_q[b : b + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
        )
        outs.append(out)
        lses.append(lse)
    if plan.gather_rows is not None:
        assert plan.gather_slots is not None and plan.gather_mask is not None
        shape = (plan.gather_rows.numel(), -1, num_kv_heads, head_dim)
        k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.gather_slots)
        v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.gather_slots)
        out, lse = _flash(
            rows_q[plan.gather_rows], k.view(shape).transpose(1, 2),
            v.view(shape).transpose(1, 2), attn_mask=plan.gather_mask.to(q.dtype), scale=scale,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape)
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # (P, H_kv, G, D)
    if not plan.one_part_each:
        out = _merge(out, torch.cat(lses), plan.part_rows, batch)
    return out.view(q.shape)


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
    num_pages = (seq_lens + page_size - 1) // page_size  # (B,)
    column = torch.arange(page_table.shape[1])[None, :]
    owned = column < num_pages[:, None]  # (B, W) columns read
    first_token = (seq_lens - window).clamp(min=0) if window else torch.zeros_like(seq_lens)
    if window:  # not the pages wholly before the window
        owned &= column >= (first_token // page_size)[:, None]
    starts = owned.clone()
    starts[:, 1:] &= (page_table[:, 1:] != page_table[:, :-1] + 1) | ~owned[:, :-1]
    run = (starts.cumsum(1) - 1).clamp(min=0)  # (B, W) each column's run, counted in b
    run_pages = torch.zeros_like(run).scatter_add_(1, run, owned.long()).gather(1, run)
    in_view = owned & (run_pages >= MIN_VIEW_PAGES)  # (B, W) columns read in place
    b_idx, c_idx = (starts & in_view).nonzero(as_tuple=True)
    run_start = c_idx * page_size  # (V,) the views' first tokens
    view_end = torch.minimum(run_pages[b_idx, c_idx] * page_size, seq_lens[b_idx] - run_start)
    view_skip = (first_token[b_idx] - run_start).clamp(min=0)
    views = list(zip(b_idx.tolist(), page_table[b_idx, c_idx].tolist(), view_skip.tolist(),
                     view_end.tolist()))  # fmt: skip
    rows, slots, mask = _gather_plan(page_table, seq_lens, first_token, owned & ~in_view, page_size)
    part_rows = b_idx if rows is None else torch.cat([b_idx, rows])
    batch = seq_lens.numel()
    return DecodePlan(
        page_table=page_table.clone(), seq_lens=seq_lens.clone(), page_size=page_size,
        views=views,
        gather_rows=rows, gather_slots=slots, gather_mask=mask, part_rows=part_rows,
        one_part_each=bool(part_rows.numel() == batch
                           and (part_rows == torch.arange(batch)).all()),
    )  # fmt: skip


def _gather_plan(
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    first_token: torch.Tensor,
    rest: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """For the `rest` (B, W) columns: the rows that have some (R,), the slots of a padded
    (R, S) gather and its additive mask (R, 1, 1, S), which keeps tokens first_token[b]..
    seq_lens[b] - 1; Nones when there are none."""
    rows = rest.any(1).nonzero().flatten()  # (R,)
    if rows.numel() == 0:
        return None, None, None
    rest = rest[rows]
    count = rest.sum(1)  # (R,) pages each
    # Each row's rest columns first, in order; the last page, if among them, ends it.
    order = (~rest).to(torch.int8).argsort(dim=1, stable=True)[:, : int(count.max())]
    pages = page_table[rows].gather(1, order)  # (R, W_r)
    pos = torch.arange(pages.shape[1] * page_size)[None, :].expand(rows.numel(), -1)
    token = order.gather(1, pos // page_size) * page_size + pos % page_size  # (R, S) position
    valid = (pos < count[:, None] * page_size) & (token < seq_lens[rows, None])
    valid &= token >= first_token[rows, None]
    slots = pages.gather(1, pos // page_size) * page_size + pos % page_size
    slots = torch.where(valid, slots, slots[:, :1])
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
    return rows, slots.flatten(), mask[:, None, None, :]


def _merge(outs: torch.Tensor, lses: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, H_kv, G, D) from parts over disjoint keys: outputs (P, H_kv, G, D), their
    log-sum-exps (P, H_kv, G) float32 and sequences (P,); a sequence without parts is 0."""
    index = rows.view(-1, 1, 1).expand_as(lses)
    top = torch.full((batch, *lses.shape[1:]), float("-inf"))
    top.scatter_reduce_(0, index, lses, "amax")  # (B, H_kv, G)
    weight = (lses - top[rows]).exp()  # (P, H_kv, G)
    total = torch.zeros_like(top).index_add_(0, rows, weight)
    merged = torch.zeros((batch, *outs.shape[1:])).index_add_(
        0, rows, outs.float() * weight[..., None]
    )
    return (merged / total.clamp(min=1e-30)[..., None]).to(outs.dtype)
