# The first Python 3.11+ on PATH (python3 may be older where python3.11 was added beside it).
PY ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; \
	done)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

.PHONY: demo test lint bench clean

$(BIN)/python:
	@test -n "$(PY)" || { echo "error: no Python 3.11+ found (python3, python3.11...); install one or run make PY=/path/to/python3.11" >&2; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip


$(STAMP): $(BIN)/python pyproject.toml
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "error: .venv was made by $$($(BIN)/python --version); this needs Python 3.11+: make clean, then make again" >&2; exit 1; }
	$(BIN)/pip install -q -e '.[mcp]'
	touch $(STAMP)

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(DEVSTAMP)

demo: $(STAMP)
	$(BIN)/hermes-gateway demo

# Four pytest-xdist workers, each on its own Redis database (tests/conftest.py: db 9 to 12 by default); most
# end-to-end tests wait on processes, so four overlap well on two cores. A module whose tests share what
# one of them builds (a hermes-agent venv) carries @pytest.mark.xdist_group: one worker runs it all
# (--dist loadgroup). TEST_WORKERS=1 for one process; HERMES_TEST_REDIS_URL sets the first database.
TEST_WORKERS ?= 4
test: $(DEVSTAMP)
	$(BIN)/python -m tests.ensure_redis -- $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy broker workers middleware hermes_gateway bench

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
