"""The entry point: one argparse parser from every file's flags, Ray placement, and the one async loop.

    python launch.py --help          # every flag, its default and its choices
    python launch.py --agent.path recipes/copy_agent.py --data.path recipes/copy_agent.py ...

The loop: agent workers turn prompt groups into Segments (through chat_server.py for a ChatAgent) and keep up to
K+1 batches in flight (K = --launch.max_staleness; with partial rollouts, --launch.in_flight groups); the trainer
trains one step on a batch, then every engine is refit (pause → load → resume) to the new policy version. K=0 is
strictly on-policy: sampling waits for the refit. Each step audits every trained token against what the generator
returned, logs to metrics.jsonl (TensorBoard / W&B when asked) and checkpoints when due. --launch.mode sft trains
on chat data instead. Not here: the math (estimators.py, losses.py, trainer.py) and the token capture.
Reading order: the flags, audit, rollout_metrics, refit, probe_mismatch, evaluate, run_rl, run_sft, main; below the
banner: the parser and cross-file rules, GroupQueue, run_rl's set-up, teardown and clock, placement, files, sinks.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import time
import types
import typing
from dataclasses import dataclass, field
from itertools import compress, zip_longest

import ray
import torch
from torch.utils.tensorboard import SummaryWriter

from agent import AgentArgs, AgentWorker, load_module
from chat_server import ChatArgs, ChatTemplate
from estimators import EstimatorArgs
from generator import Generator, RolloutArgs, Segment, VllmArgs, segment_routing
from losses import LossArgs, mismatch_metrics
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, sft_batch


@dataclass
class LaunchArgs:
    mode: str = field(default="rl", metadata={"help": "rl: the agent loop; sft: train on --data.path chat JSONL",
                                              "choices": ("rl", "sft")})
    model: str = field(default="", metadata={"help": "Hugging Face model directory or hub id (required)"})
    out_dir: str = field(default="runs/default", metadata={"help": "metrics.jsonl, tb/ and checkpoints go here"})
    steps: int = field(default=20, metadata={"help": "optimizer steps to run"})
    ray_address: str | None = field(default=None, metadata={
        "help": "Ray cluster to join (host:port, or auto: the one running here); None starts a fresh local one"})
    placement: tuple[str, ...] = field(default=(), metadata={
        "help": "Ray custom resources, one per node (`ray start --resources`): trainer rank i and agent worker i go on "
                "node i mod N, the engines on the first; empty: Ray's default scheduler places them"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard events to out_dir/tb"})
    wandb_project: str | None = field(default=None, metadata={"help": "also log to this W&B project (needs wandb)"})
    seed: int = field(default=0, metadata={"help": "seed of data order and sampling"})
    colocate: bool = field(default=False, metadata={
        "help": "GPU: trainer and engines share one GPU (half each side, CUDA IPC refit); else whole GPUs (NCCL)"})
    batch_prompts: int = field(default=8, metadata={"help": "prompt groups per step (SFT: examples per step)"})
    samples_per_prompt: int = field(default=8, metadata={"help": "episodes per prompt (the group size G)"})
    max_staleness: int = field(default=0, metadata={
        "help": "K: policy versions a group's tokens may lag, else the group is sampled again; 0 = strictly on-policy. "
                "K acts on whole groups, --loss.max_token_lag masks single tokens"})
    partial_rollout: bool = field(default=False, metadata={
        "help": "keep in-flight requests across a refit (rows mix versions; a group is as fresh as its newest token)"})
    in_flight: int = field(default=0, metadata={
        "help": "prompt groups sampling or waiting at once; 0 = --launch.batch_prompts x (--launch.max_staleness + 1)"
                ". More keeps the engines full on long-tail rollouts; needs --launch.partial_rollout"})
    workers: int = field(default=1, metadata={"help": "agent worker actors (each runs many episodes concurrently)"})

    def __post_init__(self):
        least = dict(steps=1, batch_prompts=1, samples_per_prompt=1, workers=1, in_flight=0, max_staleness=0)
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--launch.{name} {getattr(self, name)}: must be >= {low}")


@dataclass
class DataArgs:
    path: str = field(default="", metadata={"help": "JSONL/parquet rows (prompt, label) or a .py defining rows(split)"})
    filter_range: tuple[float, float] | None = field(default=None, metadata={
        "help": "LO HI: drop groups whose mean reward is outside [LO, HI] and sample more"})
    max_filtered_batches: int = field(default=10, metadata={
        "help": "the run stops once more than this x --launch.batch_prompts groups were filtered (--data.filter_range: "
                "data the policy always solves or fails) or lost every episode (a broken agent) as one batch filled"})

    def __post_init__(self):
        if self.filter_range is not None and not self.filter_range[0] <= self.filter_range[1]:
            raise ValueError(f"--data.filter_range {self.filter_range}: LO must be <= HI")
        if self.max_filtered_batches < 1:
            raise ValueError(f"--data.max_filtered_batches {self.max_filtered_batches}: must be >= 1")


@dataclass
class EvalArgs:
    every: int = field(default=0, metadata={"help": "evaluate on the held-out split every N steps; 0 = never"})
    prompts: int = field(default=64, metadata={"help": "held-out prompts per evaluation (one sample each)"})
    before: bool = field(default=True, metadata={
        "help": "with --eval.every: also evaluate the loaded weights before the first step (eval/before_reward_mean)"})

    def __post_init__(self):
        if self.every < 0 or self.prompts < 1:
            raise ValueError(f"--eval.every {self.every} / --eval.prompts {self.prompts}: need every >= 0, prompts > 0")


SECTIONS = {"launch": LaunchArgs, "data": DataArgs, "eval": EvalArgs, "agent": AgentArgs, "chat": ChatArgs,
            "vllm": VllmArgs, "rollout": RolloutArgs, "train": TrainArgs, "fsdp": FsdpArgs, "ckpt": CkptArgs,
            "loss": LossArgs, "estimator": EstimatorArgs}


# --- the loop: audit, metrics, refit, probe, eval; run_rl's stages
def audit(segments: list) -> None:
    """Raise unless every row holds, at each action token, exactly the id, log-prob and version recorded where
    its segment was built (info["sampled"], generator.sampled_record), naming the row and the first difference."""
    for s in segments:
        where, sampled = f"segment {s.info.get('segment', 0)} of episode {s.episode_id!r}", s.info.get("sampled")
        if sampled is None:
            raise RuntimeError(f"audit: {where} carries no record of its sampled tokens (info['sampled']); stopping")
        trained = tuple(tuple(compress(row, s.action_mask)) for row in (s.token_ids, s.logprobs, s.versions))
        if trained == sampled:
            continue
        positions = [t for t, m in enumerate(s.action_mask) if m]
        k, got, want = next((k, a, b) for k, (a, b) in enumerate(zip_longest(zip(*trained), zip(*sampled))) if a != b)
        at = f"token {positions[k]}" if k < len(positions) else "the end (an action token is missing)"
        raise RuntimeError(f"audit: {where} at {at} differs from what the generator returned: (id, log-prob, "
                           f"version) {got} is trained, {want} was sampled; stopping")


def rollout_metrics(segments: list, version: int, lag_bins: int) -> dict:
    """The trained batch: reward over episodes (each counted once), action tokens, the token staleness histogram."""
    rewards = list({s.episode_id: s.reward for s in segments}.values())
    mean = sum(rewards) / len(rewards)
    lags = [version - v for s in segments for v, m in zip(s.versions, s.action_mask) if m]
    out = {"rollout/trained_reward_mean": mean,
           "rollout/trained_reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
           "rollout/episodes": float(len(rewards)), "rollout/segments": float(len(segments)),
           "rollout/segments_per_episode": len(segments) / len(rewards),  # > 1: compactions, rewrites, sub-agents
           "rollout/action_tokens": float(len(lags)),
           "rollout/constrained_tokens": float(sum(e - b for s in segments for b, e in s.info.get("constrained", ()))),
           "rollout/truncated_frac": sum(s.truncated for s in segments) / len(segments),
           "rollout/mixed_version_rows": float(sum(len({v for v in s.versions if v >= 0}) > 1 for s in segments))}
    for k in range(lag_bins + 1):  # rollout/lag_0 .. lag_K: share of action tokens sampled k versions ago
        out[f"rollout/lag_{k}"] = sum(lag == k for lag in lags) / max(len(lags), 1)
    out["rollout/lag_older"] = sum(lag > lag_bins for lag in lags) / max(len(lags), 1)  # partial rollouts only
    return out


async def refit(generator: Generator, trainer: TrainerGroup) -> dict:
    """Pause every engine (requests kept), load the trainer's weights (rank 0 sends them), resume; returns the
    generator/refit_* metrics. Engines that serve LoRA load the adapter unpaused."""
    if not generator.serves_adapters:
        await generator.pause()
    report = await asyncio.to_thread(trainer.refit, generator)
    if not generator.serves_adapters:
        await generator.resume()
    return report["metrics"]


async def probe_mismatch(generator: Generator, trainer: TrainerGroup, segments: list,
                         count: int = 8, tokens: int = 32) -> dict:
    """Forward consistency for a step whose batch held no token of the trainer's version (every token lags): sample
    a few short continuations of the batch's prompts with the weights just refit; compare with the trainer's."""
    prompts = [s.token_ids[:s.action_mask.index(True)] for s in segments[:count]]
    images = [[i for i in s.images if i[1] <= len(p)] for s, p in zip(segments, prompts)]   # a VLM's prompt images
    tokens = min(tokens, generator.rollout.max_new_tokens)
    outs = await asyncio.gather(*(generator.generate(p, max_new_tokens=tokens, affinity="probe", images=i)
                                  for p, i in zip(prompts, images)))
    probes = probe_segments(prompts, outs, images)
    recomputed = await asyncio.to_thread(trainer.logprobs, probes)
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r) for r in rows], batch_first=True)  # (B, T)
    return mismatch_metrics(pad([p.logprobs for p in probes]), pad(recomputed), pad([p.action_mask for p in probes]))


async def evaluate(workers: list, rows: list[dict], count: int) -> dict:
    """One sample for each of the first `count` held-out rows, not trained; an episode counts once, a failed one 0."""
    results = await asyncio.gather(*(workers[i % len(workers)].run_group.remote(row, f"eval{i}", 1)
                                     for i, row in enumerate(rows[:count])))
    rewards = [r for out in results for r in {s.episode_id: s.reward for s in out["segments"]
                                              if s.episode_id not in out["scored_ids"]}.values()]  # failed: 0 here
    failed = sum(n for out in results for kind in ("dropped", "scored") for n in out[kind].values())
    episodes = len(rewards) + failed
    return {"eval/reward_mean": sum(rewards) / max(episodes, 1), "eval/episodes": float(episodes),
            "eval/failed_episodes": float(failed)}


async def run_rl(cfg: dict, generator: Generator | None = None) -> dict:
    """The RL loop. Research surface: the order of rollout, audit, train, refit and eval below is the algorithm's
    schedule; the math lives in estimators.py and losses.py, the token capture needs no edit for a new schedule.
    `generator`: engines started with this cfg's --vllm.* and --rollout.* flags, at the trainer's start weights and
    version, that the run uses and leaves running (runs sharing them: their generator/* counters keep counting)."""
    launch, data, ev = cfg["launch"], cfg["data"], cfg["eval"]
    run = await start_rl(cfg, generator)  # engines, trainer ranks, agent workers, the queue, the log, baseline eval
    generator, trainer, queue, clock, metrics = run.generator, run.trainer, run.queue, Clock(), {}
    for step in range(trainer.step, launch.steps):
        # --- rollout: a batch of finished groups (the trainer idles while it waits)
        clock.start()
        groups = await queue.next_batch(launch.batch_prompts, capacity=run.capacity, filter_range=data.filter_range,
                                        min_version=trainer.version - launch.max_staleness,
                                        max_filtered=data.max_filtered_batches * launch.batch_prompts,
                                        partial=launch.partial_rollout)
        segments = [s for g in groups for s in g["segments"]]
        clock.waited(len(queue.tasks) + queue.done.qsize())  # groups sampling or finished, beyond this batch
        # --- audit: every trained token is the id, log-prob and version the generator returned (else it raises)
        audit(segments)
        metrics = rollout_metrics(segments, trainer.version, launch.max_staleness)
        if metrics["rollout/constrained_tokens"] and not cfg["loss"].importance_correction:
            raise ValueError("constrained decoding (tool_choice required or named, a JSON format) samples a masked "
                             "distribution, not the trainer's: set --loss.is_level token, or --chat.refuse_constrained")
        metrics["rollout/group_s"] = sorted(g["seconds"] for g in groups)[len(groups) // 2]  # median launch-to-finish
        # --- train one step (in a thread: finished groups keep arriving meanwhile)
        with clock.phase("train"):
            metrics.update(await asyncio.to_thread(trainer.train_step, segments,
                                                   data_position=queue.checkpoint_position()))
        # --- refit: without partial rollouts, in-flight groups finish on the old weights first
        with clock.phase("drain"):
            if not launch.partial_rollout:
                await queue.drain()
        with clock.phase("refit"):
            metrics.update(await refit(generator, trainer))
        probe = None
        if "loss/vllm_kl" not in metrics:  # mismatch is measured every step, K > 0 included
            probe = asyncio.create_task(probe_mismatch(generator, trainer, segments))
            await asyncio.sleep(0)  # it submits its requests now, ahead of the next groups: it never waits behind them
        if step + 1 < launch.steps:
            queue.fill(run.capacity)  # the engines sample the next groups while the probe, eval and logging run
            clock.filled = time.perf_counter()
        if probe is not None:
            metrics.update(await probe)
        # --- eval, log
        if ev.every and (step + 1) % ev.every == 0:
            metrics.update(await evaluate(run.workers, run.held_out, ev.prompts))
        metrics.update(await end_step(run, clock, metrics["rollout/action_tokens"]))  # baseline, timings, counters
        run.log.log(step, metrics)
    return await stop_rl(run, metrics)


def run_sft(cfg: dict) -> dict:
    """Token NLL on the assistant turns of chat examples (--data.path: JSONL of messages, or rows("sft"))."""
    launch, train = cfg["launch"], cfg["train"]
    examples = load_rows(cfg["data"].path, "sft")
    template = ChatTemplate(launch.model, append_roles=())   # a VLM's expands an example's images
    segments = sft_batch(examples, template.tokenizer, template=template)
    check_placement(launch.placement, [(r, float(torch.cuda.is_available())) for r in range(train.world_size)],
                    ray.nodes())  # TrainerGroup's GPUs per rank
    trainer = TrainerGroup(launch.model, train, cfg["fsdp"], cfg["ckpt"], cfg["loss"], cfg["estimator"],
                           temperature=cfg["rollout"].temperature,
                           rank_options=[node_options(launch.placement, r) for r in range(train.world_size)])
    log = MetricsLog(cfg, trainer.step)
    order, metrics = random.Random(launch.seed).sample(range(len(segments)), len(segments)), {}
    for step in range(trainer.step, launch.steps):
        start = step * launch.batch_prompts
        batch = [segments[order[(start + i) % len(order)]] for i in range(launch.batch_prompts)]
        metrics = trainer.sft_step(batch, data_position={"index": start + launch.batch_prompts})
        log.log(step, metrics)
    hf = os.path.join(launch.out_dir, "hf")
    trainer.export_hf(hf)
    path = trainer.final_checkpoint({"index": launch.steps * launch.batch_prompts})
    trainer.shutdown()
    log.close()
    return {"metrics": metrics, "checkpoint": path, "hf": hf, "out_dir": launch.out_dir}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    # "local": a new instance even where another job's Ray runs on this machine (address=None would join that one)
    ray.init(address=cfg["launch"].ray_address or "local", include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        out = run_sft(cfg) if cfg["launch"].mode == "sft" else asyncio.run(run_rl(cfg))
    finally:
        ray.shutdown()
    print(f"metrics: {os.path.join(out['out_dir'], 'metrics.jsonl')}")
    for key in ("hf", "checkpoint"):
        if out.get(key):
            print(f"{key}: {out[key]}")
    return out


# === machinery: the parser, the queue, set-up and teardown, placement, sinks; read it when you change one of them
# --- flags: one parser composed from the dataclasses
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Verbatim: agentic RL that trains only on tokens it generated.")
    for prefix, cls in SECTIONS.items():
        group = parser.add_argument_group(f"--{prefix}.*  ({cls.__name__})")
        for f in dataclasses.fields(cls):
            meta, extra, args = f.metadata, {}, typing.get_args(f.type)
            optional = isinstance(f.type, types.UnionType) and type(None) in args
            kind = next(a for a in args if a is not type(None)) if optional else f.type
            if kind is bool:  # --x / --no-x
                extra["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(kind) is tuple:  # tuple[float, float]: exactly 2 values; tuple[str, ...]: 1 or more
                inner = typing.get_args(kind)
                kind, extra["nargs"] = inner[0], "+" if inner[-1] is ... else len(inner)
            if kind is not bool:   # a choice flag's --help lists its choices, any other names its value
                extra["type"] = (lambda text, k=kind: None if text.lower() == "none" else k(text)) if optional else kind
                extra.update({"choices": meta["choices"]} if "choices" in meta else {"metavar": f.name.upper()})
            group.add_argument(f"--{prefix}.{f.name}", dest=f"{prefix}.{f.name}", default=f.default,
                               help=f"{meta['help']} (default: {f.default})", **extra)
    return parser


def parse_args(argv: list[str] | None = None) -> dict:
    """Flags -> {prefix: dataclass instance}; a rule broken inside a dataclass exits with its message."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    try:
        cfg = {p: cls(**{f.name: tuple(v) if isinstance(v := ns[f"{p}.{f.name}"], list) else v
                         for f in dataclasses.fields(cls)}) for p, cls in SECTIONS.items()}
        if cfg["vllm"].dtype == "auto" and cfg["fsdp"].param_dtype != "float32":  # the engines compute in the
            cfg["vllm"] = dataclasses.replace(cfg["vllm"], dtype=cfg["fsdp"].param_dtype)  # trainer's dtype
        check_cross_flags(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def check_cross_flags(cfg: dict) -> None:
    """Rules that span two files' flags; each names the flags to change."""
    launch, train, loss, rollout = cfg["launch"], cfg["train"], cfg["loss"], cfg["rollout"]
    if (launch.max_staleness > 0 or launch.partial_rollout) and not loss.importance_correction:
        raise ValueError(f"--launch.max_staleness {launch.max_staleness} / --launch.partial_rollout with "
                         "--loss.is_level off: stale tokens need an importance correction; set --loss.is_level token")
    in_flight, window = launch.in_flight, launch.batch_prompts * (launch.max_staleness + 1)
    if in_flight and not (launch.batch_prompts <= in_flight and (in_flight <= window or launch.partial_rollout)):
        raise ValueError(f"--launch.in_flight {in_flight}: must be >= --launch.batch_prompts; above {window} = that x "
                         "(--launch.max_staleness + 1) only with --launch.partial_rollout (each refit waits for all)")
    if launch.max_staleness == 0 and launch.partial_rollout and in_flight > launch.batch_prompts:
        raise ValueError(f"--launch.in_flight {in_flight} > --launch.batch_prompts with --launch.partial_rollout and "
                         "--launch.max_staleness 0: groups sampling across a refit would train 1-version-old tokens; "
                         "set --launch.max_staleness 1 or lower --launch.in_flight")
    longest = cfg["vllm"].max_model_len  # a chat segment's bound; an Env episode's is --agent.max_context if lower
    if launch.mode == "rl" and train.max_tokens_per_microbatch < longest:
        raise ValueError(f"--vllm.max_model_len {longest} with --train.max_tokens_per_microbatch "
                         f"{train.max_tokens_per_microbatch}: such an episode fits no microbatch; raise the microbatch "
                         f"bound or lower max_model_len (an Env agent stops at --agent.max_context "
                         f"{cfg['agent'].max_context})")
    vllm, k = cfg["vllm"], launch.max_staleness
    if vllm.max_lora_rank and launch.partial_rollout and vllm.max_loras < k + 2:
        raise ValueError(f"--launch.partial_rollout with LoRA engines (--vllm.max_lora_rank), --launch.max_staleness "
                         f"{k}: a request keeps its adapter to its end, so a refit finds those of up to K + 1 versions "
                         f"still sampling beside the new one; vLLM batches --vllm.max_loras {vllm.max_loras} and the "
                         f"newest policy's requests wait: set --vllm.max_loras {k + 2}")
    if train.routing_replay and not vllm.return_routed_experts:
        raise ValueError("--train.routing_replay without --vllm.return_routed_experts: the engine records no "
                         "routing to replay; set --vllm.return_routed_experts")
    rollout.check_logprobs_usable(importance_correction=loss.importance_correction, kl_to_rollout=loss.kl_to_rollout)
    cfg["vllm"].check_trainer(cfg["fsdp"].param_dtype, cfg["fsdp"].compile_logprobs, train.lora_rank)
    if not launch.model:
        raise ValueError("--launch.model is required: a Hugging Face model directory (recipes/tiny_model.py makes one)")


# --- the queue: prompt groups in flight on the agent workers, admitted into batches, and the data position
class GroupQueue:
    def __init__(self, workers: list, rows: list[dict], samples: int, position: dict, seed: int, groups: int):
        """position: the data order's next (epoch, index), and "pending", the positions a checkpoint saw launched
        but not trained, re-issued first. groups: how many groups the remaining steps train."""
        self.workers, self.rows, self.samples, self.seed = workers, rows, samples, seed
        self.position = {"epoch": position["epoch"], "index": position["index"]}
        self.reissue = [tuple(p) for p in position.get("pending", [])]  # (epoch, index): sampled again, fresh
        self.to_launch = groups - len(self.reissue)  # new positions still needed: no group is sampled in vain
        self.pending: dict[str, tuple] = {}  # group id -> (epoch, index): launched, not yet trained or dropped
        self.order: tuple[int, list[int]] = (-1, [])  # (epoch, its row order)
        self.tasks, self.done, self.launched, self.kept = set(), asyncio.Queue(), 0, 0
        self.counts = {f"dropped_{k}": 0 for k in ("agent_error", "timeout", "tainted", "filtered", "stale")}  # run
        self.counts.update(scored_agent_error=0, scored_timeout=0)  # totals; scored: --agent.failed_reward's
        self.errors: list[str] = []
        self.idle_since, self.engine_idle_s = time.perf_counter(), 0.0
        self.logged = (dict(self.counts), 0.0)  # the totals at the last step_metrics
        self.finished: dict[str, float] = {}  # episode id -> reward, of every group finished since then

    def launch(self) -> None:
        """Start a group: a re-issued position first, else the data order's next (epoch, index 1-based)."""
        if not self.tasks:  # engines were idle since the last group finished
            self.engine_idle_s += time.perf_counter() - self.idle_since
        if self.reissue:
            epoch, index = self.reissue.pop(0)
        else:
            p = self.position
            if p["index"] >= len(self.rows):
                p["epoch"], p["index"] = p["epoch"] + 1, 0
            p["index"] += 1
            self.to_launch -= 1
            epoch, index = p["epoch"], p["index"]
        if self.order[0] != epoch:  # the epoch's seeded order, drawn once per epoch, not once per group
            self.order = (epoch, random.Random(self.seed + epoch).sample(range(len(self.rows)), len(self.rows)))
        group_id = f"e{epoch}i{index}"
        self.pending[group_id] = (epoch, index)
        worker = self.workers[self.launched % len(self.workers)]
        self.tasks.add(asyncio.create_task(self.run(worker, self.rows[self.order[1][index - 1]], group_id)))
        self.launched += 1

    def checkpoint_position(self) -> dict:
        """What a checkpoint saves now: a resume trains each untrained position once (in-flight ones re-issued)."""
        pending = sorted(set(self.pending.values()) | set(self.reissue))
        return {**self.position, "pending": [list(p) for p in pending]}

    async def run(self, worker, row: dict, group_id: str) -> None:
        try:
            await self.done.put(dict(await worker.run_group.remote(row, group_id, self.samples), id=group_id))
        except Exception as e:  # the worker itself died: the loop re-raises it
            await self.done.put(e)
        finally:
            self.tasks.discard(asyncio.current_task())
            if not self.tasks:
                self.idle_since = time.perf_counter()

    def fill(self, capacity: int, taken: int = 0) -> None:
        """Launch groups while fewer than `capacity` are in flight, queued or `taken`."""
        while len(self.tasks) + self.done.qsize() + taken < capacity and (self.reissue or self.to_launch > 0):
            self.launch()

    async def drain(self) -> None:
        """Wait until every launched group has finished (their results stay queued)."""
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    async def next_batch(self, n: int, *, capacity: int, filter_range: tuple[float, float] | None,
                         min_version: int, max_filtered: int, partial: bool = False) -> list[dict]:
        """n finished groups, launching new ones while fewer than `capacity` are in flight, queued or taken. Replaced
        by a new position: groups whose every episode failed, or filtered by mean reward (over max_filtered of either
        while one batch fills stops the run). Re-issued, so long prompts survive: groups with a token older than
        min_version (`partial`: its newest)."""
        batch, filtered, failed = [], 0, 0
        while len(batch) < n:
            self.fill(capacity, len(batch))
            group = await self.done.get()
            if isinstance(group, Exception):
                raise group
            for kind in ("dropped", "scored"):
                for reason, k in group[kind].items():
                    self.counts[f"{kind}_{reason}"] += k
            self.errors += group["errors"]
            rewards = list({s.episode_id: s.reward for s in group["segments"]}.values())  # each episode once
            position = self.pending.pop(group["id"])
            if not rewards:  # bounded per batch, as filtered groups are: an agent broken mid-run stops it too
                self.to_launch, failed = self.to_launch + 1, failed + 1
                if failed > max_filtered:
                    raise RuntimeError(f"every episode of {failed} groups was dropped while one batch filled, > "
                                       f"--data.max_filtered_batches x --launch.batch_prompts = {max_filtered} "
                                       f"({self.counts}); last errors: {self.errors[-3:]}")
                continue
            self.kept += 1
            self.finished.update((s.episode_id, s.reward) for s in group["segments"])
            if filter_range and not filter_range[0] <= sum(rewards) / len(rewards) <= filter_range[1]:
                self.counts["dropped_filtered"] += 1
                self.to_launch, filtered = self.to_launch + 1, filtered + 1
                if filtered > max_filtered:
                    raise RuntimeError(
                        f"--data.filter_range {filter_range[0]:g} {filter_range[1]:g}: {filtered} groups were filtered "
                        f"for one batch, > --data.max_filtered_batches x --launch.batch_prompts = {max_filtered} (all: "
                        f"{self.counts['dropped_filtered'] / self.kept:.1%} of the {self.kept} groups). Widen the "
                        "range, use data the policy solves only sometimes, or raise --data.max_filtered_batches")
                continue
            versions = [v for s in group["segments"] for v, m in zip(s.versions, s.action_mask) if m]
            # partial: as fresh as its newest token (older ones are corrected per token); else as old as its oldest
            if (max(versions) if partial else min(versions)) < min_version:
                self.counts["dropped_stale"] += 1
                self.reissue.append(position)
                continue
            batch.append(group)
        return batch

    def step_metrics(self) -> dict:
        """Since the last call: episodes dropped by reason, seconds the engines sat idle, and the mean reward of every
        episode of the groups that finished, filtered and stale ones included (unlike rollout/trained_reward_mean)."""
        counts, idle = self.logged
        rewards = list(self.finished.values())
        out = {f"rollout/{k}": float(v - counts[k]) for k, v in self.counts.items()}
        out.update({"launch/engine_idle_s": self.engine_idle_s - idle,
                    "rollout/reward_mean": sum(rewards) / max(len(rewards), 1)})
        self.logged, self.finished = (dict(self.counts), self.engine_idle_s), {}
        return out


# --- run_rl's set-up, teardown and clock; Ray placement
async def start_rl(cfg: dict, shared: Generator | None = None) -> types.SimpleNamespace:
    """run_rl's set-up: engines (or `shared`), trainer ranks (a resume refits the engines), workers, queue, log,
    baseline eval."""
    launch, data, train, rollout, vllm = cfg["launch"], cfg["data"], cfg["train"], cfg["rollout"], cfg["vllm"]
    rows = load_rows(data.path, "train")
    held_out = load_rows(data.path, "test") if cfg["eval"].every else []
    engine_gpus, rank_gpus = gpu_shares(launch, train, vllm)
    gpus = engine_gpus["num_gpus"] if engine_gpus else vllm.tensor_parallel_size if rank_gpus else 0  # as Generator
    actors = [(0, gpus)] * vllm.num_engines + [(r, rank_gpus or 0.0) for r in range(train.world_size)]
    check_placement(launch.placement, actors, ray.nodes())  # before any actor starts (Ray would wait on it silently)
    engines = lambda: Generator(launch.model, vllm, rollout,
                                actor_options={**(engine_gpus or {}), **node_options(launch.placement, 0)})
    ranks = lambda: TrainerGroup(launch.model, train, cfg["fsdp"], cfg["ckpt"], cfg["loss"], cfg["estimator"],
                                 temperature=rollout.temperature, gpus_per_rank=rank_gpus, colocated=launch.colocate,
                                 batch_invariant=vllm.batch_invariant,
                                 rank_options=[node_options(launch.placement, r) for r in range(train.world_size)])
    if shared is not None:  # engines started before this run: they must be what this cfg would have started
        if (shared.vllm, shared.rollout) != (vllm, rollout):
            raise ValueError("run_rl's generator was started with other --vllm.* / --rollout.* flags than this run's: "
                             "start one with this run's flags, or pass none")
        generator, trainer = shared, await asyncio.to_thread(ranks)
    elif launch.colocate:  # one GPU: the engines first, as vLLM sizes its KV cache by the memory free when it profiles
        generator, trainer = engines(), ranks()
    else:  # devices of their own (or CPU): both start at once, each in a thread (their start-up blocks)
        generator, trainer = await start_together(engines, ranks)
    if trainer.version != generator.version:  # resumed: the engines start from the checkpoint's weights
        await refit(generator, trainer)
    worker_class = ray.remote(num_cpus=0)(AgentWorker)
    workers = [worker_class.options(**node_options(launch.placement, i)).remote(
        cfg["agent"], cfg["chat"], generator, launch.model) for i in range(launch.workers)]
    await asyncio.gather(*(w.start.remote() for w in workers))
    queue = GroupQueue(workers, rows, launch.samples_per_prompt, trainer.data_position or {"epoch": 0, "index": 0},
                       launch.seed, groups=(launch.steps - trainer.step) * launch.batch_prompts)
    log = MetricsLog(cfg, trainer.step)
    # K=0: nothing is sampled while training; with partial rollouts --launch.in_flight may keep more groups going
    capacity = launch.in_flight or launch.batch_prompts * (launch.max_staleness + 1)
    before = {}
    if cfg["eval"].every and cfg["eval"].before and trainer.step == 0:  # the baseline every later eval compares with
        before["eval/before_reward_mean"] = (await evaluate(workers, held_out, cfg["eval"].prompts))["eval/reward_mean"]
    return types.SimpleNamespace(generator=generator, trainer=trainer, workers=workers, queue=queue, log=log,
                                 held_out=held_out, capacity=capacity, before=before, out_dir=launch.out_dir,
                                 shared=shared is not None)


async def start_together(*makers):
    """Each maker() in a thread of its own, at once; if one fails, the others' objects are shut down and it raises."""
    made = await asyncio.gather(*(asyncio.to_thread(make) for make in makers), return_exceptions=True)
    if failed := [x for x in made if isinstance(x, BaseException)]:
        for x in made:
            if not isinstance(x, BaseException):
                await x.shutdown() if asyncio.iscoroutinefunction(x.shutdown) else x.shutdown()
        raise failed[0]
    return made


async def end_step(run: types.SimpleNamespace, clock: "Clock", action_tokens: float) -> dict:
    """A step's last metrics: the baseline eval's (first step only), the clock's, the queue's, the counters'."""
    counters = {**(await run.generator.metrics()),
                **chat_counters(await asyncio.gather(*(w.metrics.remote() for w in run.workers)))}
    before, run.before = run.before, {}
    return {**before, **clock.metrics(action_tokens), **run.queue.step_metrics(), **counters}


async def stop_rl(run: types.SimpleNamespace, metrics: dict) -> dict:
    """run_rl's teardown: the final checkpoint, then the workers, engines (unless shared) and ranks end."""
    path = run.trainer.final_checkpoint(run.queue.checkpoint_position())
    await run.queue.drain()
    for w in run.workers:
        await w.stop.remote()
    if not run.shared:
        await run.generator.shutdown()
    run.trainer.shutdown()
    run.log.close()
    return {"metrics": metrics, "checkpoint": path, "out_dir": run.out_dir, "errors": run.queue.errors}


class Clock:
    """run_rl's timings: the step's start, its rollout wait, its phases' seconds, the engines' last fill."""

    def __init__(self):
        self.filled = time.perf_counter()

    def start(self) -> None:
        self.t0, self.seconds = time.perf_counter(), {}

    def waited(self, in_flight: int) -> None:
        now = time.perf_counter()
        self.wait_s, self.since_refit_s, self.in_flight = now - self.t0, now - self.filled, in_flight

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start

    def metrics(self, action_tokens: float) -> dict:
        step_s = time.perf_counter() - self.t0  # the whole cycle: the next step starts now
        train_s, drain_s, refit_s = self.seconds["train"], self.seconds["drain"], self.seconds["refit"]
        return {"launch/step_s": step_s, "launch/rollout_wait_s": self.wait_s,
                "launch/since_refit_s": self.since_refit_s,  # K=0: the whole rollout phase
                "launch/groups_in_flight": float(self.in_flight), "launch/tokens_per_s": action_tokens / step_s,
                "launch/train_s": train_s, "launch/drain_s": drain_s, "launch/refit_s": refit_s,
                "launch/trainer_idle_s": self.wait_s + drain_s + refit_s}  # waiting on groups and engines


def chat_counters(per_worker: list[dict]) -> dict:
    """Every worker's chat/* metrics in one row: counts summed over the workers' servers; latency percentiles
    (chat/overhead_ms_p*) do not add, so they take the slowest worker's."""
    out = {}
    for metrics in per_worker:
        for k, v in metrics.items():
            out[k] = max(out.get(k, v), v) if k.startswith("chat/overhead_ms_p") else out.get(k, 0) + v
    return out


def gpu_shares(launch: LaunchArgs, train: TrainArgs, vllm: VllmArgs) -> tuple[dict | None, float | None]:
    """Ray GPU requests of (each engine, each trainer rank): with --launch.colocate half of one GPU for the rank, the
    other half split between the engines; else the engines' default (their GPUs if the cluster has any) and one whole
    GPU per rank, checked to fit."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if launch.colocate:
        if train.world_size > 1 or vllm.tensor_parallel_size > 1:
            raise ValueError("--launch.colocate shares one GPU between one trainer rank and the engines: set "
                             "--train.world_size 1 and --vllm.tensor_parallel_size 1, or drop it")
        if not gpus:
            raise ValueError("--launch.colocate: the Ray cluster has no GPUs to share; drop the flag")
        return {"num_gpus": int(5000 / vllm.num_engines) / 10000}, 0.5  # Ray counts a GPU in 1e-4 steps: round down
    engine_gpus = vllm.num_engines * vllm.tensor_parallel_size
    if gpus and train.world_size + engine_gpus > gpus:
        raise ValueError(f"--train.world_size {train.world_size} + --vllm.num_engines x tensor_parallel_size "
                         f"{engine_gpus} > the cluster's {gpus:g} GPUs: lower them, or set --launch.colocate (one GPU)")
    return None, (1.0 if gpus else None)  # by the cluster, not this driver: it may have no GPU


def node_options(placement: tuple[str, ...], i: int) -> dict:
    """Ray options that put actor i of a kind on node i mod N of --launch.placement (check_placement: it fits)."""
    return {"resources": {placement[i % len(placement)]: 1}} if placement else {}


def check_placement(placement: tuple[str, ...], gpus: list[tuple[int, float]], nodes: list[dict]) -> None:
    """Raise unless each --launch.placement resource is on a live node of `nodes` (ray.nodes()) with the GPUs of the
    actors node_options sends it; gpus: (i, GPUs) for each actor i. Else Ray would wait for them forever, silently."""
    if not placement:
        return
    live = [n["Resources"] for n in nodes if n["Alive"]]
    if missing := [name for name in placement if not any(name in r for r in live)]:
        raise ValueError(f"--launch.placement {' '.join(missing)}: no node of the Ray cluster has that resource; start "
                         f"each node with `ray start --resources '{{\"NAME\": 100}}'`, or drop the flag")
    need = dict.fromkeys(placement, 0.0)
    for i, g in gpus:
        need[placement[i % len(placement)]] += g
    for name, g in need.items():
        if g > (have := sum(r.get("GPU", 0.0) for r in live if name in r)):
            raise ValueError(f"--launch.placement {name}: its node has {have:g} GPUs, its actors need {g:g} "
                             f"(the engines and trainer rank 0 go on the first name, rank i on name i mod "
                             f"{len(placement)}); put a node with more GPUs first, or lower --vllm.num_engines, "
                             "--vllm.tensor_parallel_size or --train.world_size")


def probe_segments(prompts: list[list[int]], outs: list, images: list[list]) -> list[Segment]:
    """The probe's rows: prompt + sampled Completion, with the engine's routing for --train.routing_replay to replay."""
    return [Segment(token_ids=p + o.token_ids, action_mask=[False] * len(p) + [True] * len(o.token_ids),
                    logprobs=[0.0] * len(p) + o.logprobs, versions=[-1] * len(p) + o.versions, images=i,
                    routed_experts=None if o.routed_experts is None else
                    segment_routing(o.routed_experts, len(p) + len(o.token_ids)))
            for p, o, i in zip(prompts, outs, images)]


# --- data and metrics: rows from files; metrics.jsonl always, TensorBoard and W&B when asked, a progress line
def load_rows(path: str, split: str) -> list[dict]:
    """Rows of a split: a .py file's rows(split), or a JSONL / parquet file (the same rows for every split)."""
    if path.endswith(".py"):
        return load_module(path, "rows", "--data.path").rows(split)
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.endswith(".parquet"):
        import datasets  # heavy; only parquet needs it
        return list(datasets.load_dataset("parquet", data_files=path, split="train"))
    raise ValueError(f"--data.path {path}: expected a .py, .jsonl or .parquet file")


class MetricsLog:
    def __init__(self, cfg: dict, first_step: int):
        """A run starting at first_step (a resume's checkpoint) replaces the rows from that step on, which the
        previous run may have logged past its last checkpoint: in metrics.jsonl and, by purge_step, in TensorBoard."""
        launch = cfg["launch"]
        os.makedirs(launch.out_dir, exist_ok=True)
        path, kept = os.path.join(launch.out_dir, "metrics.jsonl"), []
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] < first_step]
        self.file = open(path, "w")
        self.file.writelines(kept)
        self.logged, self.start, self.total = 0, time.time(), launch.steps
        tb = os.path.join(launch.out_dir, "tb")
        self.tb = SummaryWriter(tb, purge_step=first_step) if launch.tensorboard else None
        self.wandb = None
        if launch.wandb_project:
            import wandb  # optional dependency, asked for by the flag; the logged config is the parsed one
            self.wandb = wandb.init(project=launch.wandb_project, config={p: vars(a) for p, a in cfg.items()})

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": time.time() - self.start, **metrics}
        self.logged += 1
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()  # SummaryWriter holds up to 10 events (2 min) and drops them at exit
        if self.wandb:
            self.wandb.log(metrics, step=step)
        done = step + 1
        eta = (time.time() - self.start) / self.logged * (self.total - done)
        bar = "#" * int(20 * done / self.total)
        shown = (f"reward {metrics['rollout/reward_mean']:.3f}" if "rollout/reward_mean" in metrics
                 else f"nll {metrics.get('loss/sft_nll', float('nan')):.3f}")
        tok_s = metrics.get("launch/tokens_per_s", metrics.get("train/tokens_per_s", 0.0))
        print(f"\rstep {done:>4}/{self.total} [{bar:<20}] {shown} tok/s {tok_s:7.1f} eta {eta:5.0f}s",
              end="\n" if done == self.total else "", flush=True)

    def close(self) -> None:
        """The run's end: W&B writes its history only once its run finishes (a next wandb.init in this process
        would otherwise hand back this run); a resume logs to a new W&B run."""
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


if __name__ == "__main__":
    main()
