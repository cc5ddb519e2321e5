"""The `radixserve` command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "radixserve.cli"]
ENV = {**os.environ, "RADIXSERVE_LOAD_PROGRESS": "false", "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1"}


def _run(*args: str, stdin: str | None = None, timeout: float = 180):
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_generate_json():
    proc = _run("generate", "--json", "--max-tokens", "8", "--chat", "What is 2 + 2?")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert set(record) >= {"text", "token_ids", "prompt_tokens", "cached_tokens", "ttft_ms"}
    assert 1 <= len(record["token_ids"]) <= 8 and record["text"]
    assert record["prompt_tokens"] > 10 and record["cached_tokens"] == 0 and record["ttft_ms"] > 0


def test_generate_plain_text_streams_completion():
    proc = _run("generate", "--max-tokens", "6", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model.gguf", "hi"], "/nonexistent/model.gguf"),
        (["--max-tokens", "0", "hi"], "max_tokens"),
        (["--page-size", "0", "hi"], "page_size"),
        ([""], "empty"),
    ],
)
def test_generate_bad_input_gives_clear_error(args, message):
    proc = _run("generate", *args)
    assert proc.returncode in (1, 2)
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_chat_reuses_previous_turn():
    proc = _run(
        "chat", "--max-tokens", "12", stdin="Hello! Who are you?\nWhat did I just ask?\n/exit\n"
    )
    assert proc.returncode == 0, proc.stderr
    stats = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 2
    assert " 0 cached" in stats[0] and " 0 cached" not in stats[1]
