#!/usr/bin/env bash
# A multi-turn tool-using agent written against the stock `openai` SDK, trained through the chat server
# on CPU (GRPO, K=0). The random tiny model will not learn multiplication in minutes: this recipe shows
# the plumbing (token-exact segments from an unmodified SDK agent), not a learning curve.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/chat_agent_openai}
AGENT=${AGENT:-recipes/calc_openai_agent.py}   # chat_agent_anthropic.sh sets the Anthropic twin
PY=.venv/bin/python
[ -d "$OUT/model" ] || $PY recipes/tiny_model.py "$OUT/model" --tokenizer bpe --seed 0
exec $PY launch.py --launch.model "$OUT/model" --launch.out_dir "$OUT" --launch.steps "${STEPS:-4}" \
  --agent.path "$AGENT" --data.path "$AGENT" \
  --launch.batch_prompts 2 --launch.samples_per_prompt 4 --rollout.max_new_tokens 48 \
  --vllm.max_model_len 1024 --train.lr 1e-3 "$@"
