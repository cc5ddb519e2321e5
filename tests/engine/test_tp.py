"""Tensor parallelism: one engine split over rank processes (torch.distributed over gloo,
real processes), against the same model on one rank.

The engine under test is rank 0 in this process; its ranks 1..N-1 are processes it
starts (`radixserve.engine.tp_group`). Greedy tokens must be identical to one rank's, in
float32 without quantization, for prompts that are computed whole, in chunks (a 48-token
step budget), and again from the prefix cache (the second pass over the same prompts).

- split: a tiny random model with 8 query and 4 KV heads at TP=2 (4 and 2 per rank);
- replicated: 4 query heads and one KV head at TP=2 (the KV head on both ranks);
- at TP=4 both (marked ``benchmark``: four processes; ``make bench-test``);
- the default model (9 query, 3 KV heads) at TP=3 (marked ``benchmark``: the default
  model loaded by four processes; ``make bench-test``), and TP=2 refused at start, naming
  its head counts;
- a call a rank fails (`TPGroup.call`) is raised by rank 0 naming it, and the group
  computes on;
- a rank that dies takes its engine's process down (exit 1, saying which rank), and the
  ranks of a killed rank 0 exit: no process is left.

Pure checks of the split (every rank's slices put together are the checkpoint) come first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.tp_calls import Spill
from radixserve.errors import ModelLoadError
from radixserve.model.config import ModelConfig
from radixserve.model.layout import shard_layout, weight_layout
from radixserve.model.tp import TPShard, take
from radixserve.settings import EngineSettings
from tests.cluster.cluster_helpers import gone
from tests.engine.engine_helpers import tiny_checkpoint, write_tiny_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an "
    "old woodcutter and his three children. Every morning he walked into the woods",
    "Once upon a time, in a small village at the edge of a great forest, a fox",
    "def merge_sort(items):\n" + "    # split, sort each half, merge\n" * 6,
]
MAX_TOKENS = 12


# --- the split -----------------------------------------------------------------------


def _config(heads: int, kv: int, ff: int = 96) -> ModelConfig:
    return ModelConfig("llama", 100, 64, ff, 1, heads, kv, 16, 1e-5, 1e4, 128, False,
                       name="m")  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv", "size", "starts"),
    [(8, 4, 2, [0, 2]), (8, 4, 4, [0, 1, 2, 3]), (4, 2, 4, [0, 0, 1, 1]), (9, 3, 3, [0, 1, 2])],
)
def test_each_rank_reads_the_kv_heads_of_its_query_heads(heads, kv, size, starts):
    config = _config(heads, kv)
    got = []
    for rank in range(size):
        tp = TPShard(rank, size)
        tp.check(config)
        group = heads // kv  # query heads per KV head
        first_q = rank * tp.q_heads(config)
        assert tp.kv_head_start(config) == first_q // group  # the head its queries read
        got.append(tp.kv_head_start(config))
    assert got == starts


@pytest.mark.parametrize(("heads", "kv", "size"), [(9, 3, 2), (8, 4, 3), (8, 2, 3), (12, 6, 4)])
def test_a_split_that_cannot_be_is_refused_naming_the_head_counts(heads, kv, size):
    config = _config(heads, kv, ff=120)
    with pytest.raises(ModelLoadError) as err:
        TPShard(0, size).check(config)
    message = str(err.value)
    assert f"tensor-parallel size {size}" in message
    assert f"{heads} query heads" in message and f"{kv} KV heads" in message


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_slices_put_together_are_the_checkpoint(size):
    """Column-parallel pieces concatenated over the ranks (rows), row-parallel ones
    (inputs) and the vocabulary: each checkpoint tensor exactly once (KV heads
    replicated where there are fewer than ranks)."""
    config = tiny_checkpoint(8, 4).config
    source = tiny_checkpoint(8, 4).source
    full = {name: shape for p in weight_layout(config).values() for name, _, shape in p}
    slices: dict[str, list[torch.Tensor]] = {}
    for rank in range(size):
        for pieces in shard_layout(config, TPShard(rank, size)).values():
            for name, _, shape, how in pieces:
                piece = take(source.read(name), how, name)
                assert tuple(piece.shape) == shape
                slices.setdefault(name, []).append(piece)
    for name, parts in slices.items():
        weight = source.read(name)
        if ".o_proj." in name or ".down_proj." in name:
            assert torch.equal(torch.cat(parts, dim=1), weight), name
        elif len(parts[0].shape) == 1 and "norm" in name:
            assert all(torch.equal(p, weight) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=0), weight), name
        assert tuple(weight.shape) == full[name]


def test_experts_split_by_their_rows_and_the_router_is_whole(tmp_path):
    """Qwen3-MoE at TP=2: each expert's gate/up rows and down inputs split like the
    dense MLP's (every rank holds every expert), the router whole on each rank."""
    from radixserve.model.checkpoint import load_checkpoint
    from tests.engine.test_families import FAMILIES
    from tests.model.tiny_checkpoints import write_tiny_checkpoint

    checkpoint = load_checkpoint(
        str(write_tiny_checkpoint(tmp_path, **FAMILIES["qwen3_moe"])), progress=False
    )
    config, source = checkpoint.config, checkpoint.source
    slices: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        for pieces in shard_layout(config, TPShard(rank, 2)).values():
            for name, _, shape, how in pieces:
                piece = take(source.read(name), how, name)
                assert tuple(piece.shape) == shape
                slices.setdefault(name, []).append(piece)
    experts = [n for n in slices if ".experts." in n]
    assert len(experts) == 2 * 3 * config.num_experts  # two sparse layers, three projections
    for name in experts:
        dim = 1 if name.endswith("down_proj.weight") else 0
        assert slices[name][0].shape[dim] == config.moe_intermediate_size // 2
        assert torch.equal(torch.cat(slices[name], dim=dim), source.read(name)), name
    for name in (n for n in slices if n.endswith("mlp.gate.weight")):
        assert all(torch.equal(p, source.read(name)) for p in slices[name]), name


# --- rank processes ------------------------------------------------------------------


def _settings(model: str, tp: int, **overrides) -> EngineSettings:
    values = {"model": model, "device": "cpu", "dtype": "float32", "quantization": "none",
              "kv_cache_memory_gib": 0.02, "max_num_batched_tokens": 48,
              "load_progress": False, "tp": tp, "num_threads": 1}  # fmt: skip
    values.update(overrides)
    return EngineSettings(**values)


def _greedy(engine: Engine, texts: list[str]) -> list[list[int]]:
    """Every prompt's greedy tokens: all together, then again (now cached) one by one."""
    prompts = [engine.tokenize(p) for p in texts]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = engine.generate(prompts, params)
    again = [engine.generate([p], params)[0] for p in prompts]
    assert all(r.cached_tokens > 0 for r in again[1:])  # the second pass read the cache
    assert [r.token_ids for r in again] == [r.token_ids for r in first]  # and changed nothing
    return [r.token_ids for r in first]


def _run(settings: EngineSettings, texts: list[str] = PROMPTS) -> list[list[int]]:
    threads = torch.get_num_threads()
    engine = Engine(settings)
    try:
        return _greedy(engine, texts)
    finally:
        engine.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Callable[[int, int], str]:
    """The tiny model with ``heads`` query and ``kv`` KV heads, written once each."""
    written: dict[tuple[int, int], str] = {}

    def path(heads: int, kv: int) -> str:
        if (heads, kv) not in written:
            root = tmp_path_factory.mktemp("tp") / f"tiny-{heads}-{kv}"
            written[heads, kv] = str(write_tiny_model(root, tiny_checkpoint(heads, kv)))
        return written[heads, kv]

    return path


FOUR_RANKS = pytest.mark.benchmark  # four processes: make bench-test


@pytest.mark.parametrize(
    ("heads", "kv", "tp"),
    [
        (8, 4, 2),  # split: 4 query and 2 KV heads per rank
        (4, 1, 2),  # replicated: the one KV head on both ranks
        pytest.param(8, 4, 4, marks=FOUR_RANKS),  # split: 2 and 1
        pytest.param(4, 2, 4, marks=FOUR_RANKS),  # replicated: each KV head on two ranks
    ],
)
def test_greedy_tokens_equal_the_single_rank_ones(tiny_models, heads, kv, tp):
    model = tiny_models(heads, kv)
    assert _run(_settings(model, tp)) == _run(_settings(model, 1))


def test_experts_at_tp_2_give_the_single_rank_tokens(tmp_path):
    """Qwen3-MoE (sparse, dense, sparse layers) split over two ranks: each rank's share of
    every expert, the partial sums all-reduced."""
    from tests.engine.test_families import FAMILIES
    from tests.model.tiny_checkpoints import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path, **FAMILIES["qwen3_moe"]))
    texts = PROMPTS[1:3]
    assert _run(_settings(model, 2), texts) == _run(_settings(model, 1), texts)


@pytest.mark.benchmark  # 16 s of the default model on four processes: make bench-test
def test_the_default_model_at_tp_3_gives_the_single_rank_tokens():
    texts = PROMPTS[1:3]  # a chunked prompt, and one whose prefix it leaves in the cache
    assert _run(_settings("default", 3), texts) == _run(_settings("default", 1), texts)


def test_a_call_a_rank_fails_is_raised_naming_it_and_the_group_computes_on(tiny_model):
    """A spill before the ranks mapped a spill buffer fails on rank 1: rank 0 raises,
    naming the call, and the group still computes the single rank's tokens."""
    threads = torch.get_num_threads()
    engine = Engine(_settings(tiny_model, 2))
    try:
        assert engine.tp_group is not None
        with pytest.raises(RuntimeError, match=r"1 tensor-parallel rank\(s\) failed 'spill'"):
            engine.tp_group.call(Spill([0], [0]))
        got = _greedy(engine, PROMPTS[:1])
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert got == _run(_settings(tiny_model, 1), PROMPTS[:1])


def test_the_default_model_at_tp_2_is_refused_before_any_rank_starts():
    before = _rank_processes()
    with pytest.raises(ModelLoadError, match="9 query heads, 3 KV heads"):
        Engine(_settings("default", 2))
    # no rank started by this process (another xdist worker's ranks are not its children)
    assert _rank_processes() - before == set()


def _rank_processes() -> set[int]:
    """The TP rank processes this test process started (and that are still alive)."""
    ranks = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "radixserve.engine.tp_rank" in " ".join(p.cmdline()):
                ranks.add(p.pid)
        except psutil.Error:  # ended meanwhile
            continue
    return ranks


HOLDER = """
import sys, time
from radixserve.engine.engine import Engine
from radixserve.settings import EngineSettings
engine = Engine(EngineSettings.model_validate_json(sys.argv[1]))
print("ready", [p.pid for p in engine.tp_group.procs], flush=True)
time.sleep(120)
"""


def _start_holder(settings: EngineSettings) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, settings.model_dump_json()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.stderr else "")
    ranks = [int(x) for x in line.split("[", 1)[1].rstrip("]\n").split(",")]
    return proc, ranks


def _all_gone(pids: list[int], timeout_s: float) -> bool:
    """Whether every one of ``pids`` has exited (a zombie has) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_dead_rank_takes_its_engine_down_and_no_process_is_left(tiny_model):
    proc, ranks = _start_holder(_settings(tiny_model, 2))
    try:
        os.kill(ranks[0], signal.SIGKILL)  # rank 1
        assert proc.wait(timeout=30) == 1
        stderr = proc.stderr.read() if proc.stderr else ""
        assert f"tensor-parallel rank 1 (pid {ranks[0]}) exited" in stderr, stderr
        assert _all_gone(ranks, 10)
    finally:
        proc.kill()
        proc.wait()


def test_the_ranks_of_a_killed_engine_exit(tiny_model):
    proc, ranks = _start_holder(_settings(tiny_model, 2))
    try:
        proc.kill()  # kill -9 of rank 0: nobody tells the ranks
        proc.wait()
        assert _all_gone(ranks, 10), "a rank outlived its engine"
    finally:
        for pid in ranks:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
