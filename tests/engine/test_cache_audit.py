"""The cache audit on the real default model: a clean run only matches (bfloat16 with the
GGUF's int4 weights, as users get it, and float32), and one cached page whose bytes are
overwritten is flagged by the next audit, counted in the metrics, and with fail-closed
the cache serves nothing: the next answer is recomputed and equals a cache-off engine's."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.metrics import ServingMetrics
from radixserve.protocol.link_messages import WorkerLoad
from radixserve.protocol.stats_messages import EngineSection, ServiceStats, fill
from radixserve.worker_metrics import service_metrics
from tests.engine.engine_helpers import FLOAT32, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SYSTEM = "You are a careful assistant. Answer in one short sentence about rivers and bridges."
OTHER = "A completely different prompt: mountains, snow, glaciers, the alpine winter and its long dark nights."


def run(engine: Engine, prompt: str) -> tuple[str, int]:
    """Generate, then step until the audit's shadow prefills are done (the engine idles)."""
    result = engine.generate([prompt], GREEDY)[0]
    while engine.has_unfinished():
        engine.step()
    return result.text, result.cached_tokens


def audit_counts(engine: Engine) -> tuple[int, int, int]:
    stats = engine.cache_stats()
    return stats["audit_checked"], stats["audit_mismatches"], stats["audit_fail_closed"]


def corrupt_prefix_page(engine: Engine, prompt: str, donor: str) -> int:
    """Overwrite the bytes of the first cached page of ``prompt`` with those of ``donor``'s
    first page (KV that belongs to other tokens: a page reused while still cached)."""
    assert engine.cache is not None
    page = engine.cache.match_prefix(engine.tokenize(prompt)).page_ids[0]
    source = engine.cache.match_prefix(engine.tokenize(donor)).page_ids[0]
    kv = engine.kv_pool.kv  # (layers, 2, pages, page_size, kv_heads, head_dim)
    kv[:, :, page].copy_(kv[:, :, source])
    return page


@pytest.mark.parametrize("overrides", [{}, FLOAT32], ids=["defaults", "float32"])
def test_a_clean_run_only_matches(overrides: dict[str, str]) -> None:
    engine = make_engine("default", kv_cache_memory_gib=0.1, audit_sample_rate=1.0, **overrides)
    text, cached = run(engine, SYSTEM)
    assert cached == 0 and audit_counts(engine) == (0, 0, 0)  # a miss is never audited
    _, cached = run(engine, SYSTEM + text + " Why?")
    _, cached_again = run(engine, SYSTEM + text + " Why not?")
    assert cached > 0 and cached_again > 0
    assert audit_counts(engine) == (2, 0, 0)
    assert engine.cache_stats()["page_refs_outside_cache"] == 0  # the shadows' pages returned


def test_a_corrupted_page_is_flagged_and_fail_closed_recomputes(smol_off: Engine) -> None:
    engine = make_engine(
        "default", kv_cache_memory_gib=0.1, audit_sample_rate=1.0, audit_fail_closed=True
    )
    run(engine, SYSTEM)
    run(engine, OTHER)
    question = SYSTEM + " What is the longest river?"
    corrupt_prefix_page(engine, SYSTEM, OTHER)
    checked_before = audit_counts(engine)[0]
    _, cached = run(engine, question)  # served from the corrupted page
    assert cached > 0
    assert audit_counts(engine) == (checked_before + 1, 1, 1)  # flagged by that one audit
    metrics = ServingMetrics().render(engine.cache_stats()).decode()
    assert 'radixserve_cache_audit_total{result="mismatch"} 1.0' in metrics
    assert "radixserve_cache_audit_fail_closed 1.0" in metrics
    stats = ServiceStats(engine=fill(EngineSection, engine.cache_stats()))
    worker = service_metrics("decode-0", "decode", WorkerLoad(), stats).decode()
    assert (
        'radixserve_cache_audit_total{result="mismatch",role="decode",worker="decode-0"} 1.0'
        in worker
    )

    text, cached = run(engine, question)  # failed closed: recomputed, and right
    assert cached == 0
    assert text == smol_off.generate([question], GREEDY)[0].text
    assert audit_counts(engine)[1] == 1  # nothing cached was served, nothing audited

    assert engine.clear_audit()  # the operator's all-clear: the cache serves again
    assert not engine.clear_audit()
    run(engine, question)
    again, cached = run(engine, question)
    assert cached > 0 and again == text
    assert audit_counts(engine)[1:] == (1, 0)  # the rebuilt cache matches


def test_the_shadow_gives_way_to_real_work() -> None:
    """A shadow prefill runs only while nothing else is runnable: a request that
    arrives meanwhile takes the next step, and the shadow starts over afterwards."""
    engine = make_engine(
        "default", kv_cache_memory_gib=0.1, audit_sample_rate=1.0, max_num_batched_tokens=16
    )
    run(engine, SYSTEM)
    engine.generate([SYSTEM + " Why?"], GREEDY)  # a cache hit: its audit is pending
    assert engine.audit is not None and engine.audit.has_work
    engine.step()  # idle: the shadow computes its first 16 tokens
    shadow = engine.audit.shadow
    assert shadow is not None and not shadow.done and shadow.req.page_ids
    held = engine.allocator.num_used
    rid = engine.add_request(OTHER, GREEDY)
    engine.step()  # real work: it computes this step; the shadow gave its pages back
    assert engine.audit.shadow is None and engine.audit.stats()["audit_pending"] == 1
    (other,) = engine.scheduler.running
    assert other.request_id == rid and other.num_computed == 16
    assert engine.allocator.num_used == held - len(shadow.req.page_ids) + len(other.page_ids)
    while engine.has_unfinished():
        engine.step()
    assert audit_counts(engine) == (1, 0, 0)
    assert engine.cache_stats()["page_refs_outside_cache"] == 0


def test_the_audit_is_off_by_default(smol_on: Engine) -> None:
    assert smol_on.audit is None
    assert not any(key.startswith("audit_") for key in smol_on.cache_stats())
    assert "radixserve_cache_audit" not in ServingMetrics().render(smol_on.cache_stats()).decode()


def test_the_tolerance_follows_the_dtype() -> None:
    from radixserve.engine.cache_audit import audit_tolerance, compare_rows

    assert audit_tolerance(torch.float32) < 1e-5 < audit_tolerance(torch.bfloat16) < 0.2
    row = torch.tensor([10.0, 2.0, -1.0, 0.5])
    assert compare_rows(row, row.clone(), 2) == (0.0, 10.0)
    diff, scale = compare_rows(row, torch.tensor([10.0, 2.0, 9.0, 0.5]), 2)  # a new top token
    assert (diff, scale) == (10.0, 10.0)


def test_the_flags_reach_serve_and_every_process_of_up() -> None:
    import argparse

    from radixserve.cli.engine import build_settings, engine_args, engine_env

    parser = argparse.ArgumentParser()
    engine_args(parser)
    args = parser.parse_args(["--audit-sample-rate", "0.25", "--audit-fail-closed"])
    settings = build_settings(args)  # radixserve serve's engine
    assert (settings.audit_sample_rate, settings.audit_fail_closed) == (0.25, True)
    env = engine_env(args)  # radixserve up's processes
    assert env["RADIXSERVE_AUDIT_SAMPLE_RATE"] == "0.25"
    assert env["RADIXSERVE_AUDIT_FAIL_CLOSED"] == "true"
    with pytest.raises(SystemExit):  # argparse's error names the flag
        parser.parse_args(["--audit-sample-rate", "1.5"])
