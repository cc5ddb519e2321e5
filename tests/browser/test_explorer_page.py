"""The explorer page in a real browser (headless Chromium over the DevTools protocol) on
a real cluster (gateway, kvstore, a prefill and a decode worker as processes, every prompt
prefilled remotely) under a multi-turn load, with API keys and prompt text off:

* without a key the page is a 401; with ``?key=`` it loads and updates by itself;
* the radix tree drawn for the decode worker holds the conversations' shared prefix
  with a hit count above 1;
* the requests table shows, for every turn, the cached tokens the API reported;
* a turn's trace timeline (the gateway's in-memory traces) has the prefill worker's
  compute and transfer spans;
* the page's DOM and every JSON it reads hold no word of the prompts.

A screenshot is saved in the test's tmp dir and, with ``RADIXSERVE_BROWSER_ARTIFACTS``
set, in that folder; with ``RADIXSERVE_BROWSER_README=1`` it also replaces the README's
docs/images/explorer.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.browser.chromium import Chromium, chromium_binary
from tests.cluster.cluster_helpers import TestCluster

pytestmark = pytest.mark.browser

KEY = "sk-explorer-browser"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "quokka aubergine zanzibar"  # in every prompt; never on the page
SYSTEM = f"You answer questions about the {SECRET} archipelago, briefly. " * 4
README_SHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "explorer.png"


@pytest.fixture(scope="module")
def explorer_cluster(tiny_model: str) -> Iterator[TestCluster]:
    cluster = TestCluster(
        transport="zmq",
        model=tiny_model,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},  # every prompt prefilled remotely
        gateway={"API_KEYS": json.dumps([{"key": KEY, "role": "admin"}])},
    )
    yield cluster
    cluster.stop()


@pytest.fixture
def browser() -> Iterator[Chromium]:
    binary = chromium_binary()
    assert binary, "no chromium on the PATH: run .ci/browser-up (installs Debian's chromium)"
    chromium = Chromium(binary)
    yield chromium
    chromium.close()


def converse(url: str, name: str, turns: int, out: dict[str, list[dict]]) -> None:
    """One multi-turn conversation over the shared system prompt; each turn's response."""
    messages = [{"role": "system", "content": SYSTEM}]
    replies = out.setdefault(name, [])
    with httpx.Client(base_url=url, timeout=120, headers=AUTH) as http:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{name}: question {turn}?"})
            body = {"model": "default", "messages": messages, "max_tokens": 6,
                    "temperature": 0}  # fmt: skip
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            replies.append(resp.json())
            answer = replies[-1]["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})


def shared_prefix_tokens(url: str) -> int:
    """The system prompt's tokens in the chat template, whole pages only."""
    body = {"messages": [{"role": "system", "content": SYSTEM}], "add_generation_prompt": False}
    count = httpx.post(f"{url}/tokenize", json=body, headers=AUTH).json()["count"]
    return count - count % 16 - 16  # the template may end the system turn differently


def test_the_explorer_shows_the_cache_the_requests_and_a_trace(
    explorer_cluster: TestCluster, browser: Chromium, tmp_path: Path
) -> None:
    url = explorer_cluster.url
    browser.navigate(f"{url}/explorer")
    assert "missing or invalid API key" in browser.evaluate("document.body.innerText")

    replies: dict[str, list[dict]] = {}
    load = [threading.Thread(target=converse, args=(url, f"user{i}", 3, replies))
            for i in range(3)]  # fmt: skip
    for thread in load:
        thread.start()
    browser.navigate(f"{url}/explorer?key={KEY}")  # the page polls while the load runs
    for thread in load:
        thread.join()
    assert all(len(turns) == 3 for turns in replies.values()), replies

    # the workers: the decode worker's pool and hit rate, the kvstore's host tier
    cards = browser.wait_for(
        """(() => {
          const cards = Object.fromEntries([...document.querySelectorAll('#workers .card')]
            .map(c => [c.dataset.role, c.innerText]));
          return cards.decode && cards.decode.includes('hit rate') ? cards : null;
        })()""",
        30.0,
        "the decode worker's card with its hit rate",
    )
    assert "device pages" in cards["decode"] and "device pages" in cards["prefill"]
    assert re.search(r"host pages\s+total \d+", cards["kvstore"]), cards["kvstore"]

    # the tree of the decode worker: the shared system prompt, hit by the later turns
    prefix = shared_prefix_tokens(url)
    shared = browser.wait_for(
        f"""(() => {{
          const nodes = [...document.querySelectorAll('#tree g.node')].filter(
            g => Number(g.dataset.hits) > 1 && Number(g.dataset.prefixTokens) >= {prefix});
          return nodes.length ? nodes.map(g => g.dataset.nodeId) : null;
        }})()""",
        30.0,
        "a tree node over the shared prefix with more than one hit",
    )
    assert browser.evaluate("document.getElementById('tree-worker').value").startswith("decode")

    # the requests table: every turn, with the cached tokens its usage reported
    turns = [reply for conversation in replies.values() for reply in conversation]
    rows = browser.wait_for(
        f"""(() => {{
          const ids = {json.dumps([r["id"] for r in turns])};
          const found = {{}};
          for (const id of ids) {{
            const row = document.querySelector(`#requests tr[data-request-id="${{id}}"]`);
            if (!row) return null;
            found[id] = {{cached: Number(row.querySelector('td.cached').textContent),
                          route: row.querySelector('td.route').textContent}};
          }}
          return found;
        }})()""",
        30.0,
        "every turn in the requests table",
    )
    for reply in turns:
        row, usage = rows[reply["id"]], reply["usage"]
        assert row["cached"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert row["route"].startswith("remote → prefill")
    assert sum(rows[r["id"]]["cached"] for r in turns) > 0

    # a later turn's trace: the prefill worker's compute and the transfer
    later = replies["user0"][2]["id"]
    browser.evaluate(f"""document.querySelector(
        '#requests tr[data-request-id="{later}"] a[data-trace-id]').click()""")
    spans = browser.wait_for(
        """(() => {
          const names = [...document.querySelectorAll('#trace .span')].map(
            s => s.dataset.service + ':' + s.dataset.name);
          return names.some(n => n.endsWith('prefill.transfer')) ? names : null;
        })()""",
        20.0,
        "the trace timeline with the prefill transfer",
    )
    assert "prefill:prefill.compute" in spans and "gateway:gateway.request" in spans, spans

    # clicking the shared node lists requests that used it
    browser.evaluate(f"window.radixserveExplorer.selectNode({shared[0]})")
    used = browser.evaluate("document.getElementById('node-recent').textContent")
    assert any(r["id"] in used for r in turns), used

    # prompt text off: no word of the prompts in the DOM or in any JSON the page reads
    dom = browser.evaluate("document.documentElement.outerHTML")
    api = browser.evaluate(f"""Promise.all(['/debug/explorer/workers',
        '/debug/explorer/tree?worker=' + encodeURIComponent(
            document.getElementById('tree-worker').value),
        '/debug/explorer/requests', '/debug/explorer/autoscaler'].map(
          p => fetch(p, {{headers: {{Authorization: 'Bearer {KEY}'}}}}).then(r => r.text())))""")
    for word in SECRET.split():
        assert word not in dom
        assert all(word not in body for body in api)
    assert browser.evaluate("fetch('/explorer').then(r => r.status)") == 401

    shot = browser.screenshot(tmp_path / "explorer.png")
    if folder := os.environ.get("RADIXSERVE_BROWSER_ARTIFACTS"):
        shutil.copy(shot, Path(folder) / "explorer.png")
    if os.environ.get("RADIXSERVE_BROWSER_README") == "1":
        shutil.copy(shot, README_SHOT)
