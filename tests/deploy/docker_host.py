"""A Docker engine for the container tests: whether one runs, which compose, and the
images built as a user builds them where Docker Hub or PyTorch's index cannot be reached.

* `docker_unavailable` — why no Docker engine can be used (None when one answers);
* `compose_command` — ``docker compose`` (v2) when the plugin answers, else Debian's
  ``docker-compose`` (1.29); the compose file is valid for both;
* `build_images` — the base images (Docker Hub's when they can be pulled, else the
  Debian ones ``compose/base/debian-images.sh`` makes), then ``compose/Dockerfile``
  with the build arguments a mirror or an air-gapped build uses: the local PyTorch CPU
  wheel (pip's find-links on this machine, or ``RADIXSERVE_TORCH_WHEEL``) in
  ``compose/local/`` with an empty ``TORCH_INDEX_URL``, and pip's CA bundle.

Every command goes through `sh`, which fails the test with the command's output.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.deploy_files import COMPOSE, ROOT

HUB_BASES = {"python": "python:3.11-slim-bookworm", "build": "python:3.11-bookworm"}
DEBIAN_BASES = {"python": "radixserve-base:bookworm", "build": "radixserve-base:bookworm-build"}
PROMETHEUS_STANDIN = "radixserve-prometheus:debian"
LOCAL = COMPOSE / "local"
# every stage of compose/Dockerfile and Dockerfile.cuda carries it
IMAGE_LABEL = "org.opencontainers.image.title=radixserve"


def sh(cmd: list[str], timeout_s: float = 600, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``cmd``; with ``check``, a non-zero exit fails with its output."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return done


def docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH (Debian: apt-get install docker.io)"
    done = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    if done.returncode != 0:
        return f"no Docker engine answers: {done.stderr.strip()[:300]}"
    return None


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError(
        "neither `docker compose` nor docker-compose (apt-get install docker-compose)"
    )


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def image_size_mb(tag: str) -> float:
    size = sh(["docker", "image", "inspect", "-f", "{{.Size}}", tag]).stdout.strip()
    return int(size) / 1e6


def can_pull(tag: str) -> bool:
    """Whether ``tag`` is here or can be pulled (a closed network answers within 60 s)."""
    if image_exists(tag):
        return True
    try:
        done = subprocess.run(["docker", "pull", tag], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _pip_cert() -> Path | None:
    """The CA bundle pip uses here (a proxy's CA may be in it), if one is configured."""
    name = os.environ.get("PIP_CERT")
    if not name:
        done = subprocess.run(
            ["pip", "config", "get", "global.cert"], capture_output=True, text=True
        )
        name = done.stdout.strip() if done.returncode == 0 else ""
    return Path(name) if name and Path(name).is_file() else None


def _torch_wheel() -> Path | None:
    """A local PyTorch CPU wheel for the image's Python (3.11), if this machine has one."""
    wanted = os.environ.get("RADIXSERVE_TORCH_WHEEL")
    if wanted:
        return Path(wanted)
    links = os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()
    for folder in links:
        found = sorted(glob.glob(f"{folder}/torch-2.13.0+cpu-cp311-*x86_64.whl"))
        if found:
            return Path(found[-1])
    return None


@dataclass
class Images:
    """What `build_images` made, and the figures for the report."""

    bases: dict[str, str]
    build_args: dict[str, str]
    prometheus: str
    figures: dict[str, object] = field(default_factory=dict)


def build_images() -> Images:
    figures: dict[str, object] = {}
    start = time.monotonic()
    if can_pull(HUB_BASES["python"]) and can_pull(HUB_BASES["build"]):
        bases, prometheus = HUB_BASES, "prom/prometheus:v3.2.1"
        figures["bases"] = "Docker Hub"
    else:
        made = sh(["bash", str(COMPOSE / "base" / "debian-images.sh")], timeout_s=1800)
        bases, prometheus = DEBIAN_BASES, PROMETHEUS_STANDIN
        figures["bases"] = "debootstrap (Docker Hub unreachable): " + "; ".join(
            made.stdout.strip().splitlines()
        )
    figures["bases_s"] = round(time.monotonic() - start, 1)
    args = {"PYTHON_IMAGE": bases["python"], "BUILD_IMAGE": bases["build"]}
    LOCAL.mkdir(exist_ok=True)
    wheel = _torch_wheel()
    if wheel is not None:
        if not (LOCAL / wheel.name).exists():
            shutil.copy(wheel, LOCAL / wheel.name)
        args["TORCH_INDEX_URL"] = ""
        figures["torch"] = f"local wheel {wheel.name}"
    cert = _pip_cert()
    if cert is not None:
        shutil.copy(cert, LOCAL / "ca-certificates.crt")
        args["PIP_CERT"] = "/local/ca-certificates.crt"
    return Images(bases=dict(bases), build_args=args, prometheus=prometheus, figures=figures)


def docker_build(dockerfile: str, tag: str, args: dict[str, str], timeout_s: float = 1800) -> float:
    """``docker build`` from the repository root; seconds taken.

    The build stage is tagged too (``<tag>-build``): it is the layer cache of the next
    build, and tagged it is not dangling. What a build supersedes (the last build's
    stage and image, untagged now) is removed, so that repeated runs keep one of each
    rather than a few GB more per run on the CI host's disk.
    """
    cmd = ["docker", "build", "--network", "host", "-f", dockerfile]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    start = time.monotonic()
    env = {"DOCKER_BUILDKIT": "0"}
    sh([*cmd, "--target", "build", "-t", f"{tag}-build", str(ROOT)], timeout_s=timeout_s, env=env)
    sh([*cmd, "-t", tag, str(ROOT)], timeout_s=timeout_s, env=env)
    sh(["docker", "image", "prune", "--force", "--filter", f"label={IMAGE_LABEL}"])
    return round(time.monotonic() - start, 1)


def superseded_images() -> list[str]:
    """Untagged images of this project's Dockerfiles (each carries `IMAGE_LABEL`)."""
    done = sh(["docker", "images", "--quiet", "--filter", "dangling=true",
               "--filter", f"label={IMAGE_LABEL}"])  # fmt: skip
    return done.stdout.split()


def venv_breakdown(tag: str, top: int = 8) -> list[tuple[str, float]]:
    """The largest entries of the image's site-packages, in MB."""
    script = (
        "import os,sys,glob;"
        "d=glob.glob('/opt/radixserve/lib/python3*/site-packages')[0];"
        "s=lambda p:sum(os.path.getsize(os.path.join(r,f)) for r,_,fs in os.walk(p) for f in fs)"
        " if os.path.isdir(p) else os.path.getsize(p);"
        "[print(n, s(os.path.join(d,n))) for n in os.listdir(d)]"
    )
    out = sh(["docker", "run", "--rm", "--entrypoint", "python", tag, "-c", script]).stdout
    sizes = [(n, int(b) / 1e6) for n, b in (line.split() for line in out.splitlines())]
    return sorted(sizes, key=lambda x: -x[1])[:top]
