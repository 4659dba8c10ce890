# Two commands for a fresh clone:  `make run`  (the main job)  and  `make test`  (the whole suite).
# Each creates .venv and installs the package on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch; on a CUDA machine pass e.g. TORCH_SPEC=torch to keep/choose your own build.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: run test setup pytest typecheck lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/hybridmeta $(ARGS)

pytest: $(VENV)/.installed
	$(PY) -m pytest -q

typecheck: $(VENV)/.installed
	$(PY) -m mypy --strict

lint: $(VENV)/.installed
	$(PY) -m ruff check .

test: pytest typecheck lint
