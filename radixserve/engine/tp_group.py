"""A worker's tensor-parallel group: rank 0 is the worker's own process, and it starts
ranks 1..N-1 as processes (``python -m radixserve.engine.tp_rank``), joined by
torch.distributed (gloo on CPU; NCCL for the model's collectives on CUDA, gloo for the
step messages).

Only rank 0 schedules. Before each forward it broadcasts the step (`PackedStep`: one
fixed-size header, then one int64 buffer of token ids, positions, slots and page table);
every rank rebuilds the same `ForwardBatch` from it and runs its shard, and the shards'
collectives (`DistComm`) meet inside the forward. Page ids are the same on every rank,
so the only other messages are a page copy (choices of ``n`` sharing a prompt page) and
`call`s: a typed call (`radixserve.engine.tp_calls`) every rank runs before rank 0 goes on
(a worker's ranks starting their KV transfer agents, copying their heads of spilled pages
into the host tier's buffer).

Failure: a rank that exits (or is killed) takes its worker down: rank 0 watches its rank
processes and, when one exits unasked, logs which and exits (the supervisor restarts the
worker and the gateway migrates its streams, as for any dead worker); a rank whose rank
0 is gone exits too (its next message fails, and it watches its parent).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from radixserve.engine.tp_calls import TPCall, encode
from radixserve.errors import ModelLoadError
from radixserve.model.forward_batch import PackedStep
from radixserve.settings import EngineSettings

logger = logging.getLogger(__name__)

OP_STOP, OP_FORWARD, OP_COPY_PAGE, OP_CALL = 0, 1, 2, 3
HEADER_LEN = 2 + PackedStep.HEADER_LEN  # op, then (buffer length, step header) or (src, dst)
#: how long ranks wait for each other: joining, loading, and any one collective
TIMEOUT_S = 600
ENV_RANK, ENV_PORT, ENV_SETTINGS = (
    "RADIXSERVE_TP_RANK", "RADIXSERVE_TP_PORT", "RADIXSERVE_TP_SETTINGS",
)  # fmt: skip


class DistComm:
    """`radixserve.model.tp.TPComm` over the default torch.distributed group."""

    def __init__(self, size: int) -> None:
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


def threads_per_rank(settings: EngineSettings) -> int:
    """CPU threads of each rank: the setting, else an equal share of the cores."""
    return settings.num_threads or max(1, (os.cpu_count() or 1) // settings.tp)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank ``rank`` computes on: CUDA device ``rank``, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def rendezvous(rank: int, size: int, port: int = 0) -> dist.TCPStore:
    """The group's store on loopback: rank 0 serves it (``port`` 0: one the system picks,
    read back as ``.port``), the other ranks connect to ``port``."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                         timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)  # fmt: skip


def join(rank: int, size: int, store: dist.Store, device: torch.device) -> DistComm:
    """Join the group (blocks until every rank has)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S)
    )
    return DistComm(size)


def report_ready(ok: bool, num_pages: int, size: int) -> list[tuple[int, int]]:
    """Every rank's (loaded, KV pages), exchanged once after loading: a rank that failed
    still reports, so rank 0 raises instead of waiting for it."""
    mine = torch.tensor([int(ok), num_pages], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine)
    return [(int(t[0]), int(t[1])) for t in every]


class TPGroup:
    """Rank 0's end of the group: starts the rank processes, sends them each step."""

    def __init__(self, settings: EngineSettings, device: torch.device) -> None:
        """Start ranks 1..tp-1 and join them (they load the model meanwhile); call
        `ready` once rank 0's own shard is loaded."""
        self.size = settings.tp
        store = rendezvous(0, self.size)
        env = {**os.environ, ENV_PORT: str(store.port), ENV_SETTINGS: settings.model_dump_json()}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "radixserve.engine.tp_rank"], env={**env, ENV_RANK: str(r)}
            )
            for r in range(1, self.size)
        ]
        self._stopping = False
        atexit.register(self.stop)
        try:
            self.comm = join(0, self.size, store, device)
        except BaseException:
            self._kill()
            raise
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        logger.info("tensor-parallel group of %d ranks joined (ranks 1..%d: pids %s)",
                    self.size, self.size - 1, [p.pid for p in self.procs])  # fmt: skip

    def ready(self, ok: bool, num_pages: int) -> None:
        """Exchange every rank's load result; raise if a rank failed or disagrees on the
        pool; then watch the ranks (one that exits takes the worker down)."""
        states = report_ready(ok, num_pages, self.size)
        failed = [r for r, (loaded, _) in enumerate(states) if not loaded]
        if failed:
            self.stop()
            raise ModelLoadError(f"tensor-parallel rank(s) {failed} could not load the model "
                                 "(their errors are logged above)")  # fmt: skip
        pages = {n for _, n in states}
        assert pages == {num_pages}, f"ranks disagree on the KV pool's pages: {states}"
        threading.Thread(target=self._watch, name="radixserve-tp-watch", daemon=True).start()

    def forward(self, packed: PackedStep) -> None:
        """Send one step; every rank then runs the same forward as rank 0."""
        header = self._header
        header[0], header[1] = OP_FORWARD, packed.host.numel()
        header[2:] = torch.tensor(packed.header(), dtype=torch.int64)
        dist.broadcast(header, src=0)
        dist.broadcast(packed.host, src=0)

    def copy_page(self, src: int, dst: int) -> None:
        header = self._header
        header.zero_()
        header[0], header[1], header[2] = OP_COPY_PAGE, src, dst
        dist.broadcast(header, src=0)

    def call(self, call: TPCall) -> None:
        """Have ranks 1..N-1 run ``call`` (`radixserve.engine.tp_rank.HANDLERS`), and wait
        until all have; RuntimeError if any failed (its error is in its log)."""
        data = torch.frombuffer(bytearray(encode(call)), dtype=torch.uint8)
        header = self._header
        header.zero_()
        header[0], header[1] = OP_CALL, data.numel()
        dist.broadcast(header, src=0)
        dist.broadcast(data, src=0)
        failed = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(failed)
        if int(failed):
            raise RuntimeError(f"{int(failed)} tensor-parallel rank(s) failed "
                               f"{call.OP!r} (see their log)")  # fmt: skip

    def stop(self) -> None:
        """Tell the ranks to exit, and wait for them (killing any that does not)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            if dist.is_initialized():
                self._header.zero_()  # OP_STOP
                dist.broadcast(self._header, src=0)
        except Exception:  # noqa: BLE001 - a rank is gone already: stop the others anyway
            logger.warning("tensor-parallel ranks could not be told to stop; killing them")
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        self._stopping = True
        for proc in self.procs:
            proc.kill()
            proc.wait()

    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    logger.error("tensor-parallel rank %d (pid %d) exited with code %s: this "
                                 "worker cannot compute without it and exits", rank, proc.pid,
                                 code)  # fmt: skip
                    self._stopping = True
                    for other in self.procs:
                        if other.poll() is None:
                            other.send_signal(signal.SIGKILL)
                    logging.shutdown()
                    os._exit(1)
            time.sleep(0.2)
