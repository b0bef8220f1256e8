# The README's two set-up commands: `make demo` and `make test`. Both create .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every extra the test suite exercises.
TEST_EXTRAS ?= test,swebench,docker
PYTEST_ARGS ?=

.PHONY: demo test venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

## make demo: install branchgym and run the main job on its embedded defaults
demo: $(PY)
	$(PIP) install -q -e .
	$(VENV)/bin/branchgym list
	$(VENV)/bin/branchgym check --all

## make test: install every extra the tests need and run the whole suite
test: $(PY)
	$(PIP) install -q -e '.[$(TEST_EXTRAS)]'
	$(VENV)/bin/ruff check .
	scripts/with_docker.sh $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
