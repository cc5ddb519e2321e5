"""`OtlpReceiver`: a real OTLP/HTTP endpoint in the test process (a threading HTTP
server on 127.0.0.1) that decodes every JSON export posted to /v1/traces and keeps its
spans with their resource, as a collector would receive them."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpReceiver:
    """Collects exported spans: each a dict of the span's OTLP fields plus
    ``"resource"`` (its resource attributes as a plain dict)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts: list[tuple[str, dict[str, str]]] = []  # (path, headers) of each export
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver._keep(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _keep(self, path: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        """One export: its path, headers (names in lowercase) and spans."""
        with self._lock:
            self.posts.append((path, headers))
            for resource_spans in body["resourceSpans"]:
                resource = {a["key"]: _plain(a["value"])
                            for a in resource_spans["resource"]["attributes"]}  # fmt: skip
                for scope in resource_spans["scopeSpans"]:
                    for span in scope["spans"]:
                        attributes = {a["key"]: _plain(a["value"]) for a in span["attributes"]}
                        self.spans.append({**span, "attributes": attributes, "resource": resource})

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["traceId"] == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[dict]:
        """The spans of ``trace_id`` once every name in ``names`` has arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _plain(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue as a Python value."""
    ((kind, inner),) = value.items()
    return int(inner) if kind == "intValue" else inner
