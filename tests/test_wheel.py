"""The wheel users install, tested as installed: every package of the checkout is in it
under its installed name, and a non-editable install of it serves a request.

The editable install the other tests run from maps whole folders, so a package left out
of the packaging config goes unnoticed there; a wheel (``pip install .``, the Docker
image) then fails with ``ModuleNotFoundError`` at start-up. The wheel is built from a
copy of what the image's build context holds (``.dockerignore``), with the venv's own
setuptools (``--no-build-isolation``: no index needed), and installed with ``--no-deps``
into a fresh venv that sees the checkout venv's site-packages as a plain path line in a
``.pth`` file: its dependencies import, while its editable-install finder (a ``.pth``
there too) is not run, so radixserve can only come from the wheel.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGE_ROOTS = {
    "radixserve": "radixserve",
    "kernels": "radixserve.kernels",
    "services": "radixserve.services",
    "bench": "radixserve.bench",
}
DATA_FILES = [
    "radixserve/bench/data/README.md",
    "radixserve/bench/data/alice-in-wonderland-ch1-2.txt",
    "radixserve/kernels/cpu/qgemm.c",  # the native CPU kernels' sources, built on first use
    "radixserve/kernels/cpu/attention.c",
    # the gateway's /explorer page
    "radixserve/services/gateway/static/explorer.html",
    "radixserve/services/gateway/static/explorer.css",
    "radixserve/services/gateway/static/explorer.js",
]
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "results")


def _source_packages() -> dict[str, Path]:
    """Installed name -> folder, for every folder with an __init__.py in the checkout."""
    found: dict[str, Path] = {}
    for folder, name in PACKAGE_ROOTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            if "tests" in rel.parts or "__pycache__" in rel.parts:
                continue
            found[".".join((name, *rel.parts))] = init.parent
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the checkout, built from a copy of the image's build context."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in PACKAGE_ROOTS:
        shutil.copytree(ROOT / folder, src / folder, ignore=_IGNORE)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "-q", "-w", str(tmp / "dist"), str(src)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("radixserve-*.whl")
    return built


def test_wheel_holds_every_package_and_its_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = _source_packages()
    assert "radixserve.kernels.cpu" in packages  # the one the hand-written list left out
    missing: list[str] = []
    for name, folder in packages.items():
        base = name.replace(".", "/")
        missing += [f"{base}/{py.name}" for py in folder.glob("*.py")
                    if f"{base}/{py.name}" not in names]  # fmt: skip
    assert not missing, f"modules missing from {wheel.name}: {missing}"
    assert not [f for f in DATA_FILES if f not in names]
    assert not any(n.split("/")[0] in PACKAGE_ROOTS.keys() - {"radixserve"} for n in names)


@pytest.fixture(scope="module")
def installed(wheel: Path) -> Path:
    """A fresh venv with the wheel installed (no deps); returns its bin/ folder."""
    venv = wheel.parent.parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
           "--disable-pip-version-check", "-q", str(wheel)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    (Path(site) / "checkout-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv / "bin"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "RADIXSERVE_LOAD_PROGRESS": "false", "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.1"}


def test_installed_wheel_is_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    code = (
        "import radixserve, radixserve.kernels.cpu, radixserve.services.gateway\n"
        "import radixserve.bench.perplexity as bench\n"
        "print(radixserve.__file__, bench.__file__)"
    )
    proc = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert Path(line).is_relative_to(installed.parent), line
        assert not Path(line).is_relative_to(ROOT), line


def _descendants(pid: int) -> list[int]:
    """Pids below ``pid`` in the process tree (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                continue
    found: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


@dataclass
class Up:
    """A running `radixserve up`: its URL, process, log file and the pids seen below it."""

    url: str
    proc: subprocess.Popen[str]
    log: Path
    pids: set[int] = field(default_factory=set)


@pytest.fixture
def up(installed: Path, tmp_path: Path) -> Iterator[Up]:
    """`radixserve up` from the installed wheel, cwd outside the checkout. Every process
    it started is killed at the end, whatever happened."""
    log = tmp_path / "up.log"  # --port 0: the port bound is printed (`_wait_healthy`)
    cmd = [str(installed / "radixserve"), "up", "--port", "0", "--transport", "zmq",
           "--host-tier-gib", "0.1", "--kv-cache-gib", "0.1"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    cluster = Up("", proc, log)
    try:
        yield cluster
    finally:
        cluster.pids.update(_descendants(proc.pid))
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in cluster.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_healthy(cluster: Up, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and cluster.proc.poll() is None:
        cluster.pids.update(_descendants(cluster.proc.pid))
        if not cluster.url and "OpenAI API at " in (text := cluster.log.read_text()):
            cluster.url = text.split("OpenAI API at ", 1)[1].split("/v1", 1)[0]
        try:
            if cluster.url and httpx.get(f"{cluster.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"no healthy cluster (exit {cluster.proc.poll()}):\n{cluster.log.read_text()}")


@pytest.mark.slow
def test_installed_wheel_serves_then_stops(up: Up) -> None:
    _wait_healthy(up, timeout_s=90)
    children = _descendants(up.proc.pid)  # kvstore, prefill, decode, gateway
    up.pids.update(children)
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    resp = httpx.post(f"{up.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 130, up.log.read_text()
    assert "cluster stopped" in up.log.read_text()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
