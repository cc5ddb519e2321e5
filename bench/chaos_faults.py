"""The chaos benchmark's fault injector: runs the schedule against a live cluster.

Each `PlannedEvent` runs at its time, in order, once it has a target:

- a kill, drain or pause of a worker targets one that is up at the gateway, untouched
  by an earlier event that has not recovered yet, and not the last such worker of its
  role (so the pool always has one worker serving: what a dead worker's requests could
  move to);
- a kill of the kvstore needs it up and untouched;
- a kill of a rank targets a decode worker as a kill of the worker does, and SIGKILLs
  one of its tensor-parallel rank processes (`rank_pids`): the worker exits with it;
- a kill of a peer owner targets a decode worker as a kill does: SIGTERM first (it
  drains and lingers, lending its cached pages to the other workers), then SIGKILL as
  soon as another worker asks it for pages (``peer_read_asks_total`` grows: the read is
  in flight), or once its linger would be over;
- a client drop needs a stream that has sent text.

An event without a target waits (``max_postpone_s`` at most, then it is skipped with
the reason). After the signal a watcher follows the target on the gateway's
``/debug/cache`` (`ClusterMonitor`, polled every 0.25 s): when the gateway first saw it
down, when the old process was gone (a drain: how long it drained), and when it was up
again — under a new generation after a kill or drain (the supervisor restarts whatever
exits, a drained worker too), the same one after a pause. Times are seconds of load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from radixserve.bench.chaos_load import ChatLoad
from radixserve.bench.chaos_schedule import PlannedEvent
from radixserve.bench.local_cluster import supervise
from radixserve.launch.cluster import ClusterProcesses

logger = logging.getLogger(__name__)

_POLL_S = 0.25
_SIGNALS = {"kill-prefill": signal.SIGKILL, "kill-decode": signal.SIGKILL,
            "kill-kvstore": signal.SIGKILL, "drain": signal.SIGTERM, "pause": signal.SIGSTOP,
            "kill-rank": signal.SIGKILL, "kill-peer-owner": signal.SIGTERM}  # fmt: skip
_LINGER_S = 10.0  # a worker's default drain_linger_s: the owner is killed by then


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes (`radixserve.engine.tp_rank`) ``worker_pid``
    started, from /proc (empty where there are none)."""
    pids = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{worker_pid}/task"):
            with open(f"/proc/{worker_pid}/task/{task}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
    ranks = []
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"radixserve.engine.tp_rank" in f.read():
                ranks.append(pid)
    return sorted(ranks)


@dataclass
class EventRecord:
    """What became of one planned event (times in seconds of load)."""

    kind: str
    role: str | None
    planned_s: float
    target: str | None = None  # a process name, or "request N" for a client drop
    at_s: float | None = None  # when it happened; None if skipped
    skipped: str | None = None  # why it did not happen
    down_seen_s: float | None = None  # the gateway first showed the target down
    gone_s: float | None = None  # the old process had exited (kill, drain)
    resumed_s: float | None = None  # SIGCONT (pause)
    back_up_s: float | None = None  # up at the gateway again
    request_id: int | None = None  # the dropped request
    killed_s: float | None = None  # kill-peer-owner: the SIGKILL after the SIGTERM
    peer_asked: bool | None = None  # kill-peer-owner: another worker had asked it for pages
    first_ok_s: float | None = None  # a request started after it completed correctly

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ClusterMonitor:
    """Supervises the cluster (restarts what died) and keeps the gateway's latest
    ``/debug/cache`` in `workers`, from one task on the event loop."""

    def __init__(self, processes: ClusterProcesses, http: httpx.AsyncClient) -> None:
        self.processes = processes
        self.http = http
        self.workers: dict[str, dict[str, Any]] = {}
        self.snapshot: dict[str, Any] = {}

    async def run(self) -> None:
        """Until cancelled."""
        beat = 0
        while True:
            supervise(self.processes)
            if beat % round(_POLL_S / 0.05) == 0:
                await self.refresh()
            beat += 1
            await asyncio.sleep(0.05)

    async def refresh(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await self.http.get("/debug/cache", timeout=5)
            self.snapshot = resp.json()
            self.workers = self.snapshot.get("workers", {})

    def up(self, name: str) -> bool:
        return bool(self.workers.get(name, {}).get("up"))

    def generation(self, name: str) -> int | None:
        return self.workers.get(name, {}).get("generation")

    def pid(self, name: str) -> int | None:
        return self.processes.supervisor.pid(name)

    def names(self, role: str) -> list[str]:
        if role == "kvstore":
            return ["kvstore"]
        return [n for n in self.processes.supervisor.names() if n.startswith(f"{role}-")]


class FaultInjector:
    """Runs a schedule (`run`); `events` records each event, `wait_recovered` waits
    for every watcher."""

    def __init__(
        self,
        monitor: ClusterMonitor,
        load: ChatLoad,
        clock: Callable[[], float],
        *,
        pause_s: float,
        recovery_timeout_s: float,
        max_postpone_s: float,
    ) -> None:
        self.monitor = monitor
        self.load = load
        self.clock = clock
        self.pause_s = pause_s
        self.recovery_timeout_s = recovery_timeout_s
        self.max_postpone_s = max_postpone_s
        self.events: list[EventRecord] = []
        self._disturbed: set[str] = set()
        self._paused: set[int] = set()
        self._watchers: set[asyncio.Task] = set()

    async def run(self, schedule: list[PlannedEvent], until_s: float) -> None:
        for planned in schedule:
            record = EventRecord(planned.kind, planned.role, planned.at_s)
            self.events.append(record)
            await asyncio.sleep(max(0.0, planned.at_s - self.clock()))
            deadline = min(planned.at_s + self.max_postpone_s, until_s)
            while record.at_s is None and self.clock() < deadline:
                if not await self._try(planned, record):
                    await asyncio.sleep(_POLL_S)
            if record.at_s is None:
                record.skipped = record.skipped or "no target in time"
                logger.warning("chaos: %s skipped (%s)", planned.kind, record.skipped)

    async def wait_recovered(self, timeout_s: float) -> None:
        """Wait for every watcher (each bounded by ``recovery_timeout_s``)."""
        if self._watchers:
            await asyncio.wait(set(self._watchers), timeout=timeout_s)

    def resume_all(self) -> None:
        """SIGCONT whatever is still paused (a run cut short)."""
        for pid in list(self._paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._paused.clear()

    # -- one event -------------------------------------------------------------------

    async def _try(self, planned: PlannedEvent, record: EventRecord) -> bool:
        """Apply ``planned`` if it has a target now; whether it was applied."""
        if planned.kind == "client-drop":
            return await self._drop(planned, record)
        assert planned.role is not None
        target = self._target(planned)
        pid = self.monitor.pid(target) if target else None
        if target is None or pid is None:
            record.skipped = f"no {planned.role} to take down (keeping one serving)"
            return False
        victim = pid
        if planned.kind == "kill-rank":
            ranks = rank_pids(pid)
            if not ranks:
                record.skipped = f"{target} has no tensor-parallel rank to kill"
                return False
            victim = ranks[min(int(planned.pick * len(ranks)), len(ranks) - 1)]
        record.target, record.skipped = target, None
        generation = self.monitor.generation(target)
        self._disturbed.add(target)
        sig = _SIGNALS[planned.kind]
        os.kill(victim, sig)
        record.at_s = self.clock()
        if sig == signal.SIGSTOP:
            self._paused.add(pid)
        logger.warning("chaos: %s of %s (pid %d) at %.1f s", planned.kind, target, victim,
                       record.at_s)  # fmt: skip
        watch = self._watch_pause(record, pid) if sig == signal.SIGSTOP else None
        if planned.kind == "kill-peer-owner":
            watch = self._kill_peer_owner(record, pid, generation)
        watch = watch or self._watch_restart(record, pid, generation)
        task = asyncio.ensure_future(self._bounded(watch, record))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return True

    def _target(self, planned: PlannedEvent) -> str | None:
        assert planned.role is not None
        m = self.monitor
        serving = [n for n in m.names(planned.role) if m.up(n) and n not in self._disturbed]
        if planned.role != "kvstore" and len(serving) < 2:
            return None
        return planned.choose(serving) if serving else None

    async def _drop(self, planned: PlannedEvent, record: EventRecord) -> bool:
        streams = self.load.streams_with_text()
        if not streams:
            record.skipped = "no stream with text to drop"
            return False
        by_id = {str(r.request_id): r for r in streams}
        victim = by_id[planned.choose(list(by_id))]
        victim.drop.set()
        at = self.clock()
        while victim.outcome is None:
            await asyncio.sleep(0.05)
        if victim.outcome != "dropped":  # it ended before its next event: try another
            record.skipped = "the stream ended before the drop"
            return False
        record.at_s, record.skipped = at, None
        record.target, record.request_id = f"request {victim.request_id}", victim.request_id
        logger.warning("chaos: client-drop of request %d at %.1f s", victim.request_id, at)
        return True

    async def _bounded(self, watch: Any, record: EventRecord) -> None:
        try:
            await asyncio.wait_for(watch, self.recovery_timeout_s)
        except TimeoutError:
            logger.warning("chaos: %s not back within %g s", record.target,
                           self.recovery_timeout_s)  # fmt: skip
        finally:
            if record.target is not None:
                self._disturbed.discard(record.target)

    async def _watch_restart(self, record: EventRecord, pid: int, generation: int | None) -> None:
        assert record.target is not None and record.at_s is not None
        name, m = record.target, self.monitor
        while record.back_up_s is None:
            now = self.clock() - record.at_s
            if record.down_seen_s is None and not m.up(name):
                record.down_seen_s = now
            if record.gone_s is None and m.pid(name) != pid:
                record.gone_s = now
            if record.gone_s is not None and m.up(name) and m.generation(name) != generation:
                record.back_up_s = now
            await asyncio.sleep(_POLL_S / 5)

    async def _kill_peer_owner(self, record: EventRecord, pid: int, generation: int | None) -> None:
        """SIGKILL the draining ``pid`` once another worker asked it for pages (or its
        linger is nearly over), then follow its restart."""
        assert record.target is not None and record.at_s is not None
        m = self.monitor

        def asks() -> int:
            return sum(int(w.get("peer_read_asks_total", 0)) for n, w in m.workers.items()
                       if n != record.target)  # fmt: skip

        before = asks()
        until = self.clock() + _LINGER_S - 1.0
        while self.clock() < until and m.pid(record.target) == pid and asks() == before:
            await asyncio.sleep(_POLL_S / 5)
        record.peer_asked = asks() > before
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        record.killed_s = self.clock() - record.at_s
        await self._watch_restart(record, pid, generation)

    async def _watch_pause(self, record: EventRecord, pid: int) -> None:
        assert record.target is not None and record.at_s is not None
        name, m = record.target, self.monitor
        resume_at = record.at_s + self.pause_s
        while self.clock() < resume_at:
            if record.down_seen_s is None and not m.up(name):
                record.down_seen_s = self.clock() - record.at_s
            await asyncio.sleep(_POLL_S / 5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self._paused.discard(pid)
        record.resumed_s = self.clock() - record.at_s
        await m.refresh()
        while not m.up(name):
            await asyncio.sleep(_POLL_S / 5)
        record.back_up_s = self.clock() - record.at_s
