#!/usr/bin/env bash
# The default CPU recipe (`make run`): SFT warm start, then asynchronous GRPO on a tiny local model.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f launch.py ]; then
  echo "make run: launch.py (the async loop) is not written yet, so there is nothing to train."
  echo "Present: $(ls estimators.py losses.py generator.py trainer.py chat_server.py agent.py 2>/dev/null | tr '\n' ' ')"
  exit 2
fi
exec .venv/bin/python launch.py "$@"
