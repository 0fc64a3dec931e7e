#!/usr/bin/env bash
# The learning curve of recipes/verifiers_agent.py: the copy task as a verifiers SingleTurnEnv
# (recipes/verifiers_copy_env.py) against the native Env agent (recipes/copy_agent.py), on 2 cores.
#   1. the tiny model and its SFT warm start, as recipes/cpu_default.sh makes them (one SFT model for both runs);
#   2. the same GRPO run twice from it: the native agent, then the verifiers environment through the chat server
#      (--chat.default_max_tokens 8 is the native --rollout.max_new_tokens 8: verifiers sends no max_tokens).
# Prints each run's reward after SFT and after RL, its held-out eval, and the wall time of each RL run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/verifiers_copy}
PY=.venv/bin/python
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false
rm -rf "$OUT"
$PY recipes/tiny_model.py "$OUT/model" --tokenizer chars --alphabet $'0123456789copy \n' --hidden 128 --layers 2 --seed 0
$PY launch.py --launch.mode sft --launch.model "$OUT/model" --launch.out_dir "$OUT/sft" --launch.steps "${SFT_STEPS:-30}" \
  --data.path recipes/copy_agent.py --launch.batch_prompts 16 --train.lr 3e-3
RL=(--launch.model "$OUT/sft/hf" --launch.steps "${RL_STEPS:-60}" --launch.batch_prompts 32 --launch.samples_per_prompt 8 \
    --rollout.max_new_tokens 8 --rollout.temperature 1.0 --train.lr 1e-3 --launch.max_staleness 1 --loss.is_level token \
    --loss.entropy_coef 0.0 --vllm.max_model_len 64 --eval.every 10 --eval.prompts 100)
for agent in ${AGENTS:-native verifiers}; do
  SECONDS=0
  if [ "$agent" = native ]; then
    $PY launch.py "${RL[@]}" --launch.out_dir "$OUT/native" --agent.path recipes/copy_agent.py \
      --data.path recipes/copy_agent.py "$@"
  else
    VERIFIERS_ENV=recipes/verifiers_copy_env.py $PY launch.py "${RL[@]}" --launch.out_dir "$OUT/verifiers" \
      --agent.path recipes/verifiers_agent.py --data.path recipes/verifiers_agent.py --chat.default_max_tokens 8 "$@"
  fi
  echo "== $agent: RL in ${SECONDS}s"
  $PY recipes/summary.py "$OUT/$agent/metrics.jsonl"
done
