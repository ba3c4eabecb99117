# The two commands a fresh machine needs: `make serve` and `make test`.
# Both create .venv when missing and install exactly the versions in requirements.lock (every
# package, transitive ones and the pinned CPU build of torch included), then triode itself.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements.lock
PYTEST_ARGS ?=
# The tools that write the lock, pinned like everything else; they live in a venv of their own.
LOCK_TOOLS := pip==26.3 pip-tools==7.7.0
PIP_COMPILE_FLAGS := --quiet --extra bench --extra test --all-build-deps --allow-unsafe --strip-extras \
	--no-emit-index-url --no-emit-find-links --no-emit-trusted-host

.PHONY: setup serve test typecheck test-all test-scenarios test-latest lint lock lock-upgrade bench-step clean

setup: $(STAMP)

# The lock holds setuptools too, so triode installs without build isolation: nothing floats.
$(STAMP): pyproject.toml setup.py $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --requirement $(LOCK)
	$(BIN)/python scripts/check_lock.py
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	touch $(STAMP)

serve: setup
	$(BIN)/triode serve

# Everything but the cases marked slow (under 15 minutes on two cores); test-all runs those too.
test: setup
	$(BIN)/ruff check .
	$(BIN)/python scripts/typecheck.py
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

typecheck: setup
	$(BIN)/python scripts/typecheck.py

test-all: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Every scenario file against real servers (`make test` plays one of each fault kind).
test-scenarios: setup
	$(BIN)/python -m pytest -m "scenarios and slow" $(PYTEST_ARGS)

# The newest releases that pyproject.toml's ranges admit, in a throwaway venv: which versions
# differ from the lock, and whether a quick subset of the tests still passes with them.
test-latest:
	bash scripts/test_latest.sh

# Rewrites requirements.lock from pyproject.toml, keeping every pin that still fits;
# lock-upgrade moves every package to its newest admitted release.
lock:
	test -x .lock-venv/bin/python || $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet $(LOCK_TOOLS)
	CUSTOM_COMPILE_COMMAND="make lock" .lock-venv/bin/pip-compile $(PIP_COMPILE_FLAGS) --output-file $(LOCK) pyproject.toml

lock-upgrade:
	$(MAKE) lock PIP_COMPILE_FLAGS="$(PIP_COMPILE_FLAGS) --upgrade"

lint: setup
	$(BIN)/ruff check .

bench-step: setup
	$(BIN)/triode bench step

clean:
	rm -rf $(VENV) .lock-venv .pytest_cache .ruff_cache
