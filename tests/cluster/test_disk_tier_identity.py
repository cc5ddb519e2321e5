"""The disk tier across clean restarts of a whole cluster, and whose pages it serves
(real processes, ZMQ, HTTP; the tiny model, saved where the workers load it by path).

A cluster with a disk tier answers a prompt P of about 1,400 tokens and a shorter Q,
then prompts that push both out of the decode worker's pool into the host tier; it is
stopped (SIGTERM: the kvstore writes its host pages to disk on the way out), so P and Q
live only on disk. Between stops the test rewrites the record of Q's third page in the
files: other tokens under the same hash, with a valid checksum.

* Started again on the same directory with the same weights: the gateway's /health is
  200 only once the kvstore has adopted its files, and P's first request reports at
  least 1,000 of its tokens cached, all read from the disk tier (its ``tier="disk"``
  counter), with the single-process engine's answer. Q's record fails its proof: Q
  reports only the two pages before it cached, its answer is the uncached one, and the
  kvstore counts the page in ``radixserve_kv_identity_mismatch_total``.
* Started again with other weights (the same checkpoint quantized to int8 at load):
  P reports nothing cached from the host or disk tier, its answer is a fresh int8
  engine's without a prefix cache, and the kvstore counts the slabs' records as of
  another model identity, left alone.
* (benchmark) The same with two random-init checkpoints saved one after the other at
  the same path; and through `radixserve up` with the default model (its GGUF's int4
  weights, then ``--quantization none``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from radixserve.bench.random_checkpoint import RandomWeights
from radixserve.cache.page_proof import PageProof, pack_tokens
from radixserve.engine.engine import Engine
from radixserve.model.checkpoint import Checkpoint
from radixserve.services.kvstore.disk_files import (
    RecordBuffer,
    SlabFiles,
    check,
    seal,
    slab_layout,
)
from radixserve.settings import EngineSettings
from tests.cluster.cluster_helpers import TestCluster, memoised_chat, metric_value
from tests.cluster.prompts import QUESTIONS, chat
from tests.cluster.test_host_tier import MAX_TOKENS, PAGE, branch_system, cached, gib, tiers_env
from tests.engine.engine_helpers import TINY, make_engine, tiny_checkpoint, write_tiny_model

DEVICE_PAGES = 100  # P is 88 pages: two more long prompts push it out
HOST_PAGES = 260  # what the device evicts stays in host memory until the stop
DISK_PAGES = 2000
P = chat(QUESTIONS[0], branch_system(0) * 5)  # about 1,400 tokens
Q = chat(QUESTIONS[1], branch_system(1) * 2)
OTHERS = [chat(QUESTIONS[2 + i], branch_system(2 + i) * 5) for i in range(2)]


def start(model: str, disk_dir: Path, **env: str) -> TestCluster:
    return TestCluster(
        transport="zmq",
        num_prefill=0,
        model=model,
        kv_cache_memory_gib=gib(DEVICE_PAGES),
        kvstore=tiers_env(HOST_PAGES, disk_dir, DISK_PAGES),
        # a busy machine must not turn the tiers' lookups into timeouts
        decode={"HOST_LOOKUP_TIMEOUT_S": "5", "HOST_LOAD_MIN_TOKENS": "0"},
        env={f"RADIXSERVE_{k}": v for k, v in env.items()},
    )


def fill_and_stop(cluster: TestCluster) -> None:
    """P and Q, then prompts that evict them from the device; a clean stop."""
    try:
        cluster.wait_host_tier()
        for messages in [P, Q, *OTHERS]:
            cluster.ask(messages, MAX_TOKENS)
    finally:
        cluster.stop()


def kvstore_stat(cluster: TestCluster, key: str) -> float:
    return cluster.workers().get("kvstore", {}).get(key, 0)


def rewrite_third_page(disk_dir: Path, token_ids: list[int]) -> None:
    """Give the record of the third page of ``token_ids`` other tokens, keeping its hash
    and a valid checksum (found by its tokens and its parents', whatever the namespace)."""
    records = {}  # hash -> (files, slot, sequence, proof)
    for path in sorted(disk_dir.glob("slab-*.kv")):
        compat = slab_layout(path)
        assert compat is not None, path
        files = SlabFiles(disk_dir, compat)
        slab = files.open_slab(path)
        buffer = RecordBuffer(64, compat)
        for page_hash, slot, seq, proof in files.scan(slab, buffer).found:
            records[page_hash] = (files, slab.first + slot, seq, proof)
    parent = None
    for page in range(3):
        tokens = pack_tokens(token_ids[page * PAGE : (page + 1) * PAGE])
        [found] = [h for h, (_, _, _, proof) in records.items()
                   if proof.tokens == tokens and proof.parent == parent]  # fmt: skip
        parent = found
    files, slot, seq, proof = records[parent]
    record = RecordBuffer(1, files.compat)
    files.read([slot], [record.view(0)])
    assert check(record.view(0), files.digest, files.page_bytes, files.page_size) is not None
    other = [token_ids[2 * PAGE] + 1, *token_ids[2 * PAGE + 1 : 3 * PAGE]]
    forged = PageProof(proof.namespace, proof.parent, pack_tokens(other))
    seal(record.view(0), parent, seq, files.digest, files.page_bytes, forged)
    files.write([slot], [record.view(0)])
    for path_files in {id(f): f for f, _, _, _ in records.values()}.values():
        path_files.close()


def test_a_restart_serves_the_disk_tier_to_the_same_weights_only(
    tmp_path, tiny_model, tiny_reference_chat
):
    disk_dir = tmp_path / "disk"
    fill_and_stop(start(tiny_model, disk_dir))
    tokenizer = tiny_checkpoint().tokenizer
    rewrite_third_page(disk_dir, tokenizer.encode_chat(Q))

    cluster = start(tiny_model, disk_dir)  # started: /health is 200
    try:
        # no wait for the workers' attach: /health waited for it (and for the adoption)
        assert kvstore_stat(cluster, "disk_tier_ready") == 1
        assert kvstore_stat(cluster, "disk_restored_pages") > 88
        before = metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk")
        answer = cluster.ask(P, MAX_TOKENS)  # the first request after the restart
        after = metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk")
        assert cached(answer) >= 1000 and after - before >= 1000, (cached(answer), after - before)
        assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(P, MAX_TOKENS)
        answer = cluster.ask(Q, MAX_TOKENS)
        assert cached(answer) == 2 * PAGE  # the pages before the forged one
        assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(Q, MAX_TOKENS)
        mismatches = metric_value(cluster.metrics(), "radixserve_kv_identity_mismatch_total",
                                  worker="kvstore")  # fmt: skip
        assert mismatches == 1
        cluster.wait_clean()
    finally:
        cluster.stop()

    int8 = memoised_chat(make_engine(TINY, kv_cache_memory_gib=0.05, prefix_cache=False,
                                     quantization="int8"))  # fmt: skip
    cluster = start(tiny_model, disk_dir, QUANTIZATION="int8")
    try:
        cluster.wait_host_tier()
        answer = cluster.ask(P, MAX_TOKENS)
        assert cached(answer) == 0
        assert metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk") == 0
        assert answer["choices"][0]["message"]["content"] == int8(P, MAX_TOKENS)
        assert kvstore_stat(cluster, "disk_foreign_pages") > 88  # left alone, counted
    finally:
        cluster.stop()


def reseeded(seed: int) -> Checkpoint:
    """The tiny model's shape and tokenizer with other random weights."""
    base = tiny_checkpoint()
    source = RandomWeights(base.config, seed=seed, device=torch.device("cpu"), fan_in=True)
    return Checkpoint(base.config, base.tokenizer, source.path, source, progress=False)


@pytest.mark.benchmark
def test_other_weights_saved_at_the_same_path_get_none_of_the_disk_tier(tmp_path):
    model_dir = tmp_path / "model" / "tiny-smollm2"
    disk_dir = tmp_path / "disk"
    write_tiny_model(model_dir)
    fill_and_stop(start(str(model_dir), disk_dir))
    other = reseeded(1)
    write_tiny_model(model_dir, other)  # a new fine-tune over the old one's files
    settings = EngineSettings(model="default", device="cpu", load_progress=False,
                              kv_cache_memory_gib=0.05, prefix_cache=False)  # fmt: skip
    reference = memoised_chat(Engine(settings, checkpoint=other))
    cluster = start(str(model_dir), disk_dir)
    try:
        cluster.wait_host_tier()
        answer = cluster.ask(P, MAX_TOKENS)
        assert cached(answer) == 0
        assert metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk") == 0
        assert answer["choices"][0]["message"]["content"] == reference(P, MAX_TOKENS)
        assert kvstore_stat(cluster, "disk_foreign_pages") > 88
    finally:
        cluster.stop()


# -- the same through `radixserve up`, with the default model ------------------------


class Up:
    """`radixserve up --port 0 ...` on a disk tier: its URL is the one it announces."""

    def __init__(self, log: Path, disk_dir: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "radixserve.cli", "up", "--port", "0",
               "--kv-cache-gib", "0.06", "--host-tier-gib", "0.1", "--disk-tier-dir",
               str(disk_dir), *flags]  # fmt: skip
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "OpenAI API at " not in (text := log.read_text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"radixserve up did not come up:\n{text}")
            time.sleep(0.2)
        self.url = text.split("OpenAI API at ", 1)[1].split("/v1", 1)[0]
        # announced once the gateway's /health is 200
        assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200

    def ask(self, messages: list[dict[str, str]]) -> dict:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        resp = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=600)
        assert resp.status_code == 200, resp.text
        result: dict = resp.json()
        return result

    def disk_tokens(self) -> float:
        metrics = httpx.get(f"{self.url}/metrics", timeout=10).text
        return metric_value(metrics, "radixserve_cached_tokens_total", tier="disk")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)


@pytest.mark.benchmark
def test_radixserve_up_restarts_warm_on_its_disk_tier_for_the_same_weights_only(tmp_path):
    """`radixserve up --kv-cache-gib 0.06 --host-tier-gib 0.1 --disk-tier-dir D` with the
    default model: P (about 1,400 tokens), fourteen other long prompts, a clean stop; the
    same command on D: P's first request after /health reports >= 1,000 tokens cached,
    read from the disk tier; with ``--quantization none`` instead: nothing cached, and
    the answer of a fresh ``--quantization none --no-prefix-cache`` cluster."""
    disk_dir = tmp_path / "disk"
    prompt = chat(QUESTIONS[0], branch_system(0) * 5)
    others = [chat(QUESTIONS[i % 8], branch_system(i) * 5) for i in range(1, 15)]
    up = Up(tmp_path / "up-1.log", disk_dir)
    try:
        for messages in [prompt, *others]:
            up.ask(messages)
    finally:
        up.stop()
    up = Up(tmp_path / "up-2.log", disk_dir)
    try:
        before = up.disk_tokens()
        assert cached(up.ask(prompt)) >= 1000
        assert up.disk_tokens() - before >= 1000
    finally:
        up.stop()
    up = Up(tmp_path / "up-3.log", disk_dir, "--quantization", "none")
    try:
        answer = up.ask(prompt)
        assert cached(answer) == 0
    finally:
        up.stop()
    up = Up(tmp_path / "up-4.log", tmp_path / "fresh", "--quantization", "none",
            "--no-prefix-cache")  # fmt: skip
    try:
        fresh = up.ask(prompt)
    finally:
        up.stop()
    text = answer["choices"][0]["message"]["content"]
    assert text == fresh["choices"][0]["message"]["content"]
