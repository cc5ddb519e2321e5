"""The gateway's view of its workers' LoRA adapters (`AdapterViews`): an adapter may be
named while a decode worker states it; it is routed as the first such worker by name
serves it (its fingerprint and namespace), and only to workers of that content; an answer
to a run-time load or unload patches a worker's view until its next heartbeat, which
states the same; the router hashes an adapter's prompt in the adapter's namespace."""

from __future__ import annotations

from typing import Any

from radixserve.cache.block_hash import hash_namespace
from radixserve.protocol.lora_messages import LoraAdapterInfo
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.runtime.links import Link
from radixserve.runtime.routing.adapter_views import AdapterViews
from radixserve.runtime.routing.router import DecodeRouter

ONE, TWO = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def info(name: str, fingerprint: str) -> LoraAdapterInfo:
    return LoraAdapterInfo(name, fingerprint, hash_namespace(f"model/adapter={fingerprint}"))


def link(name: str, *adapters: LoraAdapterInfo) -> Link:
    channel: Any = None  # never used: nothing is sent
    return Link(f"tcp://{name}", channel, name=name, up=True, stats=ServiceStats(loras=adapters))


def test_an_adapter_is_routed_as_the_first_worker_serving_it_and_only_to_that_content():
    views = AdapterViews()
    a, b, c = link("a"), link("b", info("x", TWO)), link("c", info("x", ONE), info("y", ONE))
    servable = views.servable([c, b, a])
    assert sorted(servable) == ["x", "y"] and servable["x"].fingerprint == TWO  # b's: first
    assert [w.name for w in (a, b, c) if views.holds(w, "x", TWO)] == ["b"]
    assert all(views.holds(w, "", "") for w in (a, b, c))  # the base model: everywhere
    assert views.holders([a], "x") is None


def test_an_answer_patches_the_view_until_the_next_heartbeat():
    views = AdapterViews()
    w = link("w")
    views._patch(w, "x", info("x", ONE))  # a load's answer
    assert views.holds(w, "x", ONE)
    w.stats = ServiceStats(loras=(info("x", ONE),))  # the next heartbeat states it
    views._patch(w, "x", None)  # an unload's answer
    assert not views.holds(w, "x", ONE) and views.servable([w]) == {}
    w.stats = ServiceStats()  # and the heartbeat after it
    assert views.of(w) == {}
    w.stats = ServiceStats(loras=(info("x", TWO),))  # a later heartbeat wins over any patch
    assert views.holds(w, "x", TWO)


def test_an_adapters_prompt_is_hashed_in_its_own_namespace():
    router = DecodeRouter(4, hash_namespace("model"), 4.0, 100)
    prompt = list(range(12))
    base, adapted = router.hashes(prompt), router.hashes(prompt, "", info("x", ONE).hash_namespace)
    assert len(base) == len(adapted) == 3 and not set(base) & set(adapted)
