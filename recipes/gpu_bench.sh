#!/usr/bin/env bash
# On the GPU machine (H200, offline), from the repo root, after every .gpu-parts/pK made by
# recipes/gpu_stage.sh was copied into .gpu-stage/: install, then the CUDA tests, then the benchmarks.
#   bash recipes/gpu_bench.sh                   # ~10 min of tests + ~13 min of benchmarks on 2 x H200
#   bash recipes/gpu_bench.sh trainer refit     # only these benchmark sections
# Where one command may run at most 10 minutes, split the tests: make test-gpu PYTEST_ARGS='-k "not loop"',
# then PYTEST_ARGS='-k loop' (~5 min each).
# Results: the pytest summary, and one JSON line per benchmark in runs/bench_gpu.jsonl. The loop sections
# read the generator section's vLLM tokens/s from that file, so run `generator` before `loop1`/`loop2`.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -d .gpu-site/vllm ]] || bash recipes/gpu_install.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
make test-gpu || echo "test-gpu failed (see above); benchmarks run anyway"
make bench-gpu SECTIONS="$*"
