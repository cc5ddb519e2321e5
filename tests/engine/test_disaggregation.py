"""Disaggregated prefill/decode at the engine level, with real KV page transfers.

A prefill engine computes the prompt and leases its pages; a decode engine reserves
pages for what its own cache lacks, pulls exactly those pages through a real transfer
agent (NIXL over UCX, or ZMQ over TCP on 127.0.0.1), and decodes. Greedy outputs must
equal a single engine's; a second chat turn must move only the pages decode lacks.
"""

from __future__ import annotations

import pytest

from radixserve.engine.sampling_params import SamplingParams
from radixserve.transfer import create_agent
from radixserve.transfer.compat import PoolCompat
from tests.engine.engine_helpers import TINY, assert_no_leaks, make_engine

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
SYSTEM = (
    "You are the help desk of a public library. Answer in one or two sentences and "
    "mention the opening hours, nine to six, whenever it is relevant. "
)


@pytest.fixture(scope="module")
def engines():
    prefill = make_engine(TINY, kv_cache_memory_gib=0.1)
    decode = make_engine(TINY, kv_cache_memory_gib=0.1)
    return prefill, decode


@pytest.fixture(params=["nixl", "zmq"])
def link(request, engines):
    prefill, decode = engines
    agents = []
    for engine, name in ((prefill, "prefill-0"), (decode, "decode-0")):
        compat = PoolCompat.of(engine.kv_pool.kv, engine.config.name)
        agents.append(create_agent(request.param, name, engine.kv_pool.kv, compat))
    agents[1].add_peer("prefill-0", 1, agents[0].metadata())
    yield prefill, decode, agents
    for agent in agents:
        agent.close()


def pull(agents, src_pages, dst_pages):
    """Read the prefill agent's pages into decode's, serving the owner side meanwhile."""
    owner, reader = agents
    handle = reader.read_pages("prefill-0", src_pages, dst_pages)
    while reader.poll(handle) == "pending":
        owner.serve_reads()
    assert handle.state == "done", handle.error


def run_disaggregated(prefill, decode, agents, prompt_ids, params=GREEDY):
    """One request through prefill → transfer → decode.

    Returns (tokens, tokens decode had cached, pages moved)."""
    admission = decode.admit(prompt_ids, params, remote_over=0)
    assert admission.route == "remote"
    rid, num_cached, dst_pages = admission.request_id, admission.cached_tokens, admission.page_ids
    assert prefill.admit(prompt_ids, params, request_id=rid, lease_s=30.0).route == "local"
    first = leased = None
    while first is None:
        for out in prefill.step():
            if out.request_id == rid and out.finished:
                first, leased = out.new_token_ids[0], out.leased_page_ids
    assert leased is not None  # the lease's pages come with the last output
    src_pages = leased[num_cached // decode.page_size :]
    assert len(src_pages) == len(dst_pages)
    pull(agents, src_pages, list(dst_pages))
    assert prefill.release_lease(rid)
    [out] = decode.activate_remote(rid, first)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens, num_cached, len(dst_pages)


def test_disaggregated_equals_single_engine(link, tiny_off):
    prefill, decode, agents = link
    prompts = [SYSTEM + "When do you open on Saturday?", SYSTEM + "Can I renew a book online?"]
    expected = [r.token_ids for r in tiny_off.generate(prompts, GREEDY)]
    for prompt, tokens in zip(prompts, expected):
        ids = decode.tokenizer.encode(prompt)
        assert run_disaggregated(prefill, decode, agents, ids)[0] == tokens
    assert_no_leaks(decode)
    assert_no_leaks(prefill)
    assert prefill.cache_stats()["leases"] == 0


def test_second_turn_moves_only_missing_pages(link, tiny_off, request):
    prefill, decode, agents = link
    room = "four" if "nixl" in request.node.name else "six"  # its own conversation per backend
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Do you have study rooms for groups of {room} people?"},
    ]
    turn1 = decode.tokenizer.encode_chat(messages)
    tokens1, _, _ = run_disaggregated(prefill, decode, agents, turn1)
    # turn 2 extends turn 1's prompt and answer token for token (the random weights' text
    # need not re-tokenize to the same ids through the chat template)
    turn2 = turn1 + tokens1 + decode.tokenizer.encode(" And can I book one for tomorrow?")
    [expected] = tiny_off.generate([turn2], GREEDY)
    tokens2, cached2, moved2 = run_disaggregated(prefill, decode, agents, turn2)
    assert tokens2 == expected.token_ids
    # decode kept turn 1 (prompt + answer) in its own cache: only the delta moved
    ps = decode.page_size
    assert cached2 == (len(turn1) + len(tokens1) - 1) // ps * ps
    assert moved2 == -(-len(turn2) // ps) - cached2 // ps
    assert moved2 < -(-len(turn2) // ps) // 2
    assert_no_leaks(decode)


def test_lease_expires_when_reader_never_comes():
    prefill = make_engine(TINY, kv_cache_memory_gib=0.05)
    rid = prefill.admit(SYSTEM * 2, GREEDY, lease_s=0.0).request_id
    last = None
    while prefill.has_unfinished():
        last = next((o for o in prefill.step() if o.finished), last)
    assert prefill.cache_stats()["leases"] == 1 and last is not None and last.leased_page_ids
    prefill.step()  # any later step expires it
    assert prefill.cache_stats()["leases"] == 0
    assert not prefill.release_lease(rid)
    assert_no_leaks(prefill)


def test_aborting_a_reserved_request_returns_pages_uncached(engines):
    _, decode = engines
    before = decode.cache_stats()
    admission = decode.admit(decode.tokenizer.encode(SYSTEM * 3), GREEDY, remote_over=0)
    rid, pages = admission.request_id, admission.page_ids
    assert admission.route == "remote"
    assert pages and decode.cache_stats()["pages_used"] > before["pages_used"]
    assert decode.abort(rid) is not None
    # the never-filled pages must not have entered the cache
    assert decode.cache_stats()["pages_cached"] == before["pages_cached"]
    assert_no_leaks(decode)
