"""The core board: workers on the same cores share them by who computes right now.

Other workers are real processes holding slots on the same file (the board's slot
locks and busy marks are per process)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from radixserve.engine.cores import CoreBoard
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import make_engine
from tests.model.tiny_checkpoints import write_tiny_checkpoint

# another worker: takes a slot, then obeys "busy" / "idle" / "exit" lines on stdin
OTHER = """
import sys
from radixserve.engine.cores import CoreBoard
board = CoreBoard(sys.argv[1], 2)
print(board.slot, flush=True)
for line in sys.stdin:
    if line.strip() == "busy":
        board.acquire(float(sys.argv[2]))
    elif line.strip() == "idle":
        board.release()
    else:
        break
    print("ok", flush=True)
"""


class Other:
    def __init__(self, path, hold_s: float = 0.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OTHER, str(path), str(hold_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.slot = int(self.proc.stdout.readline())

    def say(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def board(tmp_path):
    others: list[Other] = []
    mine = CoreBoard(str(tmp_path / "cores"), 4)
    yield mine, others, tmp_path / "cores"
    mine.close()
    for other in others:
        other.kill()


def test_the_share_follows_the_workers_busy_now(board):
    mine, others, path = board
    assert mine.acquire() == 4  # alone: every thread
    others.append(Other(path))
    others.append(Other(path))
    assert len({mine.slot, others[0].slot, others[1].slot}) == 3
    assert mine.acquire() == 4  # the others are idle
    others[0].say("busy")
    assert mine.busy_workers() == 2
    assert mine.acquire() == 2
    others[1].say("busy")
    assert mine.acquire() == 1  # 4 // 3
    others[0].say("idle")
    others[1].say("idle")
    assert mine.acquire() == 4
    mine.release()
    assert mine.busy_workers() == 0


def test_a_dead_worker_stops_counting_and_its_slot_is_taken_again(board):
    mine, others, path = board
    others.append(Other(path, hold_s=0.3))  # a busy mark of HOLD_S, 2 s
    others[0].say("busy")
    slot = others[0].slot
    assert mine.acquire() == 2
    others[0].kill()  # died mid-step: its mark stays until it expires
    deadline = time.monotonic() + 10
    while mine.acquire() != 4:
        assert time.monotonic() < deadline, "a dead worker's busy mark never expired"
        time.sleep(0.1)
    others.append(Other(path))
    assert others[1].slot == slot  # the kernel dropped the dead one's lock


def test_an_engine_steps_on_its_share_of_the_cores(tmp_path):
    """A CPU engine on a board sets torch's threads each step from the workers busy;
    its outputs do not depend on them."""
    path = tmp_path / "cores"
    model = str(write_tiny_checkpoint(tmp_path, arch="llama"))
    before = torch.get_num_threads()
    engine = make_engine(model, core_board=str(path), num_threads=2)
    other = Other(path)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        runs, threads = [], []
        for busy in (False, True, False):
            other.say("busy" if busy else "idle")
            rid = engine.add_request(list(range(3, 40)), params)
            seen: set[int] = set()
            tokens: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    assert out.request_id == rid
                    tokens += out.new_token_ids
                seen.add(torch.get_num_threads())
                assert engine.step_stats.cpu_threads == torch.get_num_threads()
            runs.append(tokens)
            threads.append(seen)
            assert engine.cores.busy_workers() == (1 if busy else 0)  # released when done
        assert threads == [{2}, {1}, {2}]
        assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 6
    finally:
        other.kill()
        engine.cores.close()
        torch.set_num_threads(before)


def test_an_engine_loads_its_weights_on_its_share_of_the_cores(tmp_path):
    """Loading is computing too: beside a busy worker an engine loads on its share (two
    workers loading at once on all the cores each were several times slower), and once
    loaded it is not marked busy."""
    path = tmp_path / "cores"
    model = str(write_tiny_checkpoint(tmp_path, arch="llama"))
    before = torch.get_num_threads()
    other = Other(path, hold_s=60.0)
    engine = None
    try:
        other.say("busy")
        engine = make_engine(model, core_board=str(path), num_threads=2)
        assert engine.step_stats.cpu_threads == 1  # its share while it loaded
        assert engine.cores is not None and engine.cores.busy_workers() == 1  # the other only
    finally:
        other.kill()
        if engine is not None and engine.cores is not None:
            engine.cores.close()
        torch.set_num_threads(before)
