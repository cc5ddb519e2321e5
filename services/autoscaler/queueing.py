"""What one more replica takes off a pool's queueing delay: the cost side of a scale-up,
and the delay the prefill pool is sized by.

A pool of c replicas offered L replicas' worth of work (demand / one replica's
capacity), with service times of mean s and squared coefficient of variation cv², is
modelled as the M/G/c queue in the usual approximation: a request waits at all with
Erlang's C probability ``C(c, L)``, and then about exponentially, with mean

    (1 + cv²) / 2 · s / (c − L)

(exact for exponential service, cv² = 1). The policy asks it for the mean wait at c
and c + 1 replicas — when one more replica takes less than a threshold off, it is past
the point where replicas buy latency (diminishing returns) — and for the probability
that a wait exceeds a request's slack (`feasibility.predicted_late_share`).
"""

from __future__ import annotations

import math


def erlang_c(servers: int, load: float) -> float:
    """The probability that a request waits at all: Erlang's C formula for ``servers``
    replicas offered ``load`` (1 at or past their capacity)."""
    if servers <= 0 or load >= servers:
        return 1.0
    if load <= 0:
        return 0.0
    blocked = 1.0  # Erlang B, by its recursion over the servers
    for k in range(1, servers + 1):
        blocked = load * blocked / (k + load * blocked)
    return servers * blocked / (servers - load * (1.0 - blocked))


def _waiting_mean_s(servers: int, load: float, mean_service_s: float, cv2: float) -> float:
    """Mean wait of the requests that wait at all."""
    return (1.0 + cv2) / 2.0 * mean_service_s / (servers - load)


def mean_wait_s(servers: int, load: float, mean_service_s: float, cv2: float) -> float:
    """Mean queueing wait over all requests (inf at or past capacity)."""
    if servers <= 0 or load >= servers:
        return math.inf
    return erlang_c(servers, load) * _waiting_mean_s(servers, load, mean_service_s, cv2)


def wait_survival(servers: int, load: float, mean_service_s: float, cv2: float, t: float) -> float:
    """P(a request waits longer than ``t``)."""
    if t < 0:
        return 1.0
    waits = erlang_c(servers, load)
    if waits >= 1.0 or waits <= 0.0:
        return waits
    return waits * math.exp(-t / _waiting_mean_s(servers, load, mean_service_s, cv2))


def next_replica_gain(delay_s: float, servers: int, load: float) -> float:
    """How much of a measured queueing delay ``delay_s`` one more replica is predicted
    to remove, the model giving only the ratio of the delays at ``servers`` and one
    more (for when the service times are not known)."""
    now = mean_wait_s(servers, load, 1.0, 1.0)
    if math.isinf(now):  # overloaded: the queue grows without bound, all of it is at stake
        return delay_s
    if now <= 0:
        return 0.0
    return delay_s * (1.0 - mean_wait_s(servers + 1, load, 1.0, 1.0) / now)
