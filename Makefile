# Quick start: `make serve` (the cluster on the default model) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test lint bench
setup:
	@bash scripts/setup_env.sh

serve: setup
	$(VENV)/bin/pd serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pd prefill decode transfer scripts tests

bench: setup
	$(PY) scripts/bench_engine.py
