# Quick start: `make serve` (the cluster on the default model) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test test-fast lint bench
setup:
	@bash scripts/setup_env.sh

serve: setup
	$(VENV)/bin/pd serve $(ARGS)

# Two workers, a test file each at a time (pytest-xdist): the suite's processes wait on one
# another much of the time (57% of the 2 cores busy on average in a serial run here), so two
# files at once take the whole suite from ~27 to ~16 minutes on 2 cores. Each worker starts its
# own private Ray instance; a file's tests share one worker, as they share its module fixtures.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# A few minutes, for iterating: no Ray cluster, no pd serve process, no network namespaces, no
# test of many seconds (make test runs them all).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not cluster and not multihost and not soak and not compile and not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check pd prefill decode transfer pdtools scripts tests

bench: setup
	$(PY) scripts/bench_engine.py
