"""docker-compose.yml's radixserve services as local processes, one loopback address each.

A container here is a process started with its service's ``command`` (after the image's
ENTRYPOINT, ``radixserve``) and exactly its service's environment, interpolated as
compose would with a given ``.env``. Each container gets its own address
``127.<a>.<b>.<n>`` (a random /16 per run), standing in for the container's IP on the
compose network, and that address is the only thing the environment is changed by:

* a listen address of every interface (``0.0.0.0``) becomes the container's address
  (each container has its own network namespace, so all of them can use port 7000);
* ``127.0.0.1``/``localhost`` in a URL is the container itself (the probe URL);
* a compose service name as a URL's host, or as the whole value of a host setting
  (``*_HOST``), becomes the address of that service's first container: what Docker's
  DNS answers;
* a path under a named volume's mount point (the kvstore's disk tier) is under a
  directory of this run standing for the volume.

A worker that sets no advertise host then advertises its listen address: the
container's, as the container's host name resolves to it under compose. The
container's other variables are this machine's (``PATH``, ...), less any
``RADIXSERVE_*`` or ``UCX_*`` of the test's own, plus ``OMP_NUM_THREADS=1`` (OpenMP
would otherwise start a thread per core in each process on a shared test machine).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.transfer.network import WILDCARD_HOSTS
from tests.deploy.deploy_files import COMPOSE, dockerfile_commands

ADDRESS_OFFSET = {"kvstore": 2, "gateway": 3, "autoscaler": 4, "prefill": 10, "decode": 30}


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of GET ``url``; status 0 if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


@dataclass
class Container:
    service: str
    address: str
    env: dict[str, str]
    process: subprocess.Popen
    log: Path

    @property
    def name(self) -> str:
        return f"{self.service}@{self.address}"

    def get(self, port: int, path: str) -> tuple[int, Any]:
        status, body = http_get(f"http://{self.address}:{port}{path}")
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class ComposeRun:
    """Starts containers of the compose ``services`` (interpolated) on demand."""

    services: dict[str, dict[str, Any]]
    logs: Path
    network: str = field(
        default_factory=lambda: f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
    )
    containers: list[Container] = field(default_factory=list)
    generation: int = 0  # how many times the run was taken down (`down`)

    def __post_init__(self) -> None:
        self.entrypoint = dockerfile_commands(COMPOSE / "Dockerfile")["ENTRYPOINT"]
        assert self.entrypoint == ["radixserve"]
        self.program = str(Path(sys.executable).with_name("radixserve"))

    def dns(self, service: str) -> str:
        """The address a service name resolves to (its first container's)."""
        return f"{self.network}.{ADDRESS_OFFSET[service]}"

    def container_env(self, service: str, address: str) -> dict[str, str]:
        names = "|".join(map(re.escape, self.services))
        in_url = re.compile(rf"(?<=//)({names}|127\.0\.0\.1|localhost)(?=[:/])")

        def resolve(m: re.Match[str]) -> str:
            host = m.group(1)
            return address if host in ("127.0.0.1", "localhost") else self.dns(host)

        env = {k: v for k, v in os.environ.items() if not k.startswith(("RADIXSERVE_", "UCX_"))}
        env["OMP_NUM_THREADS"] = "1"
        mounts = self.volumes(service)
        for key, value in self.services[service]["environment"].items():
            mount = next((m for m in mounts if value == m or value.startswith(m + "/")), None)
            if mount is not None:
                value = mounts[mount] + value[len(mount) :]
            elif value in WILDCARD_HOSTS:
                value = address
            elif key.endswith("_HOST") and value in self.services:
                value = self.dns(value)
            else:
                value = in_url.sub(resolve, value)
            env[key] = value
        return env

    def volumes(self, service: str) -> dict[str, str]:
        """Mount point -> the directory of this run standing for each named volume."""
        mounts = {}
        for spec in self.services[service].get("volumes", []):
            volume, _, rest = spec.partition(":")
            if not volume.startswith((".", "/")):
                stand_in = self.logs / "volumes" / volume
                stand_in.mkdir(parents=True, exist_ok=True)
                mounts[rest.split(":")[0]] = str(stand_in)
        return mounts

    def start(self, service: str, env_override: dict[str, str] | None = None) -> Container:
        """One more container of ``service`` (as ``docker compose up --scale`` adds),
        its environment changed by ``env_override``."""
        replicas = sum(c.service == service for c in self.containers)
        address = f"{self.network}.{ADDRESS_OFFSET[service] + replicas}"
        env = {**self.container_env(service, address), **(env_override or {})}
        argv = [self.program, *self.services[service]["command"]]
        log = self.logs / f"{service}-{replicas}.{self.generation}.log"
        with log.open("w") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        container = Container(service, address, env, process, log)
        self.containers.append(container)
        return container

    def wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``condition`` until true; fail (with the logs of any container that
        exited) if it is not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            dead = [c for c in self.containers if c.process.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(f"--- {c.name} (exit {c.process.poll()}):\n{c.log_tail()}"
                                  for c in (dead or self.containers))  # fmt: skip
                raise AssertionError(
                    f"waiting for {what}: {'a container died' if dead else 'timed out'}\n{tails}"
                )
            time.sleep(0.2)

    def down(self, grace_s: float = 45) -> None:
        """``docker-compose down``: SIGTERM to every container, a kill after ``grace_s``
        (the kvstore's stop_grace_period); the named volumes' directories are kept, and
        the next ``start`` of a service gets its first address again."""
        self.stop(signal.SIGTERM, grace_s)
        self.containers.clear()
        self.generation += 1

    def stop(self, sig: signal.Signals = signal.SIGINT, grace_s: float = 20) -> None:
        """Stop every container at once (``sig``), then kill what is left."""
        for c in self.containers:
            if c.process.poll() is None:
                c.process.send_signal(sig)
        deadline = time.monotonic() + grace_s
        for c in self.containers:
            try:
                c.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.process.kill()
                c.process.wait(10)
