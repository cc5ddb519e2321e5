"""Prefill routing, the one cost the gateway and the decode workers share: device and
host-tier hits, typed heartbeat load plus this process's ledger, busy and draining
workers, a choice made upstream."""

from __future__ import annotations

from radixserve.protocol import WorkerLoad
from radixserve.runtime.links import Link
from radixserve.services.decode.prefill_router import PrefillRouter, prefill_cost
from radixserve.services.decode.settings import DecodeSettings

PAGE = 16


def link(name: str, queued: int = 0, up: bool = True, draining: bool = False) -> Link:
    # routing reads only the link's state, never its socket
    return Link(
        f"tcp://127.0.0.1/{name}", channel=None,  # type: ignore[arg-type]
        name=name, up=up, load=WorkerLoad(queued_tokens=queued, draining=draining),
    )  # fmt: skip


def test_prefill_cost_counts_host_hits_at_their_weight():
    # 100 pages, nothing queued: device hits are free, host-only hits cost their weight
    assert prefill_cost(100, 0, 0, 1.0, 1.0) == 100
    assert prefill_cost(100, 60, 0, 1.0, 1.0) == 40
    assert prefill_cost(100, 0, 0, 1.0, 1.0, host_pages=60, host_weight=0.1) == 46
    # a device hit longer than the host hit: the host adds nothing
    assert prefill_cost(100, 80, 0, 1.0, 1.0, host_pages=60, host_weight=0.1) == 20
    # a worker holding the prefix but busy loses to an idle one that can load it
    busy = prefill_cost(100, 60, 30, 1.0, 1.0, host_pages=60, host_weight=0.1)
    idle = prefill_cost(100, 0, 0, 1.0, 1.0, host_pages=60, host_weight=0.1)
    assert idle < busy


def test_the_cached_worker_wins_until_its_queue_costs_more_than_recomputing():
    router = PrefillRouter(PAGE)
    a, b = link("a"), link("b")
    assert router.pick([a, b], 10, {"b": 10}).name == "b"  # b holds all 10 pages
    b.load = WorkerLoad(queued_tokens=9 * PAGE)  # 9 pages queued there: still cheaper
    assert router.pick([a, b], 10, {"b": 10}).name == "b"
    b.load = WorkerLoad(queued_tokens=11 * PAGE)  # 11: computing on idle a is cheaper
    assert router.pick([a, b], 10, {"b": 10}).name == "a"


def test_the_ledger_counts_what_was_sent_until_it_is_answered():
    router = PrefillRouter(PAGE)
    a, b = link("a"), link("b")
    assert router.pick([a, b], 4).name == "a"  # a tie goes by name
    router.assign("a", 100)
    assert router.queued_tokens(a) == 100
    assert router.pick([a, b], 4).name == "b"
    router.assign("b", 300)
    assert router.pick([a, b], 4).name == "a"
    router.answered("a", 100)
    router.answered("a", 100)  # a second answer cannot go below zero
    assert router.queued_tokens(a) == 0
    router.forget("b")  # b went down: nothing sent there is pending
    assert router.queued_tokens(b) == 0
    a.load = WorkerLoad(queued_tokens=50)  # the worker's own heartbeat figure counts too
    assert router.queued_tokens(a) == 50
    assert router.pick([a, b], 4).name == "b"


def test_busy_draining_and_down_workers_are_skipped():
    router = PrefillRouter(PAGE, DecodeSettings(prefill_busy_tokens=1000))
    busy, idle = link("a", queued=5000), link("b", queued=10)
    # the busy one holds the prompt, but is over the threshold while another is not
    assert router.pick([busy, idle], 100, {"a": 100}).name == "b"
    assert router.pick([busy], 100, {"a": 100}).name == "a"  # all busy: cost decides
    draining, down = link("c", draining=True), link("d", up=False)
    assert router.pick([draining, down]) is None
    assert router.pick([draining, idle], 100, {"c": 100}).name == "b"
    assert router.pick([busy, idle], exclude=frozenset({"b"})).name == "a"
