#!/usr/bin/env bash
# The calculator agent written against the stock `anthropic` SDK (tool_use / tool_result blocks), trained
# through the chat server's Anthropic front end on CPU. Same flags as chat_agent_openai.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/chat_agent_anthropic} AGENT=recipes/calc_anthropic_agent.py exec bash recipes/chat_agent_openai.sh "$@"
