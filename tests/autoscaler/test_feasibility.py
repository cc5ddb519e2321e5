"""Only what replicas can fix is scaled for, on synthetic metric series (no processes):
requests whose own prefill exceeds the TTFT target are counted and reported but never
add a prefill replica, queueing of feasible requests does, a mix scales for its
queueing part alone; the per-token budget, the ITL split, diminishing returns and the
replica-seconds ceiling; and the histogram and queueing arithmetic they stand on."""

from __future__ import annotations

import math

import pytest

from radixserve.metrics import PREFILL_TOKENS_BUCKETS, PREFILL_WAIT_BUCKETS
from radixserve.services.autoscaler.demand import RequestWindow
from radixserve.services.autoscaler.feasibility import (
    REMEDIES,
    infeasible_threshold,
    predicted_late_share,
    prefill_split,
    request_target_s,
)
from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.queueing import erlang_c, mean_wait_s, next_replica_gain
from tests.autoscaler.test_policy import (
    DT,
    PREFILL_RATE,
    by_role,
    decode_sample,
    observe,
    prefill_sample,
    settings,
)

LONG = 40_000  # uncached tokens: 5 s of one replica's compute, over the 1 s TTFT target
SHORT = 1_000  # 0.125 s


def interval(t: float, pools: dict[str, int], requests: list[tuple[int, float]], **kw):
    """One interval in which ``requests`` — (uncached tokens, wait before its own
    compute) — got their first token; TTFT p90, demand and the prefill workers' samples
    follow from them at `PREFILL_RATE`."""
    ttfts = sorted(tokens / PREFILL_RATE + wait for tokens, wait in requests)
    tokens_per_s = sum(tokens for tokens, _ in requests) / DT
    return observe(
        t, pools, prefill_tps=tokens_per_s, ttft=ttfts[math.ceil(0.9 * len(ttfts)) - 1],
        rps=len(requests) / DT, workers=[prefill_sample(tokens_per_s / pools["prefill"])],
        tokens=Histogram.of([tokens for tokens, _ in requests], PREFILL_TOKENS_BUCKETS),
        waits=Histogram.of([wait for _, wait in requests], PREFILL_WAIT_BUCKETS), **kw,
    )  # fmt: skip


def run(policy: ScalingPolicy, pools: dict[str, int], requests, seconds: float = 600.0):
    """The prefill decisions over ``seconds`` of the same interval, pools following them."""
    out = []
    for i in range(int(seconds / DT)):
        d = by_role(policy.decide(interval(i * DT, pools, requests)))["prefill"]
        pools["prefill"] = d.desired
        out.append(d)
    return out


def test_a_stream_of_infeasible_requests_alone_never_scales_prefill_up():
    # 2 requests of 40k tokens per 10 s: 8k tokens/s, which 3 replicas carry at 1/3 load;
    # each takes 5 s alone, so every one misses the 1 s target whatever the pool
    pools = {"prefill": 3, "decode": 1}
    decisions = run(ScalingPolicy(settings()), pools, [(LONG, 0.0), (LONG, 0.002)])
    assert all(d.direction != "up" for d in decisions), [d.reason for d in decisions]
    assert all(d.infeasible == pytest.approx(2.0) for d in decisions)
    assert all(d.inputs["late_share"] is None for d in decisions)  # no feasible request
    assert "prefill_tp" in REMEDIES["ttft"][0]
    assert "--prefill-tp" in decisions[-1].advice and "TTFT_PER_1K_TOKENS_S" in decisions[-1].advice
    assert "2 of 2" not in decisions[-1].advice and "(100%)" in decisions[-1].advice
    # the same series judged on raw TTFT (workers without the per-request split) buys
    # replicas that fix nothing, up to the bound: what the split prevents
    raw = {"prefill": 3, "decode": 1}
    policy = ScalingPolicy(settings())
    for i in range(60):
        obs = interval(i * DT, raw, [(LONG, 0.0), (LONG, 0.002)])
        obs = type(obs)(**{**obs.__dict__, "prefill_request_tokens": None, "prefill_wait": None})
        raw["prefill"] = by_role(policy.decide(obs))["prefill"].desired
    assert raw["prefill"] == 6  # max_prefill


def test_queueing_of_feasible_requests_scales_prefill_up():
    # 50 requests of 1k tokens per 10 s on one replica (5k tokens/s: 62 % of it), 10 of
    # them waited 1.5 s behind the others before their own compute: late
    queued = [(SHORT, 0.0)] * 40 + [(SHORT, 1.5)] * 10
    policy = ScalingPolicy(settings())
    p = by_role(policy.decide(interval(0, {"prefill": 1, "decode": 1}, queued)))["prefill"]
    assert (p.direction, p.desired, p.kind) == ("up", 2, "slo_queue_wait"), p
    assert p.inputs["late_share"] == pytest.approx(0.2) and p.infeasible == 0
    # the same requests, none of them held up: nothing to fix
    policy = ScalingPolicy(settings())
    served = [(SHORT, 0.01)] * 50
    p = by_role(policy.decide(interval(0, {"prefill": 1, "decode": 1}, served)))["prefill"]
    assert p.direction == "hold" and p.inputs["late_share"] == 0.0


def test_a_mix_scales_only_for_its_queueing_part():
    # 3 long requests (15 %: TTFT p90 is 5 s either way) and 17 short ones per 10 s, on
    # 4 replicas: 1.7 replicas' worth of work, which the queueing model sizes at 4
    infeasible = [(LONG, 0.0)] * 3
    pools = {"prefill": 4, "decode": 1}
    # the feasible requests were served at once: the pool holds, the long ones counted
    decisions = run(ScalingPolicy(settings()), pools, infeasible + [(SHORT, 0.005)] * 17)
    assert all(d.direction != "up" for d in decisions) and pools["prefill"] == 4
    assert decisions[0].inputs["ttft_p90_s"] > 1.0  # raw TTFT says "broken"
    assert all(d.infeasible == pytest.approx(3.0) for d in decisions)
    # the feasible requests waited 1.5 s: one replica for that queueing, no more, and
    # the long requests still counted apart
    policy = ScalingPolicy(settings())
    late = infeasible + [(SHORT, 1.5)] * 17
    p = by_role(policy.decide(interval(0, {"prefill": 4, "decode": 1}, late)))["prefill"]
    assert (p.direction, p.desired, p.kind) == ("up", 5, "slo_queue_wait"), p
    # (the waits are known per pool, not per request: 17 of 20 waited)
    assert p.infeasible == pytest.approx(3.0) and p.inputs["late_share"] == pytest.approx(0.85)


def test_a_per_token_budget_makes_long_prompts_feasible():
    # 0.2 s per 1k tokens: a 40k prompt's target is 8 s, more than its 5 s of compute
    assert request_target_s(LONG, 1.0, 0.2) == 8.0 and request_target_s(SHORT, 1.0, 0.2) == 1.0
    assert infeasible_threshold(PREFILL_RATE, 1.0, 0.2) == math.inf
    assert infeasible_threshold(PREFILL_RATE, 1.0, 0.1) == PREFILL_RATE  # budget < compute
    assert infeasible_threshold(None, 1.0, None) == math.inf  # rate unknown: nothing judged
    tokens = Histogram.of([LONG, LONG, SHORT], PREFILL_TOKENS_BUCKETS)
    waits = Histogram.of([2.0, 2.0, 0.0], PREFILL_WAIT_BUCKETS)
    # the waits are the pool's (a wait is taken as independent of the request's size):
    # the short request, with 0.875 s of slack, is late with probability 2/3
    plain = prefill_split(tokens, waits, PREFILL_RATE, 1.0, None)
    assert plain.infeasible == pytest.approx(2.0) and plain.late_share == pytest.approx(2 / 3)
    # with the budget the long ones are feasible, with ~3 s of slack: a 2 s wait is on time
    budget = prefill_split(tokens, waits, PREFILL_RATE, 1.0, 0.2)
    assert budget.infeasible == 0 and budget.late_share == pytest.approx(2 / 9)
    policy = ScalingPolicy(settings(ttft_per_1k_tokens_s=0.2))
    pools = {"prefill": 3, "decode": 1}
    decisions = run(policy, pools, [(LONG, 0.0), (LONG, 0.002)], seconds=100)
    assert all(d.infeasible == 0 and not d.advice and d.direction != "up" for d in decisions)


def test_itl_over_target_for_one_sequence_alone_does_not_scale_decode():
    # a model whose one-sequence step takes 60 ms against a 50 ms ITL target, 2 replicas
    # generating 300 tokens/s (~11 sequences each, 77 ms steps); once its step-time model
    # is learned (until then latency is all there is to go by)
    policy = ScalingPolicy(settings())
    pools = {"prefill": 1, "decode": 2}
    for i, batch in enumerate([10, 30, 50, 70] * 10):
        sample = decode_sample(batch, slow=5.0)  # t(B) = 60 ms + 1.5 ms * B
        d = by_role(policy.decide(observe(i * DT, pools, out_tps=300, itl=0.08, rps=2,
                                          workers=[sample])))  # fmt: skip
        assert i < 2 or d["decode"].direction != "up", d["decode"]
    assert d["decode"].inputs["itl_own_s"] == pytest.approx(0.0615, abs=1e-3)
    assert d["decode"].infeasible == 20 and "--decode-tp" in d["decode"].advice
    # a fast model at the same ITL: load is the cause, and decode grows
    policy = ScalingPolicy(settings())
    for i, batch in enumerate([40, 80, 120, 160]):
        d = by_role(policy.decide(observe(i * DT, pools, out_tps=1000, itl=0.03,
                                          workers=[decode_sample(batch)])))  # fmt: skip
    d = by_role(policy.decide(observe(50, pools, out_tps=1000, itl=0.08,
                                      workers=[decode_sample(150)])))  # fmt: skip
    assert d["decode"].direction == "up" and d["decode"].infeasible == 0


def test_a_replica_that_cannot_shorten_the_wait_is_not_bought():
    # 10 replicas and one replica's worth of work, yet every request waited 0.95 s: not
    # queueing (say, a slow transfer), which the queueing model says 10 replicas do not
    # make at this load, nor would 11; the breach lasts, the model's load grows with its
    # correction, and still no replica is worth its cost
    policy = ScalingPolicy(settings(max_prefill=16))
    pools = {"prefill": 10, "decode": 1}
    decisions = run(policy, pools, [(SHORT, 0.95)] * 80, seconds=300)
    assert all(d.direction != "up" for d in decisions), [d.reason for d in decisions]
    assert {d.kind for d in decisions} == {"diminishing_returns"}, decisions[0]
    assert decisions[-1].inputs["correction"] == 4.0
    # the same waits on one replica at 1.6x its capacity are queueing: it grows
    policy = ScalingPolicy(settings())
    d = by_role(policy.decide(interval(0, {"prefill": 1, "decode": 1}, [(SHORT, 0.95)] * 130)))
    assert d["prefill"].direction == "up"


def test_the_replica_seconds_ceiling_caps_both_pools():
    with pytest.raises(ValueError, match="below the pools' minimum"):
        settings(max_replica_seconds_per_interval=10.0)  # 1 + 1 replicas need 20
    policy = ScalingPolicy(settings(max_replica_seconds_per_interval=40.0))  # 4 replicas
    d = by_role(policy.decide(observe(0, {"prefill": 1, "decode": 1}, prefill_tps=50000,
                                      ttft=5.0, workers=[prefill_sample(7900)])))  # fmt: skip
    assert d["prefill"].desired == 3 and d["prefill"].kind == "ceiling", d["prefill"]
    assert d["prefill"].desired + d["decode"].desired <= 4


def test_histograms_answer_like_prometheus():
    h = Histogram.of([1.0, 2.0, 3.0, 10.0], (2.0, 4.0))
    assert h.counts == (2, 1, 1) and h.total == 4
    assert h.count_above(3.0) == pytest.approx(1.5)  # half of (2, 4], and the open top
    assert h.quantile(0.5) == 2.0 and h.quantile(1.0) == 4.0  # the top bucket: its edge
    assert Histogram.from_cumulative({2.0: 2, 4.0: 3, math.inf: 4}) == h
    assert Histogram.from_cumulative({2.0: 2}) is None  # no +Inf bucket
    assert (h + h).total == 8
    with pytest.raises(ValueError, match="different buckets"):
        h + Histogram.of([1.0], (3.0,))


def test_the_queueing_model():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and mean_wait_s(3, 3.0, 1.0, 1.0) == math.inf
    assert mean_wait_s(1, 0.5, 1.0, 1.0) == pytest.approx(1.0)  # M/M/1: rho s / (1 - rho)
    gains = [
        mean_wait_s(c, 4.0, 1.0, 1.0) - mean_wait_s(c + 1, 4.0, 1.0, 1.0) for c in (5, 6, 8, 12)
    ]
    assert gains == sorted(gains, reverse=True) and gains[-1] < 0.001  # diminishing returns
    assert next_replica_gain(2.0, 3, 5.0) == 2.0  # overloaded: all of the delay
    assert 0 < next_replica_gain(2.0, 5, 4.0) < 2.0
    tokens = Histogram.of([SHORT] * 90 + [6000] * 10, PREFILL_TOKENS_BUCKETS)
    late = [predicted_late_share(tokens, PREFILL_RATE, 1.0, None, c, 2.0) for c in (2, 3, 6)]
    assert late == sorted(late, reverse=True) and late[0] > 0.05 > late[-1]


def test_demand_is_measured_over_enough_requests_within_a_span():
    window: RequestWindow[int] = RequestWindow(requests=100, span_s=60.0)
    for i in range(5):  # 40 requests per 10 s: three intervals hold 100 or more
        items = window.add(10.0, 40, i)
    assert items == [2, 3, 4]
    for i in range(5, 15):  # idle: the window grows until its span is 60 s
        items = window.add(10.0, 0, i)
    assert items == [9, 10, 11, 12, 13, 14] and window.span == 60.0
    # long-tailed prompts need more requests for the same error than chat prompts do
    policy = ScalingPolicy(settings())
    chat = Histogram.of([800, 1000, 1200] * 30, PREFILL_TOKENS_BUCKETS)
    tail = Histogram.of([800] * 80 + [60000] * 10, PREFILL_TOKENS_BUCKETS)
    assert policy._window_requests(chat) < 50 < 300 < policy._window_requests(tail)
    assert policy._window_requests(None) == 89  # cv2 taken as 1 until known
