"""`radixserve bench --scenario decode`: the scenario end to end on a tiny grid.

Driven against a real radixserve HTTP server in this process (`radixserve serve`'s app on
the engine tests' tiny random model, which has the default model's tokenizer; not the
`radixserve up` cluster the benchmark starts, which takes a minute here): the cells, the
client, the priming, the statistics, the floor from the served model's own sizes, the
JSON, the table and the plot. llama-server is not installed in CI: its absence, and
the reasons the cells carry for it, are what is checked of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.bench.decode import (
    cell_prompts,
    run_decode_bench,
    served_by,
    skip_reason,
)
from radixserve.bench.decode_cells import Cell, DecodeOptions, Served, System
from radixserve.bench.decode_report import WINDOW_ALL, steady_gaps, stream_times
from radixserve.bench.peer_options import Deployment
from radixserve.cli import main
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.engine.engine_helpers import TINY as TINY_MODEL
from tests.engine.engine_helpers import make_engine, tiny_checkpoint
from tests.gateway.conftest import RunningServer

TOKENS = 6  # decoded per stream
CONTEXT = 64  # prompts of 58 tokens: three full pages of 16 and a partial one


@pytest.fixture(scope="module")
def served_engine() -> Iterator[tuple[RunningServer, Engine]]:
    engine = make_engine(TINY_MODEL, kv_cache_memory_gib=0.02)
    client = LocalEngineClient(AsyncEngine(engine))
    running = RunningServer(create_app(client, GatewaySettings()))
    yield running, engine
    running.stop()
    client.close()


def _system(url: str, served: Served) -> System:
    @contextlib.contextmanager
    def start(batch: int, context: int) -> Iterator[Deployment]:
        yield Deployment(url, {"command": "radixserve serve's app, in-process"})

    return System("radixserve", served, start, restart_per_batch=False)


def test_a_tiny_grid_end_to_end(
    served_engine: tuple[RunningServer, Engine], tmp_path: Path, capsys
) -> None:
    server, engine = served_engine
    served = served_by(engine, engine.kv_pool.num_pages * engine.page_size)
    options = DecodeOptions(tmp_path / "decode.json", batches=(1, 2), contexts=(CONTEXT, 16384),
                            decode_tokens=TOKENS)  # fmt: skip
    why = "neither --llama-server nor --peer-venv given"
    doc = run_decode_bench(options, [_system(server.url, served)], {"llama-server": why})

    assert json.loads(options.out_path.read_text()) == doc
    assert Path(doc["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["plot"] == str(tmp_path / "decode-itl.png")
    assert doc["llama_server_build"] and "ninja" in doc["llama_server_build"][-2]
    # the floor reads the served model's own bytes: every parameter and buffer as loaded
    weights = sum(t.nbytes for t in (*engine.model.parameters(), *engine.model.buffers()))
    c = engine.config
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * engine.dtype.itemsize
    assert doc["servers"]["radixserve"]["served"]["weight_bytes"] == weights
    assert doc["servers"]["radixserve"]["served"]["kv_bytes_per_token"] == per_token
    gbs = doc["copy_gbs"]
    assert gbs > 0

    cells = {(r["batch"], r["context"]): r for r in doc["cells"]}
    assert set(cells) == {(1, CONTEXT), (2, CONTEXT), (1, 16384), (2, 16384)}
    for batch in (1, 2):
        row = cells[(batch, CONTEXT)]
        assert row["prompt_tokens"] == CONTEXT - TOKENS and row["ratio_itl_mean"] is None
        e = row["servers"]["radixserve"]
        assert e["status"] == "measured", e
        itl = e["itl_ms"]
        assert 0 <= itl["p50"] <= itl["p90"] and itl["mean"] > 0
        assert len(e["itl_ms"]["per_stream_mean"]) == batch and e["gaps_counted"] >= batch
        assert e["completion_tokens"] == [TOKENS] * batch  # ignore_eos held every stream
        assert e["prompt_tokens"] == [CONTEXT - TOKENS] * batch
        # primed: each stream found its own prompt's full pages cached, nothing more
        assert e["cached_tokens"] == [48] * batch
        assert e["tokens_per_s"] == pytest.approx(batch * TOKENS / e["wall_s"])
        mean_context = CONTEXT - TOKENS + TOKENS / 2
        floor = (weights + batch * mean_context * per_token) / (gbs * 1e9) * 1e3
        assert e["floor_ms"] == pytest.approx(floor)
        assert e["itl_mean_over_floor"] == pytest.approx(itl["mean"] / floor)
        peer = row["servers"]["llama-server"]
        assert peer == {"status": "skipped", "reason": f"llama-server not run: {why}"}
    for batch in (1, 2):  # past the model's context: skipped, with the reason
        e = cells[(batch, 16384)]["servers"]["radixserve"]
        assert e == {"status": "skipped", "reason": "context 16384 is past the model's 8192 tokens"}

    out, err = capsys.readouterr()
    assert f"| 2 | {CONTEXT} |" in out and "| 1 | 16384 | skipped | skipped |" in out
    assert "B=1 C=16384, radixserve: context 16384 is past the model's 8192 tokens" in out
    assert f"decode: radixserve B=2 C={CONTEXT}: 2 stream(s) of 58 prompt + 6 tokens" in err


def test_cells_are_skipped_for_their_reasons() -> None:
    served = Served("w", 1000, 100, max_context=8192, pool_tokens=4096, page_size=16,
                    max_streams=64)  # fmt: skip
    assert skip_reason(served, Cell(4, 1024, 64), 200_000) is None  # 4 x 1,024 = 4,096 fit
    assert "does not fit the KV pool of 4,096" in (
        skip_reason(served, Cell(4, 1025, 64), 10**6) or ""
    )
    assert skip_reason(served, Cell(4, 1016, 16), 4_000) is None  # 4 x 1,000 prompt tokens
    assert "over the budget of 3,999" in (skip_reason(served, Cell(4, 1016, 16), 3_999) or "")
    assert "past the 64 sequences" in (skip_reason(served, Cell(65, 32, 8), 10**6) or "")
    assert "past the model's 8192" in (skip_reason(served, Cell(1, 8200, 8), 10**6) or "")
    sized_per_cell = dataclasses.replace(served, pool_tokens=None, max_streams=None)
    assert skip_reason(sized_per_cell, Cell(64, 8192, 64), 10**6) is None


def test_prompts_share_no_page_across_streams_or_cells() -> None:
    tokenizer = tiny_checkpoint().tokenizer
    a = cell_prompts(tokenizer, Cell(4, 80, 8), seed=0)
    b = cell_prompts(tokenizer, Cell(2, 80, 8), seed=0)
    assert all(len(p) == 72 for p in a + b)
    first_pages = {tuple(p[:16]) for p in a + b}
    assert len(first_pages) == 6
    assert cell_prompts(tokenizer, Cell(4, 80, 8), seed=0) == a  # seeded: the same for every server


def test_gaps_are_counted_while_every_stream_decodes() -> None:
    early = stream_times(0.0, 100.0, [10.0] * 5)  # chunks at 0.10 ... 0.15 s
    late = stream_times(0.0, 120.0, [10.0] * 5)  # 0.12 ... 0.17 s
    gaps, window = steady_gaps([early, late])
    assert window == WINDOW_ALL
    assert [len(g) for g in gaps] == [3, 3]  # 0.12-0.15 and 0.12-0.15 (late's first gaps)
    assert all(g == pytest.approx(10.0) for stream in gaps for g in stream)
    apart = stream_times(1.0, 100.0, [10.0] * 2)  # after `early` ended: never overlapped
    gaps, window = steady_gaps([early, apart])
    assert window != WINDOW_ALL and [len(g) for g in gaps] == [5, 2]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dtype", "bfloat16"], "--dtype: --scenario decode runs `radixserve up`"),
        (["--no-prefix-cache"], "--no-prefix-cache: --scenario decode runs"),
        (["--concurrency", "2"], "--concurrency: --scenario decode runs"),
        (["--preset", "quick"], "--preset: --scenario decode runs"),
        (["--quantization", "int4"], "--quantization: --scenario decode runs its own"),
        (["--batches", "1,x"], "--batches takes comma-separated integers"),
        (["--batches", "0,4"], "--batches takes distinct integers in [1, 1024]"),
        (["--contexts", "512,512"], "--contexts takes distinct integers"),
        (["--contexts", "512", "--decode-tokens", "512"], "--decode-tokens must be at least 2"),
        (["--prefill-budget-tokens", "0"], "--prefill-budget-tokens must be at least 1"),
        (["--peer-threads", "0"], "--peer-threads must be at least 1"),
    ],
)
def test_decode_refuses_what_it_does_not_take(flags: list[str], message: str, capsys) -> None:
    assert main(["bench", "--scenario", "decode", *flags]) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("scenario", "flags", "message"),
    [
        ("engine", ["--batches", "1"], "--batches applies to --scenario decode only"),
        ("peer", ["--decode-tokens", "8"], "--decode-tokens applies to --scenario decode only"),
        ("perplexity", ["--llama-server", "/x"], "--llama-server applies to --scenario peer or "
         "decode only"),
    ],
)  # fmt: skip
def test_decode_flags_only_with_decode(
    scenario: str, flags: list[str], message: str, capsys
) -> None:
    assert main(["bench", "--scenario", scenario, *flags]) != 0
    assert message in capsys.readouterr().err
