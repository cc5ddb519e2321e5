"""Fixtures for cluster tests: the single-process reference engine outputs are compared to,
and the clusters test modules share.

A module that sets ``SHARED_CLUSTER = "<name>"`` gets that cluster from the ``cluster``
fixture: started once for every module naming it that a worker runs (they run one after
another there: see `pytest_collection_modifyitems`) and stopped before any other module
runs, so at most one shared cluster is up at a time in a worker and none idles beside a
test that starts its own."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import PATIENT, Reference, TestCluster, memoised_chat
from tests.engine.engine_helpers import FLOAT32, TINY, make_engine
from tests.tracing.otlp_receiver import OtlpReceiver

SHARED = {
    # remote prefill of every prompt over NIXL; room for 64 concurrent streams; a lost
    # decode worker's streams wait for its restart on a busy machine
    "remote": lambda: TestCluster(
        transport="nixl",
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},
        gateway={"MAX_QUEUED_REQUESTS": "64", "MIGRATION_WAIT_S": "90"},
    ),
}
#: clusters of the tiny model (the `tiny_model` fixture's path is their argument)
SHARED_TINY = {
    # the defaults, pages over ZMQ (the "remote" clusters move them over NIXL), and
    # speculative decoding on (its modules' answers are compared with one engine's)
    "default-tiny": lambda model: TestCluster(
        transport="zmq", model=model, env={"RADIXSERVE_SPECULATIVE_METHOD": "both"}
    ),
    # "remote" on the tiny model: faults and load, where the subject is the machinery;
    # every process exports its spans to this process's OTLP receiver
    "remote-tiny": lambda model: TestCluster(
        transport="nixl",
        model=model,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},
        gateway={"MAX_QUEUED_REQUESTS": "64", "MIGRATION_WAIT_S": "90"},
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver().endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    ),
    # two prefill workers that compute every prompt and write each prefix through to the
    # host tier as they compute it; its tests stop workers (SIGSTOP) to have requests
    # routed together, so a peer stays up 10 s without heartbeats (no test kills one)
    "two-prefill-tiny": lambda model: TestCluster(
        num_prefill=2,
        model=model,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0", **PATIENT},
        prefill={"HOST_WRITE_THROUGH_USES": "1", **PATIENT},
        gateway=PATIENT,
        kvstore=PATIENT,
    ),
}
_running: dict[str, TestCluster] = {}
_receivers: dict[str, OtlpReceiver] = {}


def otlp_receiver() -> OtlpReceiver:
    """The OTLP receiver of this test process, where the "remote-tiny" cluster exports
    its spans (started with the first cluster that needs it, kept for the session)."""
    if "otlp" not in _receivers:
        _receivers["otlp"] = OtlpReceiver()
    return _receivers["otlp"]


def _stop_shared(keep: str | None = None) -> None:
    for name in [n for n in _running if n != keep]:
        _running.pop(name).stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules sharing a cluster run next to each other (the order is otherwise kept)."""

    def group(item: pytest.Item) -> str:
        module = getattr(item, "module", None)
        return getattr(module, "SHARED_CLUSTER", None) or getattr(module, "__name__", "")

    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(group(item), i)
    items.sort(key=lambda item: first[group(item)])


@pytest.fixture(scope="module", autouse=True)
def _one_shared_cluster(request: pytest.FixtureRequest):
    """Stop a shared cluster as soon as a module that does not use it begins."""
    _stop_shared(keep=getattr(request.module, "SHARED_CLUSTER", None))
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_clusters_stop_at_the_end():
    yield
    _stop_shared()
    while _receivers:
        _receivers.popitem()[1].close()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> TestCluster:
    """The module's shared cluster (its ``SHARED_CLUSTER``)."""
    name = request.module.SHARED_CLUSTER
    if name not in _running:
        if name in SHARED_TINY:
            _running[name] = SHARED_TINY[name](request.getfixturevalue("tiny_model"))
        else:
            _running[name] = SHARED[name]()
    return _running[name]


@pytest.fixture(scope="session")
def reference_engine():
    """SmolLM2 with the engine's defaults (bfloat16, the GGUF's int4 weights), prefix cache
    off: what one process would answer. The clusters run the same: their checks compare
    many prompts token for token, across cached and uncached prompts, migrations, the
    host tier and seeded draws, which holds bit for bit because every CPU op computes a
    row the same way whatever else is in its step (docs/architecture.md)."""
    return make_engine("default", kv_cache_memory_gib=0.1, prefix_cache=False)


@pytest.fixture(scope="session")
def reference_chat(reference_engine) -> Reference:
    """Greedy answer text of the single-process engine to a chat, memoised."""
    return memoised_chat(reference_engine)


@pytest.fixture(scope="session")
def tiny_reference_engine():
    """`reference_engine` for clusters of the `tiny_model`: the same weights in-process."""
    return make_engine(TINY, kv_cache_memory_gib=0.05, prefix_cache=False)


@pytest.fixture(scope="session")
def tiny_reference_chat(tiny_reference_engine) -> Reference:
    """`reference_chat` for clusters of the `tiny_model`."""
    return memoised_chat(tiny_reference_engine)


@pytest.fixture(scope="session")
def tiny_float32_reference_chat() -> Reference:
    """`tiny_reference_chat` in float32, for tensor-parallel clusters (``float32=True``):
    their all-reduce adds each row's partial sums in another order than one process does,
    which float32's rounding absorbs and bfloat16's would not."""
    return memoised_chat(make_engine(TINY, kv_cache_memory_gib=0.05, prefix_cache=False,
                                     **FLOAT32))  # fmt: skip
