"""The scheduler's fair share between tenants (`radixserve.engine.fair_share`): a tenant
arriving behind another's flood is served in the next step, the step's prefill tokens are
split by weight, a lower priority value goes first whatever the tenant, a tenant under
its share of slots takes one from the tenant furthest over it, pages are taken from the
worst priority first; with one tenant the schedule is first come, first served, exactly
as without tenants. The scheduler runs on a real page allocator; sampling is a stand-in
(one token per request that reached its newest token)."""

from __future__ import annotations

from collections import Counter

from radixserve.engine.fair_share import DeficitRoundRobin, FairQueue, share_rows
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.request import Request, RequestStatus
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import Scheduler
from radixserve.kernels.cpu.decode_attention import block_pages

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def request(
    rid: str, tokens: int, tenant: str = "", priority: int = 0, weight: float = 1.0
) -> Request:
    # the scheduler reads token counts only: no detokenizer is needed
    return Request(rid, list(range(tokens)), PARAMS, detokenizer=None,  # type: ignore[arg-type]
                   tenant=tenant, priority=priority, weight=weight)  # fmt: skip


def scheduler(max_num_seqs: int = 16, budget: int = 256, num_pages: int = 4096) -> Scheduler:
    kv = KVCacheManager(num_pages, 16, block_pages(16))
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                     prefill_chunk_tokens=64, fair_quantum_tokens=32)  # fmt: skip


def step(s: Scheduler) -> dict[str, int]:
    """One step: the batch (request id -> tokens), accounted, a token sampled for each
    request at its newest token, finished at ``max_tokens``."""
    batch = s.schedule()
    if batch is None:
        return {}
    s.after_step(batch)
    for req in batch.requests:
        if req.num_computed == req.num_tokens:
            req.output_ids.append(1)
            if len(req.output_ids) >= req.params.max_tokens:
                s.finish(req, "length")
    return dict(zip((r.request_id for r in batch.requests), batch.num_new_tokens))


def tenant_tokens(batch: dict[str, int], prefix: str) -> int:
    return sum(n for rid, n in batch.items() if rid.startswith(prefix))


def test_a_tenant_arriving_behind_a_flood_is_scheduled_in_the_next_step() -> None:
    def run(b_tenant: str) -> list[dict[str, int]]:
        s = scheduler()
        for i in range(10):
            s.add(request(f"a{i}", 300, tenant="a"))
        steps = [step(s)]
        s.add(request("b0", 100, tenant=b_tenant))  # longer than a chunk: no short path
        steps += [step(s) for _ in range(3)]
        return steps

    fair = run("b")
    assert set(fair[0]) == {"a0", "a1", "a2", "a3"}  # one tenant: oldest first
    assert fair[1]["b0"] == 64  # its first chunk in the very next step
    assert tenant_tokens(fair[1], "a") == 256 - 64
    assert fair[2]["b0"] == 36  # and the rest in the one after
    # the same request as the flooding tenant's own waits behind all of its queue
    alone = run("a")
    assert all("b0" not in batch for batch in alone)


def test_the_prefill_budget_is_split_by_weight() -> None:
    for weight_a, share_a in ((1.0, 128), (3.0, 192)):
        s = scheduler(budget=256)
        for i in range(6):
            s.add(request(f"a{i}", 2000, tenant="a", weight=weight_a))
            s.add(request(f"b{i}", 2000, tenant="b"))
        steps = [step(s) for _ in range(8)]
        for batch in steps:
            assert sum(batch.values()) == 256  # work-conserving
            assert abs(tenant_tokens(batch, "a") - share_a) <= 32, (weight_a, batch)
        total_a = sum(tenant_tokens(b, "a") for b in steps)
        assert abs(total_a - 8 * share_a) <= 32  # the credit carries over: exact on average


def test_a_grant_a_tenant_cannot_use_goes_to_the_others() -> None:
    s = scheduler(budget=256)
    for i in range(4):
        s.add(request(f"a{i}", 2000, tenant="a"))
    s.add(request("b0", 20, tenant="b"))  # wants 20 tokens, then decodes
    first = step(s)
    assert first["b0"] == 20 and tenant_tokens(first, "a") == 236


def test_a_lower_priority_value_goes_first_whatever_the_tenant() -> None:
    s = scheduler(max_num_seqs=2, budget=1000)
    for i in range(3):
        s.add(request(f"a{i}", 100, tenant="a"))
    s.add(request("b0", 100, tenant="b", priority=-1))
    s.add(request("c0", 100, tenant="a", priority=5))
    first = step(s)
    assert list(first) == ["b0", "a0"]  # b0 arrived after a0..a2; c0 after all
    # all slots taken: a more urgent request takes the slot of the newest least urgent one
    urgent = request("d0", 30, tenant="c", priority=-5)
    s.add(urgent)
    second = step(s)
    assert "d0" in second and "a0" not in second
    a0 = next(r for r in s.waiting if r.request_id == "a0")
    assert a0.status is RequestStatus.WAITING and a0.num_computed == 0
    assert s.waiting.ordered(0)[0] is a0  # first in line again among its tenant's


def test_a_tenant_under_its_share_of_slots_takes_one_from_the_tenant_over_it() -> None:
    def run(b_tenant: str) -> tuple[Scheduler, list[dict[str, int]]]:
        s = scheduler(max_num_seqs=4, budget=1000)
        for i in range(6):
            s.add(request(f"a{i}", 200, tenant="a"))
        steps = [step(s)]
        s.add(request("b0", 30, tenant=b_tenant))  # a cached turn's short delta
        steps += [step(s) for _ in range(2)]
        return s, steps

    s, steps = run("b")
    assert set(steps[0]) == {"a0", "a1", "a2", "a3"}
    assert steps[1]["b0"] == 30 and "a3" not in steps[1]  # the newest of a's gave its slot
    assert "a3" not in steps[2]  # and a, over its share (2 of 4), does not take it back
    assert [r.request_id for r in s.waiting.ordered(0)][:2] == ["a3", "a4"]
    # one tenant: no slot is taken from anyone, the request waits its turn
    _, alone = run("a")
    assert all("b0" not in batch for batch in alone)


def test_out_of_pages_the_newest_of_the_worst_priority_is_preempted() -> None:
    s = scheduler(num_pages=4)
    held = {"x": (16, 0), "y": (32, 5), "z": (16, 0)}  # prompt tokens, priority; z newest
    for rid, (tokens, priority) in held.items():
        req = request(rid, tokens, priority=priority)
        req.page_ids = s.kv.allocator.alloc(tokens // 16, owner=rid)
        req.num_computed = tokens
        req.output_ids.append(1)  # each decodes its first output: a page more each
        req.status = RequestStatus.RUNNING
        s.running.append(req)
    assert s.kv.allocator.num_free == 0
    batch = step(s)
    assert batch == {"x": 1, "z": 1}  # y (priority 5) was preempted, not z (the newest)
    assert [r.request_id for r in s.waiting] == ["y"]
    s.kv.allocator.check_integrity()


def test_one_tenant_is_first_come_first_served_as_without_tenants() -> None:
    def run(tenant: str, weight: float) -> list[dict[str, int]]:
        s = scheduler(max_num_seqs=3, budget=128, num_pages=64)
        steps = []
        for i, tokens in enumerate((300, 20, 150, 40, 90, 16, 200)):
            s.add(request(f"r{i}", tokens, tenant=tenant, weight=weight))
            steps.append(step(s))
        while s.has_work:
            steps.append(step(s))
        s.kv.allocator.check_integrity()
        return steps

    plain = run("", 1.0)
    assert run("acme", 2.5) == plain  # a tenant of its own changes nothing
    first_seen = list(dict.fromkeys(rid for batch in plain for rid in batch))
    # admitted oldest first, but for the short deltas that skip ahead of long prompts
    assert first_seen == ["r0", "r1", "r2", "r3", "r5", "r4", "r6"]


def test_the_queue_interleaves_tenants_by_weight() -> None:
    q = FairQueue()
    for i in range(4):
        q.append(request(f"a{i}", 10, tenant="a", weight=2.0))
    for i in range(2):
        q.append(request(f"b{i}", 10, tenant="b"))
    q.append(request("u0", 10, tenant="b", priority=-1))
    assert [r.request_id for r in q.ordered(0)] == ["a0", "b0", "a1", "a2", "b1", "a3"]
    assert [r.request_id for r in q.ordered(-1)] == ["u0"]
    assert sorted(q.priorities()) == [-1, 0] and len(q) == 7


def test_deficit_round_robin_carries_the_turn_across_steps() -> None:
    drr = DeficitRoundRobin(quantum_tokens=100)
    weights = {"a": 1.0, "b": 1.0}
    assert drr.split({"a": 1000, "b": 1000}, weights, 150) == {"a": 100, "b": 50}
    # b's turn was cut by the budget: it resumes with what it had left, then a
    assert drr.split({"a": 1000, "b": 1000}, weights, 150) == {"a": 100, "b": 50}
    assert drr.split({"a": 1000, "b": 10}, weights, 150) == {"a": 140, "b": 10}
    assert drr.split({"a": 1000}, weights, 150) == {"a": 150}


def test_share_rows_is_max_min_fair_by_weight() -> None:
    """A flood's 12 decodes beside one other tenant's: the other gets its row, the flood
    the rest of ``rows``; a tenant at its share keeps it, weights split in proportion;
    at least a row for every tenant; one tenant, few rows, or every tenant past its
    share (a cut would shield nobody) takes every decode."""

    def rows(counts: dict[str, int], budget: int, weights: dict[str, float] | None = None):
        decodes = [request(f"{t}{i}", 4, tenant=t, weight=(weights or {}).get(t, 1.0))
                   for t, n in counts.items() for i in range(n)]  # fmt: skip
        taken = share_rows(decodes, budget, {})
        return Counter(r.tenant for r in taken)

    assert rows({"chat": 1, "flood": 12}, 4) == {"chat": 1, "flood": 3}
    assert rows({"a": 12, "b": 4}, 8) == {"a": 4, "b": 4}
    assert rows({"a": 12, "b": 3, "c": 1}, 9) == {"a": 5, "b": 3, "c": 1}
    assert rows({"a": 12, "b": 3}, 9, {"a": 2.0}) == {"a": 6, "b": 3}
    assert rows({"a": 12, "b": 12}, 8) == {"a": 12, "b": 12}  # both past their share
    assert rows({t: 1 for t in "abcdefghij"}, 4) == {t: 1 for t in "abcdefghij"}
    assert rows({"a": 20}, 4) == {"a": 20}
    assert rows({"a": 3, "b": 1}, 8) == {"a": 3, "b": 1}


def test_a_flood_of_decodes_shares_the_step_rows_and_every_stream_advances() -> None:
    """With fair_step_rows 4, one tenant's 12 decoding streams beside another's one: the
    other's stream decodes in every step, each step has 4 decode rows, and over 4 steps
    every one of the flood's streams advanced (the longest-waiting go first)."""
    kv = KVCacheManager(4096, 16, block_pages(16))
    s = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=16, prefill_chunk_tokens=64,
                  fair_quantum_tokens=32, fair_step_rows=4)  # fmt: skip
    flood = [request(f"f{i}", 8, tenant="flood") for i in range(12)]
    for req in flood:
        req.params = SamplingParams(max_tokens=100, temperature=0.0)
        s.add(req)
    chat = request("chat", 8, tenant="chat")
    chat.params = SamplingParams(max_tokens=100, temperature=0.0)
    s.add(chat)
    while any(not r.output_ids for r in (*flood, chat)):  # the prompts
        step(s)
    advanced: Counter[str] = Counter()
    for _ in range(4):
        batch = step(s)
        assert batch.get("chat") == 1 and len(batch) == 4
        advanced.update(rid for rid in batch if rid.startswith("f"))
    assert set(advanced) == {r.request_id for r in flood}  # each of the 12 ran once
    assert set(advanced.values()) == {1}


def test_without_fair_step_rows_every_decode_runs_in_every_step() -> None:
    s = scheduler()
    reqs = [request(f"{t}{i}", 8, tenant=t) for t in "ab" for i in range(6)]
    for req in reqs:
        req.params = SamplingParams(max_tokens=100, temperature=0.0)
        s.add(req)
    while any(not r.output_ids for r in reqs):
        step(s)
    assert len(step(s)) == 12
