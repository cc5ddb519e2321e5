"""The flooding tenant of `radixserve bench --scenario abuse`: each abuse a function (or a
thread) that records what the gateway answered.

Most of them talk raw HTTP/1.1 over a socket, because what they do is what a well-made
HTTP client never does: stop reading a stream (with a small receive buffer, so the
gateway's send buffer fills fast), hang up in the middle of a non-streamed answer, send
a body or a request head a byte at a time. The others (a 256-prompt completion, a 3 MiB
JSON schema, a retry loop that ignores ``Retry-After``) are ordinary requests.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.engine.sampling_params import MAX_LOGPROBS

#: the receive buffer of a stream that is never read (Linux doubles it and keeps a floor)
SMALL_RCVBUF_BYTES = 4096


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _head(method: str, path: str, key: str, length: int) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()  # fmt: skip


def _status(data: bytes) -> int | None:
    """The status code of a response that starts ``data`` (None: no status line yet)."""
    line = data.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") else None


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, str]:
    """Everything the peer still sends, and how the connection ended: ``closed`` (EOF),
    ``reset`` (the peer aborted it) or ``open`` (still open after ``timeout_s``)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, "reset"
    except TimeoutError:
        return data, "open"
    return data, "closed"


def chat_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}  # fmt: skip


@dataclass
class UnreadStream:
    """A streamed chat completion whose client reads the response head and then nothing:
    ``n`` choices, every token with its top-20 log-probabilities (about 1.5 KB an event),
    megabytes in all, more than the socket buffers hold."""

    url: str
    key: str
    n: int  # choices: each token of each is an event
    max_tokens: int
    status: int | None = None
    sock: socket.socket | None = None

    def open(self) -> None:
        body = json.dumps(chat_body("Write a very long story.", self.max_tokens, stream=True,
                                    n=self.n, temperature=1.0, logprobs=True,
                                    top_logprobs=MAX_LOGPROBS)).encode()  # fmt: skip
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF_BYTES)  # before connect
        sock.connect(_address(self.url))
        sock.sendall(_head("POST", "/v1/chat/completions", self.key, len(body)) + body)
        sock.settimeout(120)
        self.status = _status(sock.recv(256))  # the head; then never read again
        self.sock = sock

    def end(self, timeout_s: float) -> str:
        """How the stream ended: ``cut`` (the connection ended mid-stream: the gateway cut
        it), ``finished`` (the whole stream was sent), ``refused`` (not a 200) or ``open``."""
        assert self.sock is not None
        data, how = _read_until_closed(self.sock, timeout_s)
        self.sock.close()
        if self.status != 200:
            return "refused"
        if b"data: [DONE]" in data:
            return "finished"
        return "open" if how == "open" else "cut"  # ended (reset or closed) mid-stream


def disconnect_mid_answer(url: str, key: str, after_s: float) -> dict[str, Any]:
    """A non-streamed completion of many tokens whose client hangs up after ``after_s``."""
    body = json.dumps(chat_body("Count to ten thousand.", 2048)).encode()
    with socket.create_connection(_address(url)) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", key, len(body)) + body)
        sock.settimeout(after_s)
        try:
            early = sock.recv(256)  # nothing: the answer is not ready
        except TimeoutError:
            early = b""
    return {"answered_before_hang_up": _status(early), "hung_up_after_s": after_s}


def big_schema(client: httpx.Client, size_bytes: int) -> dict[str, Any]:
    """A chat completion whose JSON schema is ``size_bytes`` long."""
    filler = "x" * 1000
    count = size_bytes // (len(filler) + 40)
    props = {f"field_{i}": {"type": "string", "description": filler} for i in range(count)}
    schema = {"type": "object", "properties": props}
    body = chat_body("Fill the form.", 16, response_format={
        "type": "json_schema", "json_schema": {"name": "form", "schema": schema}})  # fmt: skip
    sent = len(json.dumps(schema).encode())
    resp = client.post("/v1/chat/completions", json=body)
    return {"schema_bytes": sent, "status": resp.status_code, "message": _message(resp)}


def big_batch(client: httpx.Client, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    """A completion of ``num_prompts`` prompts, each generating ``max_tokens`` (EOS ignored)."""
    body = {"model": "default", "prompt": [f"Story number {i}:" for i in range(num_prompts)],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
    resp = client.post("/v1/completions", json=body)
    return {"prompts": num_prompts, "status": resp.status_code, "message": _message(resp)}


def slow_body(url: str, key: str, byte_every_s: float, limit_s: float) -> dict[str, Any]:
    """A request whose body arrives a byte every ``byte_every_s``: the status the gateway
    answers and when, or None if it had not within ``limit_s``."""
    body = json.dumps(chat_body("Hello.", 8)).encode()
    start = time.monotonic()
    with socket.create_connection(_address(url)) as sock:
        sock.sendall(_head("POST", "/v1/chat/completions", key, len(body)))
        sock.settimeout(byte_every_s)
        for i in range(len(body)):
            if time.monotonic() - start > limit_s:
                break
            try:
                data = sock.recv(4096)
            except TimeoutError:
                data = None
            if data is not None:  # an answer (or the close) came
                return {"status": _status(data), "after_s": time.monotonic() - start}
            try:
                sock.sendall(body[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
        data, _ = _read_until_closed(sock, 1.0)
    return {"status": _status(data), "after_s": time.monotonic() - start}


def slow_head(url: str, byte_every_s: float, limit_s: float) -> dict[str, Any]:
    """A request head sent a byte every ``byte_every_s``: whether (and when) the gateway
    closed the connection."""
    head = _head("POST", "/v1/chat/completions", "x" * 32, 2)
    start = time.monotonic()
    with socket.create_connection(_address(url)) as sock:
        for i in range(len(head)):
            if time.monotonic() - start > limit_s:
                break
            try:
                sock.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return {"closed": True, "after_s": time.monotonic() - start}
            time.sleep(byte_every_s)
        _, how = _read_until_closed(sock, 0.5)
    return {"closed": how != "open", "after_s": time.monotonic() - start}


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


@dataclass
class RetryLoop:
    """``workers`` threads sending short completions as fast as they are answered (a
    refusal's ``Retry-After`` ignored; ``pause_s`` after one, so the client does not spin),
    until `stop`. Counts answers by status and keeps one message per refusal reason."""

    url: str
    key: str
    workers: int
    max_tokens: int
    pause_s: float = 0.1
    statuses: dict[int, int] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)  # first words → a whole message
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for i in range(self.workers):
            thread = threading.Thread(target=self._run, name=f"flood-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        body = {"model": "default", "prompt": "Tell me everything.", "max_tokens": self.max_tokens,
                "ignore_eos": True}  # fmt: skip
        with httpx.Client(base_url=self.url, headers=headers, timeout=300) as client:
            while not self._stop.is_set():
                resp = client.post("/v1/completions", json=body)
                with self._lock:
                    self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
                    if resp.status_code != 200:
                        message = _message(resp)
                        self.messages.setdefault(" ".join(message.split()[:6]), message)
                if resp.status_code != 200:
                    self._stop.wait(self.pause_s)
