#!/usr/bin/env bash
# Claude Code, the shipped CLI (pinned; recipes/clis.py installs it into .agents/cli), trained as it is through the
# chat server on CPU: GRPO, K=0, reward 1 when its Bash tool created done.txt. A random model never calls a tool, so
# the run starts from a tiny model SFT'd to call Bash as Claude Code expects: Claude Code's own requests against
# scripted replies, then launch.py --launch.mode sft (tests/tool_model.py; a couple of minutes, once).
# CLAUDE_ARGS shrinks the prompt to Bash and a one-line system prompt; CLAUDE_ARGS= (empty) sends the stock prompt
# and tools (~50 KB a request; prefix caching keeps later turns to their new tokens). Claude Code asks for
# max_tokens 32000: --chat.max_tokens_cap bounds each turn (--rollout.max_new_tokens does not apply to chat requests).
# A microbatch holds --vllm.max_model_len tokens, so the longest episode (a stock-prompt one) trains as one row.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/claude_code}
AGENT=recipes/claude_code_agent.py
SHORT="--system-prompt 'You run shell commands.' --tools Bash"
export CLAUDE_ARGS=${CLAUDE_ARGS-$SHORT}
PY=.venv/bin/python
$PY recipes/clis.py claude
[ -d "$OUT/tool_model/sft/hf" ] || $PY tests/tool_model.py "$OUT/tool_model" --agent "$AGENT"
exec $PY launch.py --launch.model "$OUT/tool_model/sft/hf" --launch.out_dir "$OUT" --launch.steps "${STEPS:-4}" \
  --agent.path "$AGENT" --data.path "$AGENT" \
  --launch.batch_prompts 2 --launch.samples_per_prompt 4 --chat.max_tokens_cap 64 --chat.model_name verbatim-tiny \
  --vllm.max_model_len 16384 --train.max_tokens_per_microbatch 16384 --vllm.enable_prefix_caching \
  --train.lr 1e-4 "$@"
