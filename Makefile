PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(DEVSTAMP)

demo: $(STAMP)
	$(BIN)/hermes-gateway demo

test: $(DEVSTAMP)
	$(BIN)/python -m tests.ensure_redis -- $(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy broker workers middleware hermes_gateway bench

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
