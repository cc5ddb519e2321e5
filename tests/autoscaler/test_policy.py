"""The autoscaler's decisions on synthetic metric series (no processes): the pool whose
SLO breaks grows, both shrink once load drops without flapping, bounds and cooldowns
hold, and a fresh worker's slow warm-up is not taken for lost capacity."""

from __future__ import annotations

import dataclasses

from radixserve.services.autoscaler.capacity import DecodeCapacity, PrefillCapacity, WorkerSample
from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.observation import Observation, PoolState
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings

DT = 10.0
PREFILL_RATE = 8000.0  # tokens/s one busy prefill replica computes


def settings(**overrides) -> AutoscalerSettings:
    base = dict(
        ttft_p90_target_s=1.0, itl_p90_target_s=0.05, min_prefill=1, max_prefill=6,
        min_decode=1, max_decode=6, interval_s=DT, scale_up_cooldown_s=30.0,
        scale_down_cooldown_s=60.0, cold_start_s=30.0,
    )  # fmt: skip
    return AutoscalerSettings(**{**base, **overrides})


def decode_sample(batch: float, age_s: float = 600.0, slow: float = 1.0) -> WorkerSample:
    step = (0.012 + 0.0003 * batch) * slow  # the real model: t(B) = a + b B
    steps = int(DT / step)
    return WorkerSample("d", "decode", age_s, DT, busy_s=DT, decode_tokens=int(steps * batch),
                        decode_only_steps=steps, decode_only_seqs=int(steps * batch),
                        decode_only_s=steps * step, running=int(batch))  # fmt: skip


def prefill_sample(tokens_per_s: float, age_s: float = 600.0, speed: float = 1.0):
    busy = min(DT, tokens_per_s / (PREFILL_RATE * speed) * DT)
    return WorkerSample("p", "prefill", age_s, DT, busy_s=busy,
                        prefill_tokens=int(tokens_per_s * DT), prefill_s=busy)  # fmt: skip


def observe(t: float, pools: dict[str, int], *, prefill_tps: float = 0.0, out_tps: float = 0.0,
            ttft: float | None = 0.2, itl: float | None = 0.02, queue: int = 0, workers=(),
            starting: dict[str, int] | None = None, rps: float = 100.0,
            tokens: Histogram | None = None,
            waits: Histogram | None = None) -> Observation:  # fmt: skip
    """One interval; ``rps`` requests/s (by default enough that demand is measured over
    the interval alone), per-request histograms only when given."""
    starting = starting or {}
    return Observation(
        now_s=t, interval_s=DT, requests_per_s=rps,
        pools={r: PoolState(n, starting.get(r, 0)) for r, n in pools.items()},
        prefill_tokens_per_s=prefill_tps, output_tokens_per_s=out_tps, ttft_p90_s=ttft,
        itl_p90_s=itl, prefill_queue_tokens=queue, workers=tuple(workers),
        prefill_request_tokens=tokens, prefill_wait=waits,
    )  # fmt: skip


def by_role(decisions):
    return {d.role: d for d in decisions}


def test_prefill_grows_when_ttft_breaks_under_prefill_heavy_load():
    policy = ScalingPolicy(settings())
    pools = {"prefill": 1, "decode": 1}
    # before any capacity is known, a broken TTFT alone adds a prefill replica
    d = by_role(policy.decide(observe(0, pools, prefill_tps=7000, ttft=3.0)))
    assert (d["prefill"].direction, d["prefill"].desired, d["prefill"].kind) == (
        "up",
        2,
        "slo_ttft",
    )
    assert d["decode"].direction == "hold"  # ITL is fine: decode is left alone
    # the same, but the new one is still starting: no second one, no double count
    d = by_role(policy.decide(observe(40, pools, prefill_tps=7000, ttft=3.0,
                                      starting={"prefill": 1})))  # fmt: skip
    assert d["prefill"].desired == 2
    # with a measured capacity the throughput model sizes the pool in one step:
    # 20k tokens/s at 8k per replica and 70 % utilisation -> 4 replicas
    policy = ScalingPolicy(settings())
    workers = [prefill_sample(7900)]
    d = by_role(policy.decide(observe(0, pools, prefill_tps=20000, ttft=2.0, workers=workers)))
    assert d["prefill"].kind == "throughput_model"
    assert d["prefill"].desired >= 4
    assert d["prefill"].inputs["capacity_tokens_per_s"] == PREFILL_RATE
    # a queue over its bound is a breach too, even before TTFT shows it
    policy = ScalingPolicy(settings(queue_tokens_per_replica=4096))
    d = by_role(policy.decide(observe(0, pools, ttft=0.3, queue=10000)))
    assert (d["prefill"].direction, d["prefill"].kind) == ("up", "slo_queue")


def test_decode_grows_when_itl_breaks_under_decode_heavy_load():
    policy = ScalingPolicy(settings())
    pools = {"prefill": 1, "decode": 1}
    # a decode replica at batches 40..160: ITL model t(B) = 12 ms + 0.3 ms * B is learned;
    # at the 50 ms target it carries B* = 126 -> 2,533 tokens/s
    for i, batch in enumerate([40, 80, 120, 160]):
        d = by_role(policy.decide(observe(i * DT, pools, out_tps=1000, itl=0.03,
                                          workers=[decode_sample(batch)])))  # fmt: skip
    a, b = policy.decode_capacity.fit()
    assert abs(a - 0.012) < 1e-3 and abs(b - 0.0003) < 2e-5
    # decode-heavy: 6,000 tokens/s with ITL over target -> the model asks for 4
    d = by_role(policy.decide(observe(100, pools, out_tps=6000, itl=0.09,
                                      workers=[decode_sample(200)])))  # fmt: skip
    assert d["decode"].direction == "up" and d["decode"].desired == 4, d["decode"]
    assert d["prefill"].direction == "hold"  # TTFT is fine


def test_both_pools_shrink_after_the_load_drops_without_flapping():
    policy = ScalingPolicy(settings(scale_down_cooldown_s=60.0))
    pools = {"prefill": 4, "decode": 3}
    history = []
    t = 0.0
    # first a busy spell that learns capacities at the current size
    for batch in (60, 90, 120):
        policy.decide(observe(t, pools, prefill_tps=20000, out_tps=5000, ttft=0.5, itl=0.04,
                              workers=[prefill_sample(5000), decode_sample(batch)]))  # fmt: skip
        t += DT
    # then nearly idle for 20 minutes
    for _ in range(120):
        ds = by_role(policy.decide(observe(t, pools, prefill_tps=300, out_tps=100, ttft=0.1,
                                           itl=0.015, workers=[prefill_sample(300),
                                                               decode_sample(4)])))  # fmt: skip
        for role, d in ds.items():
            if d.direction == "down":
                assert d.desired == pools[role] - 1  # one at a time
                history.append((t, role))
            assert d.direction != "up"  # never back up: no 2 <-> 1 flapping
            pools[role] = d.desired
        t += DT
    assert pools == {"prefill": 1, "decode": 1}  # the bounds' minimum
    downs = {role: [t for t, r in history if r == role] for role in ("prefill", "decode")}
    for times in downs.values():  # each pool's steps are a cooldown apart
        assert all(b - a >= 60.0 for a, b in zip(times, times[1:]))


def test_scale_down_waits_until_n_minus_1_can_carry_the_load():
    policy = ScalingPolicy(settings(scale_down_utilization=0.6, scale_down_cooldown_s=0))
    pools = {"prefill": 2, "decode": 1}
    # 2 replicas at 35 % each: one would run at 70 % > 60 % -> hold (2 <-> 1 flapping)
    for i in range(10):
        d = by_role(policy.decide(observe(i * DT, pools, prefill_tps=0.35 * 2 * PREFILL_RATE,
                                          ttft=0.3, workers=[prefill_sample(0.35 * PREFILL_RATE)])))  # fmt: skip
        assert d["prefill"].desired == 2, d["prefill"]
    # at 25 % each, one runs at 50 %: now it goes
    policy = ScalingPolicy(settings(scale_down_utilization=0.6, scale_down_cooldown_s=0))
    d = by_role(policy.decide(observe(0, pools, prefill_tps=0.25 * 2 * PREFILL_RATE, ttft=0.3,
                                      workers=[prefill_sample(0.25 * PREFILL_RATE)])))  # fmt: skip
    assert d["prefill"].direction == "down" and d["prefill"].kind == "utilisation"


def test_bounds_and_cooldowns_hold():
    policy = ScalingPolicy(settings(max_prefill=3, scale_up_cooldown_s=30.0))
    pools = {"prefill": 1, "decode": 1}
    workers = [prefill_sample(7900)]
    # the model wants 10, the bound allows 3
    d = by_role(policy.decide(observe(0, pools, prefill_tps=50000, ttft=5.0, workers=workers)))
    assert d["prefill"].desired == 3 and d["prefill"].kind == "bounds"
    pools["prefill"] = 2  # (only 2 came up so far, none starting)
    # 10 s later it still breaks, but the scale-up cooldown holds it
    d = by_role(policy.decide(observe(10, pools, prefill_tps=50000, ttft=5.0, workers=workers)))
    assert d["prefill"].direction == "hold" and d["prefill"].kind == "cooldown"
    # past the cooldown it may go up again, never past the bound
    d = by_role(policy.decide(observe(40, pools, prefill_tps=50000, ttft=5.0, workers=workers)))
    assert d["prefill"].desired == 3
    # below the minimum it comes back up whatever the load
    policy = ScalingPolicy(settings(min_decode=2))
    d = by_role(policy.decide(observe(0, {"prefill": 1, "decode": 1}, out_tps=0, itl=None)))
    assert d["decode"].desired == 2


def test_cold_start_samples_are_left_out_of_capacity():
    prefill = PrefillCapacity(cold_start_s=30.0)
    prefill.add(prefill_sample(2000, age_s=10.0, speed=0.25))  # warming up: 2k tokens/s
    assert prefill.tokens_per_s is None
    prefill.add(prefill_sample(4000, age_s=300.0))
    assert prefill.tokens_per_s == PREFILL_RATE
    prefill.add(prefill_sample(2000, age_s=5.0, speed=0.25))
    assert prefill.tokens_per_s == PREFILL_RATE
    decode = DecodeCapacity(cold_start_s=30.0)
    for batch in (20, 60, 100):
        decode.add(decode_sample(batch, age_s=600.0))
    before = decode.tokens_per_s(0.05)
    for batch in (20, 60, 100):
        decode.add(decode_sample(batch, age_s=10.0, slow=3.0))  # a fresh one: 3x slower
    assert decode.tokens_per_s(0.05) == before
    # and without any warm sample there is no estimate, not a wrong one
    fresh = DecodeCapacity(cold_start_s=30.0)
    fresh.add(decode_sample(50, age_s=1.0))
    assert fresh.fit() is None


def test_a_replica_that_just_came_up_serves_a_cooldown_before_the_pool_shrinks():
    policy = ScalingPolicy(settings(scale_down_cooldown_s=60.0, cold_start_s=0.0))
    workers = [prefill_sample(7900)]
    d = by_role(policy.decide(observe(0, {"prefill": 1, "decode": 1}, prefill_tps=12000,
                                      ttft=3.0, workers=workers)))  # fmt: skip
    assert d["prefill"].direction == "up"
    # the new replica takes 90 s to start (longer than the cooldown); meanwhile demand falls
    for t in range(10, 100, 10):
        d = by_role(policy.decide(observe(t, {"prefill": 1, "decode": 1}, prefill_tps=200,
                                          ttft=0.1, starting={"prefill": 1})))  # fmt: skip
        assert d["prefill"].direction == "hold", (t, d["prefill"])
    # it is up by t=100 (last seen starting at 90): a whole cooldown before the pool shrinks
    for t in range(100, 150, 10):
        d = by_role(policy.decide(observe(t, {"prefill": 2, "decode": 1}, prefill_tps=200,
                                          ttft=0.1, workers=[prefill_sample(100)])))  # fmt: skip
        assert d["prefill"].direction == "hold", (t, d["prefill"])
    d = by_role(policy.decide(observe(150, {"prefill": 2, "decode": 1}, prefill_tps=200,
                                      ttft=0.1, workers=[prefill_sample(100)])))  # fmt: skip
    assert d["prefill"].direction == "down"


def test_queued_prompts_without_a_first_token_are_not_idle():
    policy = ScalingPolicy(settings(scale_down_cooldown_s=0.0))
    pools = {"prefill": 2, "decode": 1}
    # no request got its first token this interval, but prompts wait: hold
    d = by_role(policy.decide(observe(0, pools, prefill_tps=100, ttft=None, queue=800,
                                      workers=[prefill_sample(100)])))  # fmt: skip
    assert d["prefill"].direction == "hold", d["prefill"]
    # nothing waits either: idle, so it shrinks
    d = by_role(policy.decide(observe(10, pools, prefill_tps=100, ttft=None, queue=0,
                                      workers=[prefill_sample(100)])))  # fmt: skip
    assert d["prefill"].direction == "down", d["prefill"]


def test_requests_waiting_for_a_lora_slot_add_a_replica_whatever_the_token_rate():
    """A light load the pools carry easily, but 3 decode requests wait for a LoRA adapter
    slot (2 per replica): decode gets one replica more (kind ``lora_slots``), the cost
    check notwithstanding; not while one is starting (nor one fewer), not within the
    scale-up cooldown, again past it while they still wait, the prefill pool likewise
    for its own workers' waits; with none waiting the same load holds."""
    idle = [prefill_sample(300), decode_sample(4)]
    short = [idle[0], dataclasses.replace(idle[1], lora_waiting=3, lora_max=2)]
    pools = {"prefill": 1, "decode": 2}

    def decide(policy, t, workers, **kw):
        return by_role(policy.decide(observe(t, pools, prefill_tps=300, out_tps=100, ttft=0.1,
                                             itl=0.015, workers=workers, **kw)))  # fmt: skip

    quiet = ScalingPolicy(settings(scale_down_cooldown_s=1000.0))
    assert [d.direction for d in decide(quiet, 0, idle).values()] == ["hold", "hold"]
    policy = ScalingPolicy(settings(scale_up_cooldown_s=30.0, scale_down_cooldown_s=0.0))
    d = decide(policy, 0, short)
    assert (d["decode"].direction, d["decode"].desired, d["decode"].kind) == ("up", 3, "lora_slots")
    assert "3 requests wait for a LoRA adapter slot (2 per replica)" in d["decode"].reason
    assert d["decode"].inputs["lora_waiting_requests"] == 3
    assert d["prefill"].kind != "lora_slots" and "lora_waiting_requests" not in d["prefill"].inputs
    d = decide(policy, 10, short, starting={"decode": 1})  # the new one starts: no other
    assert (d["decode"].direction, d["decode"].desired) == ("hold", 3)
    pools["decode"] = 3
    d = decide(policy, 20, short)  # up, still waiting: the cooldown holds it, never down
    assert (d["decode"].direction, d["decode"].kind) == ("hold", "cooldown")
    d = decide(policy, 40, short)
    assert (d["decode"].direction, d["decode"].desired, d["decode"].kind) == ("up", 4, "lora_slots")
    waiting_prefill = [dataclasses.replace(idle[0], lora_waiting=1, lora_max=4), idle[1]]
    d = decide(ScalingPolicy(settings()), 0, waiting_prefill)
    assert (d["prefill"].desired, d["prefill"].kind) == (2, "lora_slots")
    assert "(4 per replica)" in d["prefill"].reason and d["decode"].kind != "lora_slots"
