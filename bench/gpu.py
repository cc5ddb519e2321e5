"""The kernels' GPU benchmark (`radixserve.kernels.bench`) and, in the same run, the
engine end to end on random weights of the same 8B-class shape: uncached prefill
tokens/s, cached-prefix TTFT for a 32-token delta after 4k/16k/32k tokens against the
delta alone, decode tokens/s at batch 1/32/128 with CUDA graphs off and on, and with two
GPUs or more a TP=2 engine against TP=1 (8 of the layers, saved once for the ranks).

    python -m radixserve.bench.gpu [--out gpu-bench.json]    # a CUDA machine
    python -m radixserve.bench.gpu --dry-run                 # tiny shapes, CPU
"""

from __future__ import annotations

import gc
import sys
import time

import torch

from radixserve.kernels.bench import Row, Run, Shapes, main, num, target


def bench_config(s: Shapes):
    from radixserve.model.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=s.vocab, hidden_size=s.hidden,
        intermediate_size=s.intermediate, num_layers=s.layers, num_heads=s.heads,
        num_kv_heads=s.kv_heads, head_dim=s.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=s.max_model_len, tie_word_embeddings=False,
        name=f"random-llama-{s.layers}x{s.hidden}",
    )  # fmt: skip


def engine_settings(run: Run, **overrides: object):
    """The engines' settings at the run's shapes (``overrides`` on top)."""
    from radixserve.settings import EngineSettings

    s = run.shapes
    return EngineSettings.model_validate({
        "device": run.device.type, "dtype": str(run.dtype).removeprefix("torch."),
        "page_size": s.page_size, "kv_cache_memory_gib": s.kv_cache_gib,
        "max_model_len": s.max_model_len, "max_num_batched_tokens": s.batched_tokens,
        "max_num_seqs": max(s.decode_batches), "load_progress": False, **overrides,
    })  # fmt: skip


def make_engine(run: Run, graphs: bool):
    from radixserve.bench.random_checkpoint import random_checkpoint
    from radixserve.engine.engine import Engine

    s = run.shapes
    settings = engine_settings(run, cuda_graph_max_batch_size=s.graph_max_batch if graphs else 0)
    return Engine(settings, random_checkpoint(bench_config(s), device=run.device))


class Prompts:
    """Random token ids, never the same twice (so nothing is cached unless reused)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(0)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()


def bench_prefill_and_ttft(run: Run, engine, ids: Prompts) -> None:
    from radixserve.engine.sampling_params import SamplingParams

    s = run.shapes
    one = SamplingParams(max_tokens=1, temperature=0.0)
    # compiles the kernels for long prefill chunks and decodes before anything is timed
    engine.generate([ids(256)], SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    count, length = s.prefill
    t0 = time.perf_counter()
    engine.generate([ids(length) for _ in range(count)], one)
    rate = count * length / (time.perf_counter() - t0)
    run.rows.append(Row("engine", f"uncached prefill {count}x{length}",
                        achieved=f"{num(rate)} tok/s", extra={"tokens_per_s": rate}))  # fmt: skip
    alone = min(engine.generate([ids(s.delta)], one)[0].ttft_ms for _ in range(3))
    run.rows.append(Row("engine", f"TTFT {s.delta} tokens, no prefix",
                        achieved=f"{alone:,.1f} ms", extra={"ttft_ms": alone}))  # fmt: skip
    for ctx in s.ttft_contexts:
        if run.over_budget(f"cached TTFT after {ctx}"):
            return
        context = ids(ctx)
        engine.generate([context + ids(s.delta)], one)  # computes and caches the context
        r = engine.generate([context + ids(s.delta)], one)[0]
        run.rows.append(Row(
            "engine", f"TTFT {s.delta}-token delta after {ctx} cached",
            achieved=f"{r.ttft_ms:,.1f} ms ({r.ttft_ms / alone:.2f}x alone)",
            extra={"context": ctx, "ttft_ms": r.ttft_ms, "cached_tokens": r.cached_tokens,
                   "vs_alone": r.ttft_ms / alone},
        ))  # fmt: skip


def bench_decode_rate(run: Run, engine, ids: Prompts, graphs: bool) -> None:
    from radixserve.engine.sampling_params import SamplingParams

    s = run.shapes
    # long enough that nobody finishes inside the timed steps; the rest is aborted after
    n = s.decode_steps + 64
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    for batch in s.decode_batches:
        if run.over_budget(f"decode batch {batch}"):
            return
        rids = [engine.add_request(ids(s.decode_prompt), params) for _ in range(batch)]
        tokens = dict.fromkeys(rids, 0)  # generated so far
        while min(tokens.values()) < 3:
            # prefill, and two untimed decode steps (kernel compiles)
            tokens.update((o.request_id, o.completion_tokens) for o in engine.step())
        t0 = time.perf_counter()
        for _ in range(s.decode_steps):
            engine.step()  # samples on the host: each step ends synchronised
        rate = batch * s.decode_steps / (time.perf_counter() - t0)
        for r in rids:
            engine.abort(r)
        run.rows.append(Row(
            "engine", f"decode B={batch} graphs {'on' if graphs else 'off'}",
            achieved=f"{num(rate)} tok/s", extra={"batch": batch, "graphs": graphs,
                                                   "tokens_per_s": rate},
        ))  # fmt: skip


def bench_engine(run: Run) -> None:
    ids = Prompts(run.shapes.vocab)
    engine = make_engine(run, graphs=False)
    bench_prefill_and_ttft(run, engine, ids)
    bench_decode_rate(run, engine, ids, graphs=False)
    del engine
    gc.collect()  # the first engine's weights and pool go before the second's arrive
    if run.device.type != "cuda":
        for batch in run.shapes.decode_batches:
            run.rows.append(Row("engine", f"decode B={batch} graphs on",
                                achieved="n/a: CUDA graphs need a GPU"))  # fmt: skip
        bench_tp_engine(run)
        return
    torch.cuda.empty_cache()
    if not run.over_budget("decode with CUDA graphs"):
        bench_decode_rate(run, make_engine(run, graphs=True), ids, graphs=True)
        gc.collect()
        torch.cuda.empty_cache()
    if not run.over_budget("tensor parallelism"):
        bench_tp_engine(run)


def bench_tp_engine(run: Run) -> None:
    """The same random weights at ``tp_layers`` layers, saved once and loaded by every
    rank: uncached prefill and decode at TP=2 against TP=1 (each rank's KV budget as
    TP=1's). On one GPU: a row saying it was skipped."""
    import dataclasses
    import tempfile
    from pathlib import Path

    from radixserve.bench.random_checkpoint import random_checkpoint, save_model
    from radixserve.engine.engine import Engine
    from radixserve.engine.sampling_params import SamplingParams

    gpus = torch.cuda.device_count() if run.device.type == "cuda" else 0
    if run.device.type == "cuda" and gpus < 2:
        run.rows.append(Row("engine", "TP=2 vs TP=1", achieved=f"skipped: {gpus} GPU here "
                            "(tensor parallelism needs two or more)"))  # fmt: skip
        return
    s = dataclasses.replace(run.shapes, layers=run.shapes.tp_layers)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    batch, steps = max(s.decode_batches), s.decode_steps
    decode = SamplingParams(max_tokens=steps + 2, min_tokens=steps + 2, temperature=0.0)
    rates: dict[int, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        save_model(random_checkpoint(bench_config(s), device=run.device), Path(root), run.dtype)
        for tp in (1, 2):
            engine = Engine(
                engine_settings(run, model=root, tp=tp, kv_cache_memory_gib=s.kv_cache_gib / 4)
            )
            try:
                ids = Prompts(s.vocab)
                engine.generate([ids(256)], SamplingParams(max_tokens=4, temperature=0.0))
                count, length = s.prefill
                t0 = time.perf_counter()
                engine.generate([ids(length) for _ in range(count)], one)
                prefill = count * length / (time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.generate([ids(s.decode_prompt) for _ in range(batch)], decode)
                rates[tp] = (prefill, batch * (steps + 2) / (time.perf_counter() - t0))
            finally:
                engine.close()
                del engine
                gc.collect()
    (p1, d1), (p2, d2) = rates[1], rates[2]
    run.rows.append(Row(
        "engine", f"TP=2 vs TP=1, {s.layers} layers",
        achieved=f"prefill {num(p2)} vs {num(p1)} tok/s ({p2 / p1:.2f}x); decode B={batch} "
        f"{num(d2)} vs {num(d1)} tok/s ({d2 / d1:.2f}x)",
        extra={"prefill_tokens_per_s": {"tp1": p1, "tp2": p2},
               "decode_tokens_per_s": {"tp1": d1, "tp2": d2}},
    ))  # fmt: skip


def engine_targets(run: Run) -> list[Row]:
    out = []
    for r in run.rows:
        if r.section == "engine" and r.extra.get("context") == max(run.shapes.ttft_contexts):
            vs = r.extra["vs_alone"]
            out.append(target(f"cached TTFT after {r.extra['context']}: <= 2x the delta alone",
                              2.0 / vs, 1.0, shown=f"{vs:.2f}x"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main(more=bench_engine, more_targets=engine_targets))
