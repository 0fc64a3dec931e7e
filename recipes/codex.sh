#!/usr/bin/env bash
# OpenAI's Codex CLI, the shipped binary (pinned; recipes/clis.py installs it into .agents/cli), trained as it is
# through the chat server's Responses API on CPU: GRPO, K=0, reward 1 when its exec_command tool created done.txt.
# A random model never calls a tool, so the run starts from a tiny model SFT'd to call exec_command as Codex
# expects: Codex's own requests against scripted replies, then launch.py --launch.mode sft (tests/tool_model.py).
# CODEX_MINIMAL=1 sends the ~4 KB request (own instructions, the two shell tools); CODEX_MINIMAL=0 the stock ~40 KB
# one (~8.5k tokens: prefix caching keeps later turns to their new tokens). Codex sets no max_output_tokens, so
# --chat.max_tokens_cap bounds each turn (--rollout.max_new_tokens does not apply to chat requests).
# A microbatch holds --vllm.max_model_len tokens, so the longest episode (a stock-prompt one) trains as one row.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/codex}
AGENT=recipes/codex_agent.py
export CODEX_MINIMAL=${CODEX_MINIMAL-1}
PY=.venv/bin/python
$PY recipes/clis.py codex
[ -d "$OUT/tool_model/sft/hf" ] || $PY tests/tool_model.py "$OUT/tool_model" --agent "$AGENT" --tool exec_command \
  --argument cmd --create "echo created | tee done.txt"
exec $PY launch.py --launch.model "$OUT/tool_model/sft/hf" --launch.out_dir "$OUT" --launch.steps "${STEPS:-4}" \
  --agent.path "$AGENT" --data.path "$AGENT" \
  --launch.batch_prompts 2 --launch.samples_per_prompt 4 --chat.max_tokens_cap 64 --chat.model_name verbatim-tiny \
  --vllm.max_model_len 16384 --train.max_tokens_per_microbatch 16384 --vllm.enable_prefix_caching \
  --train.lr 1e-4 "$@"
