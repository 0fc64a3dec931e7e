#!/usr/bin/env bash
# GPU, single node: Qwen3-4B on math with a boxed-answer grader (recipes/math_agent.py), GRPO, one step
# off-policy (K=1, token-level TIS). Needs the model and a dataset on disk (this machine cannot download):
#   huggingface-cli download Qwen/Qwen3-4B --local-dir $MODEL
#   python -c "import datasets; datasets.load_dataset('openai/gsm8k','main',split='train').map(
#     lambda r: {'prompt': r['question'], 'label': r['answer'].split('####')[-1].strip()}).to_json('$DATA')"
# Engine and trainer share one GPU (--launch.colocate, refit over CUDA IPC): --vllm.gpu_memory_utilization
# leaves the rest to the trainer. With two GPUs, drop --launch.colocate: one each, refit over NCCL.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:?set MODEL to the Qwen3-4B directory}
DATA=${DATA:?set DATA to a JSONL of prompt/label rows}
exec python launch.py --launch.model "$MODEL" --launch.out_dir runs/qwen3_4b_math --launch.steps 200 \
  --agent.path recipes/math_agent.py --data.path "$DATA" --agent.max_context 4096 \
  --vllm.dtype bfloat16 --vllm.max_model_len 4096 --vllm.gpu_memory_utilization 0.35 --no-vllm.enforce_eager --launch.colocate \
  --fsdp.param_dtype bfloat16 --fsdp.gradient_checkpointing --train.max_tokens_per_microbatch 16384 \
  --launch.batch_prompts 32 --launch.samples_per_prompt 8 --rollout.max_new_tokens 2048 \
  --train.lr 1e-6 --launch.max_staleness 1 --loss.is_level token --loss.is_mode trunc \
  --data.filter_range 0.01 0.99 --eval.every 20 --ckpt.dir runs/qwen3_4b_math/ckpt --ckpt.every 50 "$@"
