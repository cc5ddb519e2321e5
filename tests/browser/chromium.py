"""Headless Chromium driven over the DevTools protocol, for the browser tests.

`Chromium` starts Debian's ``chromium`` (``.ci/browser-up`` installs it) headless with
a throw-away profile, connects to its page target's websocket and offers the few
commands the tests need: navigate, evaluate JavaScript, wait for a condition, click,
capture a PNG. Nothing else is emulated: the page runs its own scripts against the
real gateway.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import websocket

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_binary() -> str | None:
    """The Chromium to drive: ``RADIXSERVE_CHROMIUM``, else ``chromium`` on the PATH."""
    named = os.environ.get("RADIXSERVE_CHROMIUM")
    return named or shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless browser with one page; `close` ends it."""

    def __init__(self, binary: str, width: int = 1400, height: int = 1700) -> None:
        self._profile = tempfile.mkdtemp(prefix="radixserve-chromium-")
        args = [binary, "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
                "about:blank"]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)  # fmt: skip
        browser_ws = self._wait_listening(30.0)
        port = int(browser_ws.split(":")[2].split("/")[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            pages = [t for t in json.load(resp) if t["type"] == "page"]
        self._ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30)
        self._ids = 0
        for domain in ("Page", "Runtime"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip

    def _wait_listening(self, timeout_s: float) -> str:
        assert self.process.stderr is not None
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line and self.process.poll() is not None:
                break
            seen.append(line)
            found = _LISTENING.search(line)
            if found:  # keep reading its log, so that a full pipe never stalls it
                threading.Thread(target=self.process.stderr.read, daemon=True).start()
                return found.group(1)
        self.close()
        raise RuntimeError("chromium did not start: " + "".join(seen[-10:]))

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events in between are skipped)."""
        self._ids += 1
        self._ws.send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == self._ids:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", 30.0, f"{url} to load")

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll ``expression`` until it is truthy; its value. `AssertionError` on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """The whole page as a PNG at ``path``."""
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "_ws", None) is not None:
            self._ws.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self._profile, ignore_errors=True)
