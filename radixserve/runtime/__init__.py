"""What every service process shares: the library the services are built from.

`settings` the settings every service has (each declared once), `service` a process's
control plane (ROUTER socket, peers, heartbeats, request tasks, drain), `network` its
addresses, `links` the outgoing links to other services and the page geometry checked
at their handshake, `calls` request/reply, quiet sends and background tasks over
links, `membership` how services find each other at run time, `worker` the
engine-and-transfer-agent base of the prefill and decode workers, `host_tier` a
worker's side of the kvstore's host-memory tier, `probe` the HTTP health and metrics
side, `settings_check` a service's settings checked without starting it.
"""
