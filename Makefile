# The two commands a fresh machine needs: `make serve` and `make test`.
# Both create .venv when missing and install torch first (the pinned CPU build).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup serve test test-all test-scenarios lint bench-step clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: setup
	$(BIN)/triode serve

# Everything but the cases marked slow (under 15 minutes on two cores); test-all runs those too.
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every scenario file against real servers (`make test` plays one of each fault kind).
test-scenarios: setup
	$(BIN)/python -m pytest -m "scenarios and slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

bench-step: setup
	$(BIN)/triode bench step

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
