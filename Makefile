# Quick start: `make serve` (the cluster on the default model) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test test-fast lint bench
setup:
	@bash scripts/setup_env.sh

serve: setup
	$(VENV)/bin/pd serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

# A few minutes, for iterating: no Ray cluster, no pd serve process, no network namespaces, no
# test of many seconds (make test runs them all).
test-fast: setup
	$(PY) -m pytest -q -m "not cluster and not multihost and not soak and not compile and not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pd prefill decode transfer pdtools scripts tests

bench: setup
	$(PY) scripts/bench_engine.py
