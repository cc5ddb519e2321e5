"""What tracing costs a cached turn: the gateway benchmark's multi-turn chat through one
cluster, with tracing off, keeping traces in memory (the default), and exporting them
over OTLP to a local sink, measured in one run.

One cluster (a prefill and a decode worker, KV over NIXL, SmolLM2 in float32 as in
`gateway_chat`) whose workers have ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (so they export
the spans of every traced request), and three more gateway processes on its kvstore,
one per mode:

- ``off``: ``RADIXSERVE_GATEWAY_TRACE_BUFFER=0`` and no endpoint: no span anywhere (the
  gateway sends no ``traceparent``, so the workers record nothing either);
- ``buffer``: the default (the gateway keeps the last 512 traces; the workers record,
  carry their spans back and export them);
- ``otlp``: as ``buffer``, and the gateway exports too.

Each mode holds ``rounds`` conversations of its own (a distinct first line, the same
length), sent turn by turn in rotation with the other modes' so machine noise falls on
all three alike. TTFT is the client's (request sent → first content event); the cached
turns are every turn but each conversation's first. Also printed: the calls an untraced
request makes into the tracing code (its only cost against code without tracing), timed
in this process, as a share of the off median.

    .venv/bin/python -m radixserve.bench.tracing_ab [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from radixserve.bench.gateway_chat import QUESTIONS, stream_turn, system_prompt
from radixserve.bench.local_cluster import LocalCluster
from radixserve.launch.cluster import ClusterConfig, base_env, gateway_healthy
from radixserve.launch.listeners import Listener
from radixserve.protocol import decode, encode
from radixserve.protocol.messages import KVReady, TokenChunk
from radixserve.services.gateway.server.trace_store import TraceStore
from radixserve.tracing import NO_SPAN, Span, Tracer
from radixserve.tracing.otlp import SpanConverter

MODES = ("off", "buffer", "otlp")


class _Sink:
    """An OTLP/HTTP endpoint that accepts every export and counts its bytes."""

    def __init__(self) -> None:
        self.posts = self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                sink.bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                sink.posts += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _gateway(config: ClusterConfig, kvstore: str, mode: str, sink: str) -> tuple[Any, str]:
    """A gateway process of ``mode`` on the cluster's kvstore, healthy; (process, url)."""
    listener = Listener()  # bound here, inherited by the gateway: no port handed on
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({k: v for k, v in base_env(config).items() if not k.startswith("OTEL_")})
    env.update(RADIXSERVE_GATEWAY_PORT=str(listener.port), RADIXSERVE_GATEWAY_KVSTORE=kvstore,
               RADIXSERVE_GATEWAY_LISTEN_FD=str(listener.fileno()),
               RADIXSERVE_GATEWAY_TRACE_BUFFER="0" if mode == "off" else "512")  # fmt: skip
    if mode == "otlp":
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink, OTEL_BSP_SCHEDULE_DELAY="1000")
    process = subprocess.Popen([sys.executable, "-m", "radixserve.services.gateway"], env=env,
                               stdout=subprocess.DEVNULL, pass_fds=(listener.fileno(),))  # fmt: skip
    listener.close()  # the gateway's copy is the one that serves
    url = f"http://127.0.0.1:{listener.port}"
    deadline = time.monotonic() + 120
    while not gateway_healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {mode} gateway did not start")
        time.sleep(0.2)
    return process, url


def untraced_calls_ns(repeats: int = 200_000) -> float:
    """Nanoseconds of every tracing call one untraced request makes (gateway and
    workers: the span lookups, no-op children and ends, the empty joins)."""
    tracer = Tracer("decode")
    start = time.perf_counter_ns()
    for _ in range(repeats):
        span = NO_SPAN
        span.set(request_id="r", prompts=1)
        span.child("gateway.queue").end(decode_worker="d")
        span.traceparent()
        span.adopt(())
        remote = tracer.join("")
        for name in ("decode.admission", "decode.remote_prefill", "decode.stream"):
            remote.child(name).end()
        remote.traceparent()
        remote.records()
    return (time.perf_counter_ns() - start) / repeats


def _traced_request(tracers: tuple[Tracer, Tracer, Tracer], store: TraceStore) -> Span:
    """Every span of one disaggregated request, as the three processes make them, with
    the replies that carry the workers' spans encoded and decoded; the gateway's span."""
    gateway, decoder, prefiller = tracers
    root = gateway.start_request("gateway.request", None, **{"http.route": "/v1/chat/completions"})
    root.set(request_id="chatcmpl-0", prompts=1)
    queued = root.child("gateway.queue", start_ns=root.start_ns)
    queued.end(decode_worker="decode-0", prompt_tokens=1500, resumed_tokens=0)
    request = decoder.join(root.traceparent())
    request.child("decode.admission", prompt_tokens=1500).end(route="remote", cached_tokens=1488)
    remote = request.child("decode.remote_prefill", prefill_worker="prefill-0", pages=1)
    on_prefill = prefiller.join(remote.traceparent())
    on_prefill.child("prefill.queue", prompt_tokens=1500).end()
    on_prefill.child("prefill.compute").end(computed_tokens=12, cached_tokens=1488)
    remote.adopt(decode(encode(KVReady("r", (1,), spans=on_prefill.records()))).spans)  # type: ignore[attr-defined]
    remote.child("prefill.transfer", pages=1, bytes=46080).end()
    remote.end()
    request.child("decode.stream").end(completion_tokens=16)
    last = TokenChunk("r", (2,), finished=True, finish_reason="stop", spans=request.records())
    root.adopt(decode(encode(last)).spans)  # type: ignore[attr-defined]
    root.end(None, **{"http.status_code": 200})
    store.put(root)
    return root


def traced_request_ns(repeats: int = 3000) -> tuple[float, float]:
    """Nanoseconds of tracing work one traced disaggregated request adds on its path
    (its spans in the three processes, the spans' share of encoding and decoding its
    replies, the trace store), and of encoding its spans for OTLP export (the SDK's
    http/protobuf encoding, on the exporters' threads, off the path)."""
    tracers = (Tracer("gateway", keep=True, max_spans=1024), Tracer("decode"), Tracer("prefill"))
    store = TraceStore(512)
    start = time.perf_counter_ns()
    for _ in range(repeats):
        root = _traced_request(tracers, store)
    traced = time.perf_counter_ns() - start
    start = time.perf_counter_ns()
    for _ in range(repeats):  # the same replies without spans: not tracing's cost
        decode(encode(KVReady("r", (1,))))
        decode(encode(TokenChunk("r", (2,), finished=True, finish_reason="stop")))
    replies = time.perf_counter_ns() - start
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    convert = SpanConverter({"service.name": "radixserve-decode"})
    start = time.perf_counter_ns()
    for _ in range(repeats):  # what the exporter's thread does with them (http/protobuf)
        encode_spans([convert(s) for s in root.trace.spans]).SerializePartialToString()
    export = time.perf_counter_ns() - start
    return (traced - replies) / repeats, export / repeats


def _paired(values: list[float], baseline: list[float]) -> float:
    return statistics.median(v / b for v, b in zip(values, baseline, strict=True))


def _conversations(rounds: int, system: str) -> dict[str, list[list[dict[str, str]]]]:
    return {mode: [[{"role": "system", "content": f"Conversation {mode}-{r}. {system}"}]
                   for r in range(rounds)] for mode in MODES}  # fmt: skip


def run(quick: bool) -> dict[str, Any]:
    turns, rounds, max_tokens, stores = (3, 2, 8, 6) if quick else (8, 3, 16, 28)
    sink = _Sink()
    config = ClusterConfig(
        port=0,
        num_threads=max(1, (os.cpu_count() or 1) // 2),
        engine_env={
            "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.5",
            "RADIXSERVE_DTYPE": "float32",
            "RADIXSERVE_DEVICE": "cpu",
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "1000",
        },  # fmt: skip
    )
    ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
    with LocalCluster(config) as cluster:
        assert cluster.processes.kvstore is not None
        gateways = {mode: _gateway(config, cluster.processes.kvstore, mode, sink.endpoint)
                    for mode in MODES}  # fmt: skip
        clients = {
            mode: httpx.Client(base_url=url, timeout=600) for mode, (_, url) in gateways.items()
        }
        try:
            for c in clients.values():
                stream_turn(c, [{"role": "user", "content": "Warm-up: say hi."}], 2)
            chats = _conversations(rounds, system_prompt(stores))
            for turn in range(turns):
                for r in range(rounds):
                    order = MODES[(turn + r) % 3 :] + MODES[: (turn + r) % 3]
                    for mode in order:
                        messages = chats[mode][r]
                        messages.append(
                            {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}
                        )
                        row = stream_turn(clients[mode], messages, max_tokens)
                        messages.append({"role": "assistant", "content": row["text"]})
                        if turn:
                            ttfts[mode].append(row["ttft_ms"])
                print(f"  turn {turn + 1}/{turns} done", file=sys.stderr)
            kept = clients["buffer"].get("/debug/traces", params={"limit": 1000}).json()
        finally:
            for c in clients.values():
                c.close()
            for process, _ in gateways.values():
                process.terminate()
                process.wait(30)
    medians = {mode: statistics.median(values) for mode, values in ttfts.items()}
    traced, export = traced_request_ns()
    return {
        "cached_turns_per_mode": len(ttfts["off"]),
        "cached_turn_ttft_ms_median": medians,
        "buffer_over_off": medians["buffer"] / medians["off"],
        "otlp_over_off": medians["otlp"] / medians["off"],
        # the median of each slot's own ratio (the three modes' turns of one turn and
        # round ran back to back): steadier than the ratio of medians on a busy machine
        "buffer_over_off_paired": _paired(ttfts["buffer"], ttfts["off"]),
        "otlp_over_off_paired": _paired(ttfts["otlp"], ttfts["off"]),
        "untraced_calls_ns": untraced_calls_ns(),
        "traced_request_ns": traced,
        "otlp_export_ns_per_request": export,
        "traces_kept_by_buffer_gateway": len(kept["traces"]),
        "otlp_posts": sink.posts,
        "otlp_bytes": sink.bytes,
        "ttft_ms": ttfts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter turns")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    result = run(args.quick)
    m = result["cached_turn_ttft_ms_median"]
    share = result["untraced_calls_ns"] / (m["off"] * 1e6)
    print(f"cached-turn TTFT median over {result['cached_turns_per_mode']} turns per mode:")
    print(f"  off    {m['off']:8.2f} ms")
    print(f"  buffer {m['buffer']:8.2f} ms   buffer/off = {result['buffer_over_off']:.3f} "
          f"(paired {result['buffer_over_off_paired']:.3f})")  # fmt: skip
    print(f"  otlp   {m['otlp']:8.2f} ms   otlp/off   = {result['otlp_over_off']:.3f} "
          f"(paired {result['otlp_over_off_paired']:.3f})")  # fmt: skip
    print(f"untraced request's calls into tracing: {result['untraced_calls_ns']:.0f} ns "
          f"= {share:.2e} of the off median")  # fmt: skip
    print(f"traced request's tracing work on its path: {result['traced_request_ns'] / 1e3:.1f} µs "
          f"= {result['traced_request_ns'] / (m['off'] * 1e6):.2e} of the off median; its "
          f"OTLP protobuf encoding (off the path): {result['otlp_export_ns_per_request'] / 1e3:.1f} µs")  # fmt: skip
    print(f"traces kept (buffer gateway): {result['traces_kept_by_buffer_gateway']}; "
          f"OTLP sink: {result['otlp_posts']} posts, {result['otlp_bytes']} bytes")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
