"""What every service process shares (installed as ``radixserve.services.runtime``).

`service` is a process's control plane (ROUTER socket, peers, heartbeats, request
tasks, drain), `links` the outgoing links to other services, `membership` how services
find each other at run time, `worker` the engine-and-transfer-agent base of the prefill
and decode workers, `host_tier` a worker's side of the kvstore's host-memory tier, and
`prefill_router` the one prefill-routing cost used by the gateway and decode workers.
"""
