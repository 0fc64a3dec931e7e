#!/usr/bin/env bash
# Slurm: start a Ray cluster across the allocation, then run the same launch.py command on the head.
#   sbatch --nodes=2 --gpus-per-node=8 recipes/slurm_multinode.sh recipes/qwen3_4b_math.sh --train.world_size 8 --vllm.num_engines 8
# Submit from the repository root (the job runs there, with .venv/bin/ray). RAY_PORT: the head's port (6379);
# RAY_START_ARGS: more flags for every `ray start` (ports, --num-gpus); RAY_WAIT: seconds to wait for the head,
# then for every node to join, before the job fails (300).
#SBATCH --job-name=verbatim
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
RECIPE=${1:?usage: sbatch recipes/slurm_multinode.sh RECIPE.sh [flags...]}; shift
cd "$SLURM_SUBMIT_DIR"
RAY=$PWD/.venv/bin/ray
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
addr=$head_ip:${RAY_PORT:-6379}
# One token for this job's Ray (every node, health check and driver): srun passes the environment on.
token=$(.venv/bin/python -c 'import secrets; print(secrets.token_hex(32))')
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$token}

# Each `ray start --block` is a job step: on exit, killing its srun ends the step, and Slurm kills all in it.
trap 'kill $(jobs -p) 2> /dev/null; wait' EXIT
start_ray() {  # start_ray NODE ARGS...: one Ray node as a background job step
  srun --overlap --nodes=1 --ntasks=1 -w "$1" "$RAY" start --block ${RAY_START_ARGS:-} "${@:2}" &
  ray_pids+=($!)
}
wait_until() {  # wait_until WHAT COMMAND...: poll COMMAND until it succeeds; fail naming WHAT after RAY_WAIT s
  local deadline=$((SECONDS + ${RAY_WAIT:-300}))
  until "${@:2}" > /dev/null 2>&1; do
    kill -0 "${ray_pids[@]}" 2> /dev/null || { echo "slurm_multinode.sh: a ray start exited: $1" >&2; exit 1; }
    ((SECONDS < deadline)) || { echo "slurm_multinode.sh: $1 after ${RAY_WAIT:-300}s" >&2; exit 1; }
    sleep 1
  done
}
# A try that hangs (no GCS yet) counts as a no after 20 s, so the deadline and the exit check still apply.
all_joined() { [ "$(timeout 20 "$RAY" status --address "$addr" | grep -c '^ 1 node_')" -ge "${#nodes[@]}" ]; }

ray_pids=()
start_ray "$head" --head --node-ip-address="$head_ip" --port="${RAY_PORT:-6379}"
wait_until "no Ray head answers at $addr" timeout 20 "$RAY" health-check --address "$addr"
for node in "${nodes[@]:1}"; do start_ray "$node" --address="$addr"; done
wait_until "fewer than ${#nodes[@]} Ray nodes joined $addr" all_joined
bash "$RECIPE" --launch.ray_address "$addr" "$@"
