"""The artefacts users run, run for real in Docker: the CPU image, the compose file with
Prometheus, the CUDA image, and the Kubernetes manifests' commands against the image.

Marked ``benchmark`` (minutes of image building): ``make test-docker`` runs this file
on a machine where a Docker engine runs; ``make test`` leaves it out. Each check prints
its figures, and the end of the run prints them all (``-s`` shows them as they come).

1. Build: base images (Docker Hub's, or Debian's by debootstrap where Hub is out of
   reach), then ``compose/Dockerfile`` with a mirror's build arguments; image sizes.
2. One container (``docker run radixserve:cpu``): ``/health`` 200, the HEALTHCHECK
   healthy, a greedy chat answers "Paris".
3. ``docker-compose.yml`` (project ``-p``), Prometheus from Debian standing in for
   prom/prometheus: every service healthy; a chat's second turn reports cached tokens;
   ``--scale prefill=2`` and the gateway routes to the new worker; Prometheus scrapes
   every radixserve service ``up``; every dashboard expression parses and every metric
   it names is in Prometheus; the autoscaler's dry-run decision in its log and metrics;
   ``--scale decode=2`` then ``docker kill`` of the decode container streaming, and the
   streams complete on the other; ``stop`` drains the workers with exit 0.
4. The CUDA image builds (here on the Debian base with the CPU wheel: no GPU and no
   CUDA wheels on this machine) and a worker asked for CUDA refuses by name.
5. Every container command and environment of the Kubernetes overlays runs against the
   built image (``--check-config``: every ``RADIXSERVE_*`` name read, every value
   accepted), and the ports the manifests name are the ports the settings open.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy.deploy_files import (
    COMPOSE,
    OVERLAYS,
    RADIXSERVE_SERVICES,
    component,
    container,
    dashboard_exprs,
    metric_names,
    objects_of,
    pod_env,
    render_overlay,
)
from tests.deploy.docker_host import (
    Images,
    build_images,
    compose_command,
    docker_build,
    docker_unavailable,
    image_exists,
    image_size_mb,
    sh,
    superseded_images,
    venv_breakdown,
)

pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(3600)]

IMAGE = "radixserve:cpu"
CUDA_IMAGE = "radixserve:cuda"
SECRET = "secret-of-the-docker-test-0123456789"
ADMIN_KEY = "admin-key-of-the-docker-test-0123"  # the API and /debug/cache need a key
API_KEYS = json.dumps([{"key": ADMIN_KEY, "role": "admin"}], separators=(",", ":"))
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
FIGURES: dict[str, Any] = {}
QUESTION = "What is the capital of France?"


def report(key: str, value: Any) -> None:
    FIGURES[key] = value
    print(f"\n[docker] {key}: {value}", flush=True)


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> float:
    """Seconds until ``check()`` holds; fails naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            if check():
                return round(time.monotonic() - start, 1)
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def chat(
    client: httpx.Client, messages: list[dict[str, str]], max_tokens: int = 16
) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    built = build_images()
    report("base images", built.figures.pop("bases"))
    report("base images s", built.figures.pop("bases_s"))
    for key, value in built.figures.items():
        report(key, value)
    report("build radixserve:cpu s", docker_build("compose/Dockerfile", IMAGE, built.build_args))
    # a rebuild leaves nothing untagged behind (each used to leave ~4 GB on the disk)
    assert superseded_images() == []
    report("radixserve:cpu MB", round(image_size_mb(IMAGE)))
    report("radixserve:cpu largest site-packages MB",
           ", ".join(f"{n} {mb:.0f}" for n, mb in venv_breakdown(IMAGE)))  # fmt: skip
    yield built
    print("\n[docker] figures:\n" + json.dumps(FIGURES, indent=2), flush=True)


# -- 2. one container ----------------------------------------------------------------------


def health_status(name: str) -> str:
    return sh(["docker", "inspect", "-f", "{{.State.Health.Status}}", name]).stdout.strip()


def test_single_container_serves_the_default_model(images: Images) -> None:
    name = f"radixserve-single-{uuid.uuid4().hex[:8]}"
    # the image's command serves every interface of the container: it refuses to start
    # without API keys, naming the setting
    refused = sh(["docker", "run", "--rm", IMAGE], check=False, timeout_s=120)
    assert refused.returncode != 0 and "RADIXSERVE_GATEWAY_API_KEYS" in refused.stderr, refused
    # "127.0.0.1::8000": docker binds a free host port itself (no port probed and handed on)
    sh(["docker", "run", "-d", "--name", name, "-p", "127.0.0.1::8000",
        "-e", "RADIXSERVE_KV_CACHE_MEMORY_GIB=0.25", "-e", f"RADIXSERVE_GATEWAY_API_KEYS={API_KEYS}",
        IMAGE])  # fmt: skip
    try:
        port = sh(["docker", "port", name, "8000/tcp"]).stdout.split()[0].rsplit(":", 1)[1]
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=AUTH)
        report("single container: /health 200 after s",
               wait_for("/health 200", lambda: client.get("/health").status_code == 200, 300))  # fmt: skip
        answer = chat(client, [{"role": "user", "content": QUESTION}])
        text = answer["choices"][0]["message"]["content"]
        report("single container: answer", text)
        assert "Paris" in text, text
        report("single container: HEALTHCHECK healthy after s",
               wait_for("docker's healthy", lambda: health_status(name) == "healthy", 120))  # fmt: skip
        logs = sh(["docker", "logs", name]).stderr + sh(["docker", "logs", name]).stdout
        assert "restarting" not in logs and "Traceback" not in logs, logs[-3000:]
        # the image has no compiler: the native CPU kernels are the ones its build stage made
        gen = sh(["docker", "run", "--rm", "-e", "RADIXSERVE_LOAD_PROGRESS=false", IMAGE,
                  "generate", "--log-level", "INFO", "--chat", QUESTION, "--max-tokens", "16"])  # fmt: skip
        used = re.search(r"native CPU kernels: .*", gen.stderr)
        report("single container: native kernels", used.group(0) if used else gen.stderr[-500:])
        assert used and "prebuilt" in used.group(0) and "Paris" in gen.stdout, gen
    finally:
        sh(["docker", "rm", "-f", name], check=False)


# -- 3. compose ----------------------------------------------------------------------------


class Compose:
    """``docker-compose.yml`` + the local override under a project name of its own."""

    def __init__(self, folder: Path, images: Images) -> None:
        self.project = f"rxtest{uuid.uuid4().hex[:6]}"
        self.folder = folder
        override = {
            "services": {
                **{s: {"image": IMAGE} for s in RADIXSERVE_SERVICES},
                "prometheus": {"image": images.prometheus},
            }
        }
        (folder / "override.yml").write_text(json.dumps(override))
        (folder / ".env").write_text(
            f"RADIXSERVE_CLUSTER_SECRET={SECRET}\nRADIXSERVE_GATEWAY_API_KEYS={API_KEYS}\n"
            "RADIXSERVE_KV_CACHE_MEMORY_GIB=0.25\nRADIXSERVE_NUM_THREADS=1\n"
            "RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB=0.25\nRADIXSERVE_AUTOSCALER_INTERVAL_S=2\n"
        )
        self.base = [*compose_command(), "-p", self.project, "--project-directory", str(COMPOSE),
                     "--env-file", str(folder / ".env"),
                     "-f", str(COMPOSE / "docker-compose.yml"), "-f", str(folder / "override.yml")]  # fmt: skip

    def __call__(self, *args: str, timeout_s: float = 600) -> str:
        return sh([*self.base, *args], timeout_s=timeout_s).stdout

    def ids(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def down(self) -> None:
        sh([*self.base, "down", "-v", "-t", "5"], timeout_s=300, check=False)


def inspect(cid: str, fmt: str) -> str:
    return sh(["docker", "inspect", "-f", fmt, cid]).stdout.strip()


def metric_value(text: str, name: str) -> float:
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def prom(query: str) -> list[dict[str, Any]]:
    resp = httpx.get("http://127.0.0.1:9090/api/v1/query", params={"query": query}, timeout=30)
    assert resp.status_code == 200, f"{query}: {resp.text}"
    result: list[dict[str, Any]] = resp.json()["data"]["result"]
    return result


@pytest.fixture(scope="module")
def compose(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    for port in (8000, 9090):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(
                    f"127.0.0.1:{port} is taken: compose publishes the gateway and Prometheus there"
                )
    run = Compose(tmp_path_factory.mktemp("compose"), images)
    try:
        yield run
    finally:
        run.down()


def test_compose_cluster(compose: Compose) -> None:
    start = time.monotonic()
    compose("up", "-d", "kvstore", "gateway", "prefill", "decode", "autoscaler", "prometheus")
    services = ("kvstore", "gateway", "prefill", "decode", "autoscaler")

    def all_healthy() -> bool:
        return all(inspect(c, "{{.State.Health.Status}}") == "healthy"
                   for s in services for c in compose.ids(s))  # fmt: skip

    wait_for("every radixserve service healthy", all_healthy, 420, every_s=2)
    report("compose: all healthy after s", round(time.monotonic() - start, 1))
    client = httpx.Client(base_url="http://127.0.0.1:8000", timeout=180, headers=AUTH)

    # a chat and its second turn
    first = [{"role": "system", "content": "You are a geography tutor. " * 12},
             {"role": "user", "content": QUESTION}]  # fmt: skip
    one = chat(client, first)
    text = one["choices"][0]["message"]["content"]
    assert "Paris" in text, text
    second = [*first, {"role": "assistant", "content": text},
              {"role": "user", "content": "And of Italy?"}]  # fmt: skip
    two = chat(client, second)
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    report("compose: second turn cached tokens", f"{cached} of {two['usage']['prompt_tokens']}")
    assert cached >= 16 * (one["usage"]["prompt_tokens"] // 16), two["usage"]

    scale_prefill(compose, client)
    check_prometheus(compose)
    check_autoscaler(compose)
    kill_decode_mid_stream(compose, client)

    workers = [c for s in ("prefill", "decode") for c in compose.ids(s)]
    killed = {c for c in workers if inspect(c, "{{.State.Status}}") != "running"}
    start = time.monotonic()
    compose("stop", timeout_s=300)
    report("compose: stop took s", round(time.monotonic() - start, 1))
    codes = {c[:12]: int(inspect(c, "{{.State.ExitCode}}")) for c in workers if c not in killed}
    report("compose: workers' exit codes after stop", codes)
    assert codes and all(code == 0 for code in codes.values()), codes
    logs = "".join(sh(["docker", "logs", c]).stderr for c in workers if c not in killed)
    assert "drain" in logs.lower(), logs[-2000:]


def debug_workers(client: httpx.Client) -> dict[str, Any]:
    found: dict[str, Any] = client.get("/debug/cache").json()["workers"]
    return found


def long_prompt(i: int) -> str:
    words = " ".join(f"item{i}-{j}" for j in range(60))
    return f"Document {i}: {words}. Summarise document {i} in one line."


def scale_prefill(compose: Compose, client: httpx.Client) -> None:
    [first] = compose.ids("prefill")
    compose("up", "-d", "--no-recreate", "--scale", "prefill=2", "prefill")
    new = [c for c in compose.ids("prefill") if c != first]
    assert len(new) == 1, new
    host = new[0][:12]  # a container's host name; a worker's default name includes it

    def new_prefill_up() -> bool:
        return any(host in name and w["up"] for name, w in debug_workers(client).items()
                   if w["role"] == "prefill")  # fmt: skip

    report("compose: second prefill worker up in the gateway's view after s",
           wait_for("the new prefill worker in /debug/cache", new_prefill_up, 300))  # fmt: skip
    rounds = iter(range(1000))

    def new_worker_served() -> bool:
        # three at once: with the first worker busy, the new one costs less (idle
        # workers tie on cost, and a tie goes to the name)
        i = next(rounds)
        threads = [threading.Thread(target=chat, args=(client, [{"role": "user",
                   "content": long_prompt(3 * i + j)}], 2)) for j in range(3)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return any(host in name and w.get("prefill_requests_total", 0) >= 1
                   for name, w in debug_workers(client).items() if w["role"] == "prefill")  # fmt: skip

    wait_for("a prefill routed to the new worker", new_worker_served, 300, every_s=0.1)
    report("compose: /debug/cache prefill workers",
           {n: {k: w.get(k) for k in ("up", "address", "prefill_requests_total")}
            for n, w in debug_workers(client).items() if w["role"] == "prefill"})  # fmt: skip


def check_prometheus(compose: Compose) -> None:
    def targets() -> list[dict[str, Any]]:
        resp = httpx.get("http://127.0.0.1:9090/api/v1/targets", timeout=30)
        found: list[dict[str, Any]] = resp.json()["data"]["activeTargets"]
        return found

    wanted = {"gateway": 1, "kvstore": 1, "prefill": 2, "decode": 1, "autoscaler": 1}

    def all_up() -> bool:
        up: dict[str, int] = {}
        for t in targets():
            if t["health"] == "up":
                up[t["labels"]["job"]] = up.get(t["labels"]["job"], 0) + 1
        return all(up.get(job, 0) >= n for job, n in wanted.items())

    wait_for("Prometheus scraping every radixserve service", all_up, 180, every_s=2)
    report("compose: Prometheus targets up",
           sorted(f"{t['labels']['job']} {t['scrapeUrl']}" for t in targets() if t["health"] == "up"))  # fmt: skip
    exprs = dashboard_exprs()
    names = sorted(metric_names(exprs))
    for expr in exprs:
        prom(expr.replace("$__rate_interval", "1m"))  # a 400 names the expression
    missing = [n for n in names if not prom(f"count({n})")]
    report("compose: dashboard expressions / metric names checked in Prometheus",
           f"{len(exprs)} / {len(names)}")  # fmt: skip
    assert not missing, f"metrics the dashboard uses that Prometheus has not got: {missing}"


def check_autoscaler(compose: Compose) -> None:
    [cid] = compose.ids("autoscaler")

    decision = re.compile(r"(prefill|decode): \w+ \d+ -> \d+")

    def decided() -> bool:
        return bool(decision.search(sh(["docker", "logs", cid]).stderr))

    wait_for("a dry-run decision in the autoscaler's log", decided, 120)
    line = [x for x in sh(["docker", "logs", cid]).stderr.splitlines() if decision.search(x)][-1]
    report("compose: autoscaler log", line.strip()[:200])
    decisions = prom("radixserve_autoscaler_decisions_total")
    report("compose: autoscaler decisions in Prometheus", len(decisions))
    assert decisions, "radixserve_autoscaler_decisions_total not scraped"


def kill_decode_mid_stream(compose: Compose, client: httpx.Client) -> None:
    [first] = compose.ids("decode")
    compose("up", "-d", "--no-recreate", "--scale", "decode=2", "decode")
    ids = compose.ids("decode")
    assert len(ids) == 2

    def two_decodes() -> bool:
        return sum(1 for w in debug_workers(client).values()
                   if w["role"] == "decode" and w["up"]) == 2  # fmt: skip

    wait_for("two decode workers up", two_decodes, 300)
    results: list[dict[str, Any]] = [{} for _ in range(4)]

    def stream(i: int) -> None:
        body = {"model": "default", "stream": True, "max_tokens": 96, "temperature": 0,
                "messages": [{"role": "user", "content": f"[{i}] Tell a long story about a ship."}]}  # fmt: skip
        text, finish, errors = [], None, []
        with httpx.stream("POST", "http://127.0.0.1:8000/v1/chat/completions", json=body,
                          headers=AUTH, timeout=300) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                choice = event["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
                results[i]["tokens"] = len(text)
        results[i].update(text="".join(text), finish=finish, errors=errors)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    def victim() -> str | None:
        if not all(r.get("tokens", 0) >= 2 for r in results):
            return None
        for name, w in debug_workers(client).items():
            if w["role"] == "decode" and w.get("gateway_in_flight", 0) > 0:
                return next((c for c in ids if c[:12] in name), None)
        return None

    wait_for("streams running", lambda: victim() is not None, 240, every_s=0.2)
    target = victim()
    assert target is not None
    sh(["docker", "kill", target])
    for t in threads:
        t.join(timeout=600)
    report("compose: killed decode container", target[:12])
    report("compose: streams after the kill",
           [{"tokens": r.get("tokens"), "finish": r.get("finish"), "errors": r.get("errors")}
            for r in results])  # fmt: skip
    assert all(r.get("finish") in ("stop", "length") and not r.get("errors") for r in results)
    migrations = metric_value(client.get("/metrics").text, "radixserve_migrations_total")
    report("compose: migrations", migrations)
    assert migrations >= 1


# -- 4. the CUDA image ---------------------------------------------------------------------


def test_cuda_image_builds_and_refuses_without_a_gpu(
    images: Images, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = {**images.build_args, "CUDA_IMAGE": images.bases["python"]}
    if args.get("TORCH_INDEX_URL") == "":  # the local CPU wheel, not PyPI's CUDA build
        args["TORCH_SPEC"] = "torch==2.13.0+cpu"
    args.pop("PYTHON_IMAGE", None)
    args.pop("BUILD_IMAGE", None)
    report("build radixserve:cuda (Debian base, CPU wheel) s",
           docker_build("compose/Dockerfile.cuda", CUDA_IMAGE, args))  # fmt: skip
    report("radixserve:cuda MB (CPU wheel)", round(image_size_mb(CUDA_IMAGE)))
    done = sh(["docker", "run", "--rm", "-e", "RADIXSERVE_DEVICE=cuda", CUDA_IMAGE, "decode"],
              check=False, timeout_s=300)  # fmt: skip
    report("radixserve:cuda decode without a GPU", (done.returncode, done.stderr.strip()[-300:]))
    assert done.returncode == 1 and "error: device 'cuda' asked for" in done.stderr
    # docker-compose.cuda.yml: the services that need no GPU start healthy in the CUDA
    # image; a worker's GPU reservation is refused by Docker, naming the missing driver
    folder = tmp_path_factory.mktemp("compose-cuda")
    (folder / ".env").write_text(
        f"RADIXSERVE_CLUSTER_SECRET={SECRET}\nRADIXSERVE_GATEWAY_API_KEYS={API_KEYS}\n"
    )
    cuda = [*compose_command(), "-p", f"rxcuda{uuid.uuid4().hex[:6]}", "--project-directory",
            str(COMPOSE), "--env-file", str(folder / ".env"), "-f", str(COMPOSE / "docker-compose.yml"),
            "-f", str(COMPOSE / "docker-compose.cuda.yml")]  # fmt: skip
    try:
        sh([*cuda, "up", "-d", "kvstore"])
        [kvstore] = sh([*cuda, "ps", "-q", "kvstore"]).stdout.split()
        assert inspect(kvstore, "{{.Config.Image}}") == CUDA_IMAGE
        report("compose cuda: kvstore healthy after s",
               wait_for("the CUDA image's kvstore healthy",
                        lambda: inspect(kvstore, "{{.State.Health.Status}}") == "healthy", 180))  # fmt: skip
        refused = sh([*cuda, "up", "-d", "--no-deps", "decode"], check=False)
        said = [x for x in refused.stderr.splitlines() if "nvidia" in x][-1:]
        report("compose cuda: decode without a GPU", said or refused.stderr[-300:])
        assert refused.returncode != 0 and 'device driver "nvidia"' in refused.stderr
    finally:
        sh([*cuda, "down", "-v", "-t", "5"], check=False, timeout_s=300)


# -- 5. Kubernetes manifests against the image ------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_commands_run_in_the_image(images: Images, overlay: str) -> None:
    objects = render_overlay(overlay)
    image = CUDA_IMAGE if overlay == "gpu" and image_exists(CUDA_IMAGE) else IMAGE
    checked = []
    for name, deployment in objects_of(objects, "Deployment").items():
        c = container(deployment)
        env = {k: v for k, v in pod_env(objects, deployment).items() if not v.startswith("<")}
        env.setdefault("RADIXSERVE_CLUSTER_SECRET", SECRET)  # the Secrets' values
        env.setdefault("RADIXSERVE_GATEWAY_API_KEYS", API_KEYS)
        args = (
            [*c.get("command", [])[1:], *c.get("args", [])]
            if c.get("command")
            else c.get("args", [])
        )
        cmd = ["docker", "run", "--rm"]
        for key, value in env.items():
            cmd += ["-e", f"{key}={value}"]
        done = sh([*cmd, image, *args, "--check-config"], check=False, timeout_s=120)
        assert done.returncode == 0, f"{overlay}/{name}: {args}: {done.stderr[-1500:]}"
        settings = json.loads(done.stdout)
        opened = {v for s in settings.values() for k, v in s.items()
                  if k.endswith("port") and isinstance(v, int) and v}  # fmt: skip
        ports = {
            p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])
        }
        assert set(ports.values()) <= opened, (
            f"{overlay}/{name}: manifest ports {ports}, settings open {opened}"
        )
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if port is not None:
                assert ports.get(port, port) in opened, (
                    f"{overlay}/{name} {probe} port {port}: {opened}"
                )
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if hook:  # parsed by the image's own CLI parser (running it would signal PID 1)
            assert hook[0] == "radixserve", hook
            parse = (
                f"from radixserve.cli import make_parser; make_parser().parse_args({hook[1:]!r})"
            )
            sh(["docker", "run", "--rm", "--entrypoint", "python", image, "-c", parse])
        checked.append(
            f"{name}: {' '.join(args)}" + (f"; preStop {' '.join(hook)}" if hook else "")
        )
    assert {component(d) for d in objects_of(objects, "Deployment").values()} == set(
        RADIXSERVE_SERVICES
    )
    report(f"kubernetes {overlay}: commands run in {image}", checked)
