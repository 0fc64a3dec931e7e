#!/usr/bin/env bash
# Slurm: start a Ray cluster across the allocation, then run the same launch.py command on the head.
#   sbatch --nodes=2 --gpus-per-node=8 recipes/slurm_multinode.sh recipes/qwen3_4b_math.sh --train.world_size 8 --vllm.num_engines 8
#SBATCH --job-name=verbatim
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
RECIPE=${1:?usage: sbatch recipes/slurm_multinode.sh RECIPE.sh [flags...]}; shift
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
port=${RAY_PORT:-6379}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" --port="$port" --block &
sleep 15
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$port" --block &
done
sleep 15
bash "$RECIPE" --launch.ray_address "$head_ip:$port" "$@"
