# Two commands set up everything on a fresh machine: `make quickstart` and `make test`.
# Both create .venv and install the project into it first (once; again when pyproject.toml changes).
VENV ?= .venv
PYTHON ?= python3
# The CPU build of PyTorch, pinned. On a CUDA box keep your own torch: make TORCH_SPEC= ...
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

STAMP := $(VENV)/.installed

.PHONY: quickstart test lint format install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install -e '.[dev]'
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/batchgen run jobs/quickstart.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# Lint, format check and types; CI runs it before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check batchgen tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check batchgen tests benchmarks scripts examples
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix batchgen tests benchmarks scripts examples
	$(VENV)/bin/ruff format batchgen tests benchmarks scripts examples

clean-venv:
	rm -rf $(VENV)
