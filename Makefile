# plait: `make demo` runs the main job, `make test` runs every test. Both set up first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_mpi_yield_when_idle := 1
export PYTHONUNBUFFERED := 1
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: setup test lint typecheck unit demo bench stress info clean

setup:
	@bash tools/setup.sh

lint: setup
	$(PY) -m ruff check src collectives adapters tests examples benchmarks tools

typecheck: setup
	$(PY) -m mypy

test: setup lint typecheck
	$(PY) -m pytest tests -q --durations=25

demo: setup
	$(PY) -m plait.cli run -np 2 --backend mpi -- $(PY) examples/torch_digits.py

bench: setup
	$(PY) benchmarks/run_all.py

# repeated elastic membership changes (tests/stress_elastic.py; PLAIT_STRESS_REPEATS, default 20)
stress: setup
	$(PY) -m pytest tests/stress_elastic.py -q

info: setup
	$(PY) -m plait.cli info

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
