#!/usr/bin/env bash
# A VLM on 2 CPU cores: a random tiny Idefics3 learns which colour a square in a 64 px image is (colour_agent.py).
#   1. build the random VLM (recipes/tiny_vlm.py, 19 image tokens per image);
#   2. SFT warm start: 30 steps on 40 chat examples with their image (2% of the train rows), our own SFT path;
#   3. on-policy GRPO (K=0), reward 1 for the exact colour word, 60 steps at lr 1e-3, evaluated on 100 held-out
#      rows before RL and every 10 steps. Chance is 0.25: the prompt text never names the colour.
#      Prints the reward after SFT and after RL and the held-out accuracy before and after.
# SFT_STEPS=20 RL_STEPS=80: the warm start stops at the answer's format (held-out ~0.2); RL alone then reaches ~0.7.
# K=1 (as cpu_default.sh) waits on launch.py's mismatch probe, which sends a VLM's prompts without their images.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/colour_cpu}
PY=.venv/bin/python
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"
SECONDS=0
$PY recipes/tiny_vlm.py "$OUT/model" --seed 0
$PY launch.py --launch.mode sft --launch.model "$OUT/model" --launch.out_dir "$OUT/sft" \
  --launch.steps "${SFT_STEPS:-30}" --data.path recipes/colour_agent.py --launch.batch_prompts 16 --train.lr 3e-3
$PY launch.py --launch.model "$OUT/sft/hf" --launch.out_dir "$OUT/rl" --launch.steps "${RL_STEPS:-60}" \
  --data.path recipes/colour_agent.py --agent.path recipes/colour_agent.py \
  --launch.batch_prompts 16 --launch.samples_per_prompt 8 --rollout.max_new_tokens 8 --rollout.temperature 1.0 \
  --train.lr 1e-3 --launch.max_staleness 0 \
  --vllm.max_model_len 128 --eval.every 10 --eval.prompts 100 "$@"
$PY recipes/summary.py "$OUT/rl/metrics.jsonl" --label "held-out accuracy" --chance 0.25
echo "done in ${SECONDS}s"
