"""Micro-benchmark: ``RadixCache.match_prefix`` on an 8k-token prompt in a realistic tree.

The tree is built the way a chat server fills it: several conversations share one
system prompt; every turn inserts the whole conversation so far, and every turn also
has a regenerated answer that branches off at the start of the assistant reply:

    root ── system prompt ──┬── conv 0: turn 1 ──┬── turn 2 ──┬── ... ── turn N (8k tokens)
                            │                    └── regen 1  └── regen 2
                            ├── conv 1: ...
                            └── conv 2: ...

The timed query is conversation 0's full 8k-token prompt, a complete hit whose path
crosses one node per turn. Run ``python bench/radix_match.py`` to print the figure.
"""

from __future__ import annotations

import logging
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.cache.block_hash import hash_namespace  # noqa: E402
from radixserve.cache.page_allocator import PageAllocator  # noqa: E402
from radixserve.cache.radix_cache import RadixCache  # noqa: E402

logger = logging.getLogger(__name__)

VOCAB_SIZE = 32_000
SYSTEM_PROMPT_TOKENS = 1_000
NUM_CONVERSATIONS = 3


def _insert_request(cache: RadixCache, allocator: PageAllocator, tokens: list[int]) -> None:
    """Do what a finished request does: hold pages for its tokens, insert, drop them."""
    aligned = tokens[: len(tokens) - len(tokens) % cache.page_size]
    pages = allocator.alloc(len(aligned) // cache.page_size)
    cache.insert(aligned, pages)
    allocator.decref(pages)


def _conversation(rng: random.Random, system: list[int], num_tokens: int) -> list[list[int]]:
    """Prefixes of one conversation at each turn end, the last one ``num_tokens`` long."""
    tokens = list(system)
    turns: list[list[int]] = []
    while len(tokens) < num_tokens:
        tokens += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(100, 400))]  # user
        tokens += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(200, 900))]  # reply
        turns.append(tokens[:num_tokens])
    return turns


def build_tree(num_tokens: int, page_size: int, seed: int = 0) -> tuple[RadixCache, list[int]]:
    """Build the benchmark tree; return it and the prompt to match (``num_tokens`` long)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB_SIZE) for _ in range(SYSTEM_PROMPT_TOKENS)]
    conversations = [_conversation(rng, system, num_tokens) for _ in range(NUM_CONVERSATIONS)]
    total_tokens = sum(len(turn) * 2 for turns in conversations for turn in turns)
    allocator = PageAllocator(total_tokens // page_size + 1)
    cache = RadixCache(allocator, page_size, hash_namespace("bench-model"))
    for turns in conversations:
        for turn in turns:
            _insert_request(cache, allocator, turn)
            regenerated = turn[: len(turn) - 300] + [rng.randrange(VOCAB_SIZE) for _ in range(300)]
            _insert_request(cache, allocator, regenerated)
    return cache, conversations[0][-1]


def time_match_prefix(
    num_tokens: int = 8192, page_size: int = 16, repeats: int = 2000
) -> dict[str, float]:
    """Time ``match_prefix`` of a ``num_tokens`` prompt; return µs statistics.

    Keys: ``median_us``, ``min_us``, ``matched_tokens``, ``num_tokens``, ``repeats`` and
    ``path_nodes`` (nodes on the matched path).
    The first (splitting) match is a warm-up and is not timed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    cache, prompt = build_tree(num_tokens, page_size)
    result = cache.match_prefix(prompt)
    samples_ns: list[int] = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        cache.match_prefix(prompt)
        samples_ns.append(time.perf_counter_ns() - start)
    cache.check_integrity()
    path_nodes = 0
    node = result.node
    while node.parent is not None:
        path_nodes += 1
        node = node.parent
    return {
        "median_us": statistics.median(samples_ns) / 1000.0,
        "min_us": min(samples_ns) / 1000.0,
        "matched_tokens": float(result.num_tokens),
        "num_tokens": float(len(prompt)),
        "repeats": float(repeats),
        "path_nodes": float(path_nodes),
    }


if __name__ == "__main__":
    stats = time_match_prefix()
    print(
        f"match_prefix of {int(stats['num_tokens'])} tokens "
        f"({int(stats['matched_tokens'])} matched, {int(stats['path_nodes'])} nodes), page_size 16, {int(stats['repeats'])} runs: "
        f"median {stats['median_us']:.1f} us, min {stats['min_us']:.1f} us"
    )
