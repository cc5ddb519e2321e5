"""A generation request's deadline: the ``timeout`` body field or the X-Request-Timeout
header, in seconds from the request's arrival, at most ``max_request_timeout_s``.

Past it the request is aborted wherever it is (queued, in prefill, generating) and the
client gets a 408 OpenAI error naming the field that set it (a stream: that error as
its last event, then ``[DONE]``). With both given, the sooner one holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from fastapi import Request

from radixserve.services.gateway.server.errors import OpenAIError

HEADER = "X-Request-Timeout"


@dataclass(frozen=True)
class Deadline:
    seconds: float  # as the client gave it
    source: str  # "timeout" (the body field) or HEADER
    at: float  # time.monotonic() when it passes

    def remaining_s(self) -> float:
        return self.at - time.monotonic()

    def error(self) -> OpenAIError:
        return OpenAIError(408, f"the request's deadline passed ({self.source} = "
                           f"{self.seconds:g} s); it was aborted", self.source)  # fmt: skip


def _checked(value: float, name: str, limit: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise OpenAIError(400, f"{name} must be a number of seconds > 0, got {value!r}", name)
    if value > limit:
        raise OpenAIError(400, f"{name} = {value:g} s is over the longest deadline a request "
                          f"may set, max_request_timeout_s = {limit:g} s", name)  # fmt: skip
    return value


def request_deadline(
    request: Request, body_timeout: float | None, limit: float, arrived: float
) -> Deadline | None:
    """The request's deadline, counted from ``arrived`` (`time.monotonic()`); None if it
    sets none. A bad value, or one over ``limit``, is a 400 naming its field."""
    given: list[tuple[float, str]] = []
    if body_timeout is not None:
        given.append((_checked(body_timeout, "timeout", limit), "timeout"))
    raw = request.headers.get(HEADER)
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            raise OpenAIError(400, f"{HEADER} must be a number of seconds > 0, got "
                              f"{raw[:64]!r}", HEADER) from None  # fmt: skip
        given.append((_checked(seconds, HEADER, limit), HEADER))
    if not given:
        return None
    seconds, source = min(given)
    return Deadline(seconds, source, arrived + seconds)
