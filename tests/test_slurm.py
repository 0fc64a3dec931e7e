"""recipes/slurm_multinode.sh run for real: Debian's Slurm (slurmctld and two slurmd, nodeA and nodeB, on this
machine), `sbatch --wait --nodes=2` of the recipe over a 2-step tiny-model run of launch.py.

Installs slurmctld, slurmd and slurm-client from Debian's packages when absent (needs root). auth/none and
cred/none stand in for munge, as no one else can reach these daemons. The job's Ray gets its own port, client
port and temp dir, so it never meets another Ray on this machine; the test kills whatever of it is left.
Measured on 2 shared cores (2026-12-03): the daemons are idle 1-2 s after start, the 2-step job runs in 74-202 s
(two `ray start`, the engine, 2 steps), the refused head fails its job in 42 s; apt-get install took ~20 s.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = os.path.join(ROOT, "recipes", "copy_agent.py")
NODES = ("nodeA", "nodeB")

SLURM_CONF = """ClusterName=verbatim
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# What sbatch runs: the repo's venv python, two steps, and the flags the Slurm recipe appends (--launch.ray_address).
TINY_RECIPE = """#!/usr/bin/env bash
set -euo pipefail
echo "recipe flags: $*"
.venv/bin/python launch.py --launch.model {model} --launch.out_dir {out} --launch.steps 2 \\
  --agent.path {copy} --data.path {copy} --launch.batch_prompts 2 --launch.samples_per_prompt 2 \\
  --rollout.max_new_tokens 4 --vllm.max_model_len 64 --vllm.kv_cache_gb 0.25 "$@"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def install_slurm() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return
    if os.geteuid() != 0:
        pytest.skip("Slurm is not installed, and installing it with apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurmctld", "slurmd", "slurm-client"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def last_errors(log) -> str:
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    return "\n".join([ln for ln in lines if "error" in ln or "fatal" in ln][-3:] or lines[-3:])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and one slurmd per node in NODES, as this module's own processes; yields their environment."""
    install_slurm()
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=2"
                      for n in NODES)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(ctld_port=free_port(), user=psutil.Process().username(), d=d, nodes=nodes))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = {"slurmctld": (["slurmctld", "-D", "-i"], d / "slurmctld.log")}
    daemons.update({f"slurmd -N {n}": (["slurmd", "-D", "-N", n], d / f"slurmd.{n}.log") for n in NODES})
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
             for name, (cmd, _) in daemons.items()}
    try:
        deadline = time.monotonic() + 60
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    pytest.skip(f"{name} cannot run here (exit {proc.returncode}): {last_errors(daemons[name][1])}")
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True)
            if sorted(states.stdout.split("\n")[:-1]) == [f"{n} idle" for n in NODES]:
                break
            assert time.monotonic() < deadline, f"nodes not idle after 60 s: {states.stdout}{states.stderr}"
            time.sleep(0.5)
        yield env
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def job_processes(ray_tmp: str) -> list[psutil.Process]:
    """What the job started (Ray's daemons, workers and actors, the engine): all inherit RAY_TMPDIR=ray_tmp."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RAY_TMPDIR") == ray_tmp:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def sbatch(env: dict, tmp_path, recipe: str, timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    """Runs the Slurm recipe over `recipe` to its end; returns sbatch's result and the job's output."""
    log = tmp_path / "job.out"
    cmd = ["sbatch", "--wait", "--parsable", f"--nodes={len(NODES)}", "-o", str(log),
           "recipes/slurm_multinode.sh", recipe]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        subprocess.run(["scancel", "--name=verbatim"], env=env)
    return done, log.read_text()


@pytest.fixture
def ray_env(slurm):
    """The job's Ray on ports of its own, under a temp dir of its own that every process it starts inherits."""
    ray_tmp = tempfile.mkdtemp(prefix="vbslurm", dir="/tmp")
    yield {**slurm, "RAY_PORT": str(free_port()), "RAY_TMPDIR": ray_tmp, "RAY_WAIT": "120",
           "RAY_START_ARGS": f"--ray-client-server-port={free_port()}"}
    for proc in job_processes(ray_tmp):
        proc.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_sbatch_of_the_slurm_recipe_runs_launch_across_two_ray_nodes(ray_env, tiny_model, tmp_path):
    out, recipe = tmp_path / "run", tmp_path / "tiny.sh"
    recipe.write_text(TINY_RECIPE.format(model=tiny_model, out=out, copy=COPY))
    started = time.monotonic()
    done, printed = sbatch(ray_env, tmp_path, str(recipe), timeout=900)
    assert done.returncode == 0, done.stderr + printed[-4000:]
    print(f"job ran in {time.monotonic() - started:.0f} s")
    # The head's and the worker's `ray start --block` (one job step on each node) both came up.
    assert printed.count("Ray runtime started.") == 2, printed[-4000:]
    assert "recipe flags: --launch.ray_address " in printed and f":{ray_env['RAY_PORT']}\n" in printed
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(row)["step"] for row in f] == [0, 1]
    # sbatch --wait has returned: the recipe's trap and Slurm have stopped every process the job started.
    deadline = time.monotonic() + 30
    while job_processes(ray_env["RAY_TMPDIR"]):
        assert time.monotonic() < deadline, [p.pid for p in job_processes(ray_env["RAY_TMPDIR"])]
        time.sleep(0.5)


@pytest.mark.slow
def test_a_ray_head_that_cannot_start_fails_the_job_at_once_naming_it(ray_env, tmp_path):
    # Ray keeps 10002-19999 for its workers, so `ray start --head --port 15000` refuses to start.
    env = {**ray_env, "RAY_PORT": "15000"}
    started = time.monotonic()
    done, printed = sbatch(env, tmp_path, "/bin/false", timeout=300)
    assert done.returncode != 0
    assert "slurm_multinode.sh: a ray start exited: no Ray head answers at " in printed, printed[-4000:]
    assert "port number 15000 that is used by other components" in printed
    # Long before RAY_WAIT (120 s): the head fails within ~10 s of the allocation, the recipe's check that hangs on
    # the missing head gives up after 20 s and sees the head's srun gone, and sbatch --wait polls every <= 10 s.
    assert time.monotonic() - started < 60
