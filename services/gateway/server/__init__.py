"""The gateway's HTTP layer: server limits, errors, bodies and queries, streams, tracing."""
