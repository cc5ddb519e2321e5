"""`migration.as_first`: a moved request's outputs restate its id and first TTFT; the
first attempt's own outputs pass as they are."""

from __future__ import annotations

from radixserve.engine.outputs import RequestOutput
from radixserve.runtime.routing.migration import as_first


def _out(rid: str, ttft: float | None) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=[7], new_text="x", finished=False,
                         finish_reason=None, prompt_tokens=3, completion_tokens=1,
                         ttft_ms=ttft)  # fmt: skip


def test_the_first_attempts_outputs_pass_unchanged():
    first = _out("r", 12.5)
    later = _out("r", 12.5)
    assert as_first(later, "r", first) is later


def test_a_moved_attempt_takes_the_request_id_and_the_first_ttft():
    first = _out("r", 12.5)
    moved = _out("r~1", 3.0)
    out = as_first(moved, "r", first)
    assert (out.request_id, out.ttft_ms, out.new_token_ids) == ("r", 12.5, [7])
    assert moved.request_id == "r~1"  # a new output, the attempt's untouched
    assert as_first(_out("r", None), "r", first).ttft_ms == 12.5
