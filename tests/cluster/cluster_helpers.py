"""A real local cluster for tests: prefill, decode and gateway processes on loopback.

`TestCluster` is `radixserve.bench.local_cluster.LocalCluster` (the processes `radixserve
up` runs, supervised from the test thread) with short heartbeats, so failures show
within seconds, and an HTTP client. `wait_clean` polls the gateway's /debug/cache until
every worker that is up reports, in a heartbeat sent after the call, no live request, no
locked page, no lease and no task: the leak check the cluster tests run after every
scenario (host-tier loads and leases included). The kvstore's host tier is 0.25 GiB here unless a test sets another size.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import zmq

from radixserve.bench.local_cluster import LocalCluster, metric_value
from radixserve.cache.block_hash import hash_namespace, page_hashes
from radixserve.engine.sampling_params import SamplingParams
from radixserve.launch.cluster import ClusterConfig
from radixserve.model.identity import ModelIdentity
from radixserve.protocol import Channel, IndexQuery, IndexReply

__all__ = ["FAST_LIVENESS", "PATIENT", "TestCluster", "children", "descendants", "gone",
           "holds_nothing", "index_query", "metric_value", "service_pid", "stopped",
           "wait_workers"]  # fmt: skip

FAST_LIVENESS = {"HEARTBEAT_INTERVAL_S": "0.2", "PEER_TIMEOUT_S": "2.0"}
#: liveness for clusters whose workers a test stops (`stopped`) and no test kills: a
#: peer that misses heartbeats stays up for 10 s rather than FAST_LIVENESS's 2 s
PATIENT = {"PEER_TIMEOUT_S": "10"}


@contextlib.contextmanager
def stopped(cluster: TestCluster, names: tuple[str, ...]):
    """The processes ``names`` stopped (SIGSTOP) for the block, continued after it: what
    is sent to them meanwhile waits, unanswered, so requests sent together are routed
    together however fast the model is (the cluster's peers must wait that long for
    their heartbeats: see `PATIENT`)."""
    pids = [cluster.supervisor.pid(name) for name in names]
    assert all(pids), pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def wait_workers(client: httpx.AsyncClient, condition, what: str, timeout_s: float = 30):
    """Poll the gateway's /debug/cache until ``condition(workers)`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition(workers := (await client.get("/debug/cache")).json()["workers"]):
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {workers}"
        await asyncio.sleep(0.01)


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its command line."""
    found: dict[int, str] = {}
    for child in children(pid):
        with contextlib.suppress(OSError):
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        found.update(descendants(child))
    return found


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def service_pid(pid: int, service: str) -> int:
    """The pid of the ``radixserve.services.<service>`` process below ``pid``."""
    [found] = [p for p, cmd in descendants(pid).items()
               if cmd.split()[1:3] == ["-m", f"radixserve.services.{service}"]]  # fmt: skip
    return found


def _env(prefix: str, values: dict[str, str]) -> dict[str, str]:
    return {f"RADIXSERVE_{prefix}_{k}": v for k, v in values.items()}


class TestCluster(LocalCluster):
    """Starts on construction (waits for /health and every worker); `stop()` ends it."""

    __test__ = False  # not a test class, despite the name

    def __init__(
        self,
        *,
        transport: str = "nixl",
        num_prefill: int = 1,
        num_decode: int = 1,
        nodes: int = 1,  # kvstores, one per node (workers spread over them)
        prefill_tp: int = 1,
        decode_tp: int = 1,
        decode: dict[str, str] | None = None,
        gateway: dict[str, str] | None = None,
        prefill: dict[str, str] | None = None,
        kvstore: dict[str, str] | None = None,
        kv_cache_memory_gib: float = 0.1,
        float32: bool = False,  # FLOAT32 (float32 weights and compute): tensor parallelism
        model: str | None = None,  # a path (the `tiny_model` fixture's); None: the default
        env: dict[str, str] | None = None,  # more variables for every process (OTEL_*...)
        prefill_engine: dict[str, str] | None = None,  # RADIXSERVE_* of the prefill workers'
    ) -> None:
        config = ClusterConfig(
            num_prefill=num_prefill,
            num_decode=num_decode,
            nodes=nodes,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            transport=transport,
            # one thread per worker, fixed, as these tests were sized for on 2 cores: under
            # their load (a tiny pool spilling to the host tier) the shared cores lost to it
            # (tests/engine/test_cores.py and test_up.py run the default, the core board)
            num_threads=1,
            port=0,  # any free port, bound by the cluster's supervisor (`url`)
            engine_env={
                "RADIXSERVE_DEVICE": "cpu",
                # the engine's defaults otherwise (bfloat16, the GGUF's int4 weights)
                **(
                    {"RADIXSERVE_DTYPE": "float32", "RADIXSERVE_QUANTIZATION": "none"}
                    if float32
                    else {}
                ),  # fmt: skip
                "RADIXSERVE_KV_CACHE_MEMORY_GIB": str(kv_cache_memory_gib),
                **({"RADIXSERVE_MODEL": model} if model else {}),
                # every process gets these; the kvstore reads them
                **_env(
                    "KVSTORE", {**FAST_LIVENESS, "HOST_CAPACITY_GIB": "0.25", **(kvstore or {})}
                ),
                **(env or {}),
            },
            prefill_env={
                **_env("PREFILL", {**FAST_LIVENESS, **(prefill or {})}),
                **(prefill_engine or {}),
            },  # fmt: skip
            decode_env=_env("DECODE", {**FAST_LIVENESS, **(decode or {})}),
            gateway_env=_env("GATEWAY", {**FAST_LIVENESS, **(gateway or {})}),
        )
        super().__init__(config)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def ask(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """A greedy chat completion (fails the test unless it is a 200); its JSON."""
        body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0}  # fmt: skip
        resp = self.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def wait_clean(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until every up worker holds nothing for any request; return /debug/cache."""
        last: dict[str, Any] = {}
        beats = {name: w.get("heartbeats_total", 0) for name, w in self.workers().items()}

        def clean() -> bool:  # judged on heartbeats sent after the last request
            nonlocal last
            last = self.debug_cache()
            workers = last["workers"].items()
            fresh = all(not w["up"] or w.get("heartbeats_total", 0) > beats.get(n, 0) + 1
                        for n, w in workers)  # fmt: skip
            return fresh and holds_nothing(last)

        try:
            self.wait(clean, timeout_s, "workers to hold no request")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; last /debug/cache: {last}") from None
        return last

    def stop(self) -> None:
        self.http.close()
        super().stop()


HELD_KEYS = ("live_requests", "pages_locked", "leases", "tasks", "host_loads_in_flight",
             "host_leases", "host_pages_leased", "disk_leases", "disk_pages_leased")  # fmt: skip


def holds_nothing(debug_cache: dict[str, Any]) -> bool:
    """Whether a gateway's /debug/cache shows nothing held for any request: no request in
    flight at the gateway, and on every worker that is up no live request, locked page,
    lease, task or host-tier load."""
    return debug_cache["gateway_in_flight"] == 0 and all(
        not w["up"] or all(w.get(key, 0) == 0 for key in HELD_KEYS)
        for w in debug_cache["workers"].values()
    )


def index_query(
    cluster: TestCluster,
    prompt_ids: list[int],
    page: int = 16,
    adapter: str = "",
    kvstore: str = "kvstore",
    shard: tuple[int, int] = (0, 1),
) -> IndexReply | None:
    """Ask the kvstore which workers hold how many leading pages of ``prompt_ids`` on
    device, and how many its host tier holds (None if it does not answer within 2 s);
    the pages of the LoRA adapter whose fingerprint is ``adapter``, if one is given.
    ``kvstore``: its name; ``shard``: which of how many shards of the index it is."""
    address = cluster.workers()[kvstore]["address"]
    view = cluster.debug_cache()
    # the workers' `ModelIdentity`: the gateway's own view forgets it while no decode
    # worker is up (e.g. the only one was just killed); any worker that reports it names it
    cards = [view["model_identity"]] + [w.get("model_identity") for w in view["workers"].values()]
    card = next(c for c in cards if c and "weights" in c)
    identity = ModelIdentity(card["weights"], card["quantization"], card["dtype"],
                             adapter or card["adapter"])  # fmt: skip
    hashes = page_hashes(prompt_ids, page, hash_namespace(identity.key))
    context = zmq.Context()
    try:
        with Channel.open(context, zmq.DEALER, address, bind=False) as channel:
            query_id = uuid.uuid4().hex
            channel.send(IndexQuery(query_id, tuple(hashes), *shard), timeout_ms=2000)
            deadline = time.monotonic() + 2
            # the kvstore heartbeats a socket that has sent it anything: skip its beats
            while (wait_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                reply = channel.recv(timeout_ms=wait_ms)
                if reply is None or isinstance(reply, IndexReply):
                    break
            else:
                reply = None
    finally:
        context.term()
    if reply is None:
        return None
    assert isinstance(reply, IndexReply) and reply.query_id == query_id
    return reply


Reference = Callable[[list[dict[str, str]], int], str]


def memoised_chat(reference_engine) -> Reference:
    """The greedy answer text of `reference_engine` (one process) to a chat, memoised."""
    memo: dict[tuple, str] = {}

    def answer(messages: list[dict[str, str]], max_tokens: int) -> str:
        key = (tuple((m["role"], m["content"]) for m in messages), max_tokens)
        if key not in memo:
            ids = reference_engine.tokenizer.encode_chat(messages)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            memo[key] = reference_engine.generate([ids], params)[0].text
        return memo[key]

    return answer
