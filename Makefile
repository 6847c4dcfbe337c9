# Two commands set up everything on a fresh machine: `make quickstart` and `make test`.
# Both create .venv and install the project into it first (once; again when pyproject.toml changes).
VENV ?= .venv
PYTHON ?= python3
# The CPU build of PyTorch, pinned. On a CUDA box keep your own torch: make TORCH_SPEC= ...
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

STAMP := $(VENV)/.installed
# Airflow in a venv of its own, as it is deployed: it runs the example DAG, whose tasks call batchgen's
# command line (tests/test_airflow_dag.py). Why apart: Airflow pins ~130 packages of its own; ours need
# not move with them. Pinned by examples/airflow/constraints.txt (its own constraint files are not on PyPI).
AIRFLOW_VENV ?= .venv-airflow
AIRFLOW_SPEC ?= apache-airflow==3.3.2
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed

.PHONY: quickstart test lint format install airflow clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install -e '.[dev]'
	touch $(STAMP)

# Where it cannot be installed (no PyPI), the Airflow test is skipped, except in CI (CI=true), where it fails.
airflow: $(AIRFLOW_STAMP)

$(AIRFLOW_STAMP): examples/airflow/constraints.txt
	@$(PYTHON) -m venv $(AIRFLOW_VENV) && $(AIRFLOW_VENV)/bin/python -m pip install -q "$(AIRFLOW_SPEC)" \
		-c examples/airflow/constraints.txt && touch $(AIRFLOW_STAMP) \
		|| echo "Airflow not installed in $(AIRFLOW_VENV): tests/test_airflow_dag.py is skipped"

quickstart: $(STAMP)
	$(VENV)/bin/batchgen run jobs/quickstart.yaml

# Two pytest workers (pytest-xdist): about half the suite's time goes to starting batchgen processes
# and waiting on them, which a second worker fills. Tests marked `serial` measure this machine's CPU
# load themselves (the thread governor's), so they run after, alone.
TEST_WORKERS ?= 2
test: $(STAMP) $(AIRFLOW_STAMP)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --durations=25 -m "not serial"
	$(VENV)/bin/python -m pytest -m serial

# Lint, format check and types; CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check batchgen testkit tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check batchgen testkit tests benchmarks scripts examples
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix batchgen testkit tests benchmarks scripts examples
	$(VENV)/bin/ruff format batchgen testkit tests benchmarks scripts examples

clean-venv:
	rm -rf $(VENV) $(AIRFLOW_VENV)
