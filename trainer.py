"""Trainer: the one FSDP2 policy actor. Load, shard, recompute log-probs, train, export for refit, checkpoint.

Shapes: B rows (segments), T tokens (the longest row of the batch or microbatch), V vocabulary.
Contract: TrainerGroup(model_path, train, fsdp, ckpt, loss, estimator, temperature=...) starts --train.world_size Ray
actors, one rank each, in one process group (gloo on CPU, NCCL on GPU). train_step(segments) -> metrics: one RL step;
sft_step: token NLL on the action tokens; logprobs -> [(T,)] under logits / temperature; refit(generator): the weights
into a paused Generator from rank 0 (on GPU they never leave it); save/load/--ckpt.resume: torch.distributed.checkpoint.
Ranks derive the same plan, advantages and loss denominators from the whole batch; besides the model's collectives
they only all-reduce the no-grad pass's rows (a gather) and each step's loss. Qwen3-MoE trains as NeMo's MoE class
(only it: --fsdp.ep_size, --train.routing_replay; no TP), others as their HF class; --train.lora_rank: NeMo's LoRA,
the rest frozen. Not here: sampling, the refit transport (generator.py), advantage and loss math (estimators.py,
losses.py), the loop (launch.py), context parallelism. Reading order: flags, pure functions, TrainerRank.train_step;
below the banner: the driver (TrainerGroup), input checks, loading (a VLM, LoRA), refit, HF export, checkpoints."""
import asyncio
import functools
import glob
import json
import math
import os
import random
import re
import shutil
import socket
import time
import types
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForTokenClassification, AutoProcessor)
from transformers.core_model_loading import revert_weight_conversion

from estimators import EstimatorArgs, compute_advantages, rollout_facts
from generator import Segment, decode_image
from losses import (Denoms, LossArgs, compute_policy_loss, compute_value_loss, sft_loss, step_denoms,
                    step_tokens)

SCHEDULES = ("constant", "cosine")
OFFLOADS = ("none", "optimizer")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # attention + MLP
PEER_DEATH_S = 30.0  # Ray sees a killed rank's socket close at once, a vanished node after 5 x 3 s health checks
PEFT_PREFIX = "base_model.model."  # peft's names for a LoRA model's tensors: this + the module's own name
PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12}  # dense bf16 FLOP/s of the SXM cards: train/mfu
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt)$|.*\.safetensors\.index\.json$")  # not copied into an HF export


@dataclass
class TrainArgs:
    lr: float = field(default=1e-5, metadata={"help": "AdamW peak learning rate of the policy"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear warmup: lr/warmup_steps to lr"})
    schedule: str = field(default="constant", metadata={"help": "learning rate after warmup", "choices": SCHEDULES})
    total_steps: int | None = field(default=None, metadata={
        "help": "optimizer step (epochs x minibatches per train step) at which --train.schedule cosine reaches 0"})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "AdamW beta1 beta2"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay"})
    grad_clip: float | None = field(default=1.0, metadata={"help": "clip the global grad norm to this; None = no clip"})
    epochs: int = field(default=1, metadata={"help": "passes over each batch (PPO-style reuse)"})
    minibatches: int = field(default=1, metadata={"help": "optimizer steps per pass, one per slice of the batch"})
    max_tokens_per_microbatch: int = field(default=4096, metadata={"help": "per-forward bound on rows x longest row"})
    world_size: int = field(default=1, metadata={"help": "trainer ranks (Ray actors), one process group"})
    critic_lr: float | None = field(default=None, metadata={
        "help": "AdamW lr of the critic (a value head on a model copy); set iff --estimator.name gae"})
    routing_replay: bool = field(default=False, metadata={"help": "Qwen3-MoE: forwards replay Segment.routed_experts"})
    freeze_vision: bool = field(default=False, metadata={
        "help": "VLM: the vision tower keeps its loaded weights (no grad, no AdamW state, no refit); the rest trains"})
    lora_rank: int = field(default=0, metadata={
        "help": "LoRA rank r: train only low-rank adapters on --train.lora_targets, the base frozen; 0 = every weight"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA: an adapter adds (alpha / rank) B A x"})
    lora_targets: tuple[str, ...] = field(default=LORA_TARGETS, metadata={
        "help": "LoRA: the linear modules (last name) that get an adapter"})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA: dropout on an adapter's input, in the loss forward only (the engine and no-grad passes: none)"})
    seed: int = field(default=0, metadata={"help": "torch / python / numpy seed of every rank"})
    pack: bool = field(default=False, metadata={
        "help": "GPU: each microbatch is one row of max_tokens_per_microbatch, its segments end to end (first fit), "
                "attention kept within each by flex_attention; its first forward compiles for minutes at start"})

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--train.schedule {self.schedule!r}: unknown; choose one of {', '.join(SCHEDULES)}")
        if not self.lr >= 0.0 or (self.critic_lr is not None and not self.critic_lr > 0.0):
            raise ValueError(f"--train.lr {self.lr} / --train.critic_lr {self.critic_lr}: "
                             "lr must be >= 0 and critic_lr > 0 (or None)")
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"--train.schedule cosine with --train.total_steps {self.total_steps}: cosine decays to 0 "
                             f"at total_steps, which must exceed --train.warmup_steps {self.warmup_steps}; set it")
        if self.schedule == "constant" and self.total_steps is not None:
            raise ValueError("--train.total_steps with --train.schedule constant: only cosine reads it; unset it or "
                             "set --train.schedule cosine")
        if not all(0.0 <= b < 1.0 for b in self.betas) or self.weight_decay < 0.0:
            raise ValueError(f"--train.betas {self.betas} / --train.weight_decay {self.weight_decay}: "
                             "betas must be in [0, 1), weight_decay >= 0")
        if self.grad_clip is not None and not self.grad_clip > 0.0:
            raise ValueError(f"--train.grad_clip {self.grad_clip}: must be > 0, or None for no clipping")
        if min(self.epochs, self.minibatches, self.max_tokens_per_microbatch, self.world_size) < 1 or \
                self.warmup_steps < 0:
            raise ValueError("--train.epochs, --train.minibatches, --train.max_tokens_per_microbatch, "
                             "--train.world_size must be >= 1; --train.warmup_steps >= 0")
        if self.lora_rank < 0 or not self.lora_alpha > 0 or not 0 <= self.lora_dropout < 1 or not self.lora_targets:
            raise ValueError(f"--train.lora_rank {self.lora_rank} / --train.lora_alpha {self.lora_alpha} / "
                             f"--train.lora_dropout {self.lora_dropout} / --train.lora_targets {self.lora_targets}: "
                             "need rank >= 0, alpha > 0, dropout in [0, 1) and at least one target")
        defaults = TrainArgs.lora_alpha, TrainArgs.lora_targets, TrainArgs.lora_dropout
        if not self.lora_rank and (self.lora_alpha, self.lora_targets, self.lora_dropout) != defaults:
            raise ValueError("--train.lora_alpha / --train.lora_targets / --train.lora_dropout with --train.lora_rank 0"
                             ": they shape an adapter; rank 0 trains every weight. Set --train.lora_rank or drop them")
        if self.pack and self.routing_replay:
            raise ValueError("--train.pack with --train.routing_replay: replay reads the recorded experts per (row, "
                             "token) of the padded microbatch, not of the packed row; leave one off")


@dataclass
class FsdpArgs:
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks (NeMo AutoModel's plan: heads, MLP and "
                                                      "vocab split); must divide world_size"})
    ep_size: int = field(default=1, metadata={"help": "expert-parallel ranks (Qwen3-MoE); must divide world_size"})
    offload: str = field(default="none", metadata={
        "help": "optimizer: FSDP2 CPUOffloadPolicy: params, grads, AdamW in host memory (GPU)", "choices": OFFLOADS})
    param_dtype: str = field(default="float32", metadata={
        "help": "forward/backward dtype; master weights and AdamW state stay float32; float16 scales the loss "
                "(dynamic); the engines compute in it too unless --vllm.dtype is set", "choices": PARAM_DTYPES})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute layer activations in backward"})
    compile_logprobs: bool = field(default=True, metadata={"help": "GPU: torch.compile log-probs into fused passes"})
    compile_layers: bool = field(default=False, metadata={
        "help": "GPU: torch.compile each decoder layer's forward (fused norms, rotary, SwiGLU; FSDP's hooks stay "
                "outside): 1.55x the 0.6B shape's step (bench_gpu trainer_compiled); the first step compiles"})
    logprob_chunk: int = field(default=4096, metadata={
        "help": "tokens at a time through the LM head: log-probs and entropy from the hidden states, at the sampled "
                "tokens only (a prompt or tool result costs the head nothing), each chunk's logits made again in "
                "backward, the (tokens x vocabulary) logits never whole; 0: whole logits at every token (as with "
                "--fsdp.tp_size > 1, whose head is split over the vocabulary)"})

    def __post_init__(self):
        if self.offload not in OFFLOADS or self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"--fsdp.offload {self.offload!r} / --fsdp.param_dtype {self.param_dtype!r}: "
                             f"choose from {OFFLOADS} / {PARAM_DTYPES}")
        if min(self.tp_size, self.ep_size) < 1 or self.logprob_chunk < 0:
            raise ValueError("--fsdp.tp_size, --fsdp.ep_size must be >= 1, --fsdp.logprob_chunk >= 0")


@dataclass
class CkptArgs:
    dir: str | None = field(default=None, metadata={"help": "checkpoint root: step_NNNNNN/ directories go here"})
    every: int = field(default=0, metadata={"help": "save after every N train steps; 0 = only when the caller asks"})
    keep: int = field(default=2, metadata={"help": "keep the newest K checkpoints, delete older ones"})
    resume: bool = field(default=False, metadata={"help": "start from the newest complete checkpoint under --ckpt.dir"})
    save_hf: bool = field(default=False, metadata={"help": "also save an HF safetensors directory hf/ per checkpoint"})
    hf_merged: bool = field(default=False, metadata={
        "help": "LoRA: an HF export (hf/, SFT's output) is the model with the adapter merged in, not peft's adapter"})

    def __post_init__(self):
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"--ckpt.every {self.every} / --ckpt.keep {self.keep}: need every >= 0 and keep >= 1")
        if self.dir is None and (self.every > 0 or self.resume or self.save_hf):
            raise ValueError("--ckpt.every / --ckpt.resume / --ckpt.save_hf without --ckpt.dir: "
                             "there is nowhere to write or read; set --ckpt.dir")


# --- pure functions: batch layout, log-probs, schedule, metrics
def collate(segments: list[Segment], moe: tuple[int, int, int] | None = None, vlm: bool = False) -> dict:
    """The whole batch as right-padded (B, T) tensors plus per-row (B,) ones; ValueError names the first bad segment.
    moe = (MoE layers, top_k, experts) adds "routed" (B, T, layers, top_k), -1 unrecorded; vlm: each row's "images"."""
    check_segments(segments)
    B, T = len(segments), max(len(seg.token_ids) for seg in segments)
    ids, mask = np.zeros((B, T), dtype=np.int64), np.zeros((B, T), dtype=bool)  # (B, T)
    rollout_logp, versions = np.zeros((B, T), dtype=np.float32), np.full((B, T), -1, dtype=np.int64)  # (B, T)
    for i, seg in enumerate(segments):  # numpy reads Python lists faster than torch.tensor
        n = len(seg.token_ids)
        ids[i, :n], mask[i, :n] = seg.token_ids, seg.action_mask
        rollout_logp[i, :n], versions[i, :n] = seg.logprobs, seg.versions
    group_index = {g: k for k, g in enumerate(dict.fromkeys(seg.group_id for seg in segments))}
    episode_index = {e: k for k, e in enumerate(dict.fromkeys(seg.episode_id for seg in segments))}
    batch = {"ids": torch.from_numpy(ids), "mask": torch.from_numpy(mask),
             "rollout_logp": torch.from_numpy(rollout_logp), "versions": torch.from_numpy(versions),
             "rewards": torch.tensor([float(seg.reward) for seg in segments]),  # (B,)
             "group_ids": torch.tensor([group_index[seg.group_id] for seg in segments]),  # (B,)
             "episode_ids": torch.tensor([episode_index[seg.episode_id] for seg in segments]),  # (B,)
             "lengths": torch.tensor([len(seg.token_ids) for seg in segments])}  # (B,)
    if moe is not None:  # --train.routing_replay
        batch["routed"] = torch.from_numpy(collate_routing(segments, T, *moe))  # (B, T, layers, top_k)
    if vlm:
        batch["images"] = [[decode_image(data, f"segment {i}: images[{k}]") for k, (*_, data) in enumerate(seg.images)]
                           for i, seg in enumerate(segments)]
    elif any(seg.images for seg in segments):
        raise ValueError("segments carry images, but the model has no vision_config (not a VLM)")
    return batch


def plan_step(lengths: list[int], *, minibatches: int, dp_size: int, max_tokens: int,
              pack: bool = False) -> list[list[list[list[int]]]]:
    """Row indices as [minibatch][dp rank][microbatch]. Minibatches are contiguous slices of the batch; a minibatch's
    rows go longest first to the least-loaded rank, whose microbatches each hold <= max_tokens padded tokens (rows x
    longest row; fuller beats less padded: bench_gpu.py plan), or with pack <= max_tokens tokens end to end (the
    first microbatch with room). All ranks run each forward: short ones get empty ones."""
    if len(lengths) < minibatches:
        raise ValueError(f"--train.minibatches {minibatches}: the batch has only {len(lengths)} segments")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"segment {i}: {n} tokens > --train.max_tokens_per_microbatch {max_tokens}; "
                             "raise the flag or cap the episode length")
    plan = []
    for chunk in torch.arange(len(lengths)).tensor_split(minibatches):
        rows = sorted(chunk.tolist(), key=lambda i: -lengths[i])  # stable: ties keep batch order
        micro, load = [[] for _ in range(dp_size)], [0] * dp_size
        for i in rows:  # longest first, so a microbatch's first row sets its padded length
            r = load.index(min(load))
            load[r] += lengths[i]
            if pack:  # --train.pack: first fit
                fits = [m for m in micro[r] if sum(lengths[j] for j in m) + lengths[i] <= max_tokens]
            else:  # the last microbatch while rows x its first (longest) row fits
                fits = [m for m in micro[r][-1:] if (len(m) + 1) * lengths[m[0]] <= max_tokens]
            if fits:
                fits[0].append(i)
            else:
                micro[r].append([i])
        depth = max(len(m) for m in micro)
        plan.append([m + [[] for _ in range(depth - len(m))] for m in micro])
    return plan


def pad_frac(lengths: list[int], plan: list, packed: int | None = None) -> float:
    """Share of padding in a step's forwards (a microbatch computes rows x longest row, or a packed row of `packed`
    tokens: --train.pack), empty microbatches left out."""
    micros = [micro for minibatch in plan for rank in minibatch for micro in rank if micro]
    positions = sum(packed or len(micro) * max(lengths[i] for i in micro) for micro in micros)
    return 1.0 - sum(lengths[i] for micro in micros for i in micro) / positions


def rows_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, entropy_grad: bool):
    """(N,) log p(targets) under softmax((N, V) logits / temperature), (N,) entropy if asked (else None). Eager: an
    fp32 copy scaled in place and its log-softmax, all backward keeps; compiled (CUDA): two fused passes (logsumexp)."""
    scaled = logits.to(torch.float32) if temperature == 1.0 else logits.to(torch.float32, copy=True).div_(temperature)
    logsm = torch.log_softmax(scaled, dim=-1)  # (N, V)
    logp = logsm.gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    if not entropy:
        return logp, None
    src = logsm if entropy_grad else logsm.detach()
    return logp, -(src.exp() * src).sum(-1)  # (N,): H = -sum_v p log p


def next_ids(ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(ids[:, 1:], (0, 1))  # (B, T): position t predicts t + 1; the last one nothing


def shifted(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x[:, :-1], (1, 0))  # (B, T): t's value moves to t + 1; 0 at t = 0


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, *, entropy: bool, entropy_grad: bool,
                   compiled: bool = False):
    """log p(ids_t | ids_<t) under softmax(logits / temperature) (B, T), and its entropy (B, T) if asked; 0 at t = 0."""
    B, T, V = logits.shape
    fn = compiled_logprobs() if compiled else rows_logprobs
    logp, h = fn(logits.reshape(B * T, V), next_ids(ids).reshape(B * T), temperature, entropy, entropy_grad)
    return shifted(logp.view(B, T)), shifted(h.view(B, T)) if entropy else None


def lr_at(step: int, *, lr: float, warmup_steps: int, schedule: str, total_steps: int | None) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then constant, or cosine to 0 at total_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule not in SCHEDULES:
        raise ValueError(f"--train.schedule {schedule!r}: unknown; choose one of {', '.join(SCHEDULES)}")
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))  # cosine
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


EXTREMES = {"estimator/adv_max": max, "estimator/adv_min": min, "loss/mismatch_max_abs": max, "train/peak_gib": max,
            "train/loss_scale": min, "train/skipped_steps": max}


def merge_metrics(records: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Each key's count-weighted mean over all ranks' (weight, metrics) records; EXTREMES: max/min; all-count-0: 0."""
    out, weights = {}, {}
    for weight, metrics in records:
        for key, value in metrics.items():
            if key not in EXTREMES:  # a count-0 record's value (possibly NaN) never enters the sum
                out[key] = out.get(key, 0.0) + (weight * value if weight > 0 else 0.0)
                weights[key] = weights.get(key, 0.0) + max(weight, 0.0)
            elif weight > 0:
                out[key] = EXTREMES[key](out.get(key, value), value)
    return {k: v / weights[k] if weights.get(k) else v for k, v in out.items()}


def model_flops(config, params: int, lengths: list[int]) -> float:
    """FLOPs to train rows of these lengths once, as PaLM's MFU (https://arxiv.org/abs/2204.02311, appendix B) with
    causal attention: per token 6 N + 6 L T d_attn (N = params, every parameter, a tied head once; L layers; T the
    row's own length; d_attn = heads x head_dim). Recompute under activation checkpointing is not counted."""
    text = config.get_text_config()
    heads, layers = text.num_attention_heads, text.num_hidden_layers
    d_attn = heads * (getattr(text, "head_dim", None) or text.hidden_size // heads)
    return float(sum(T * (6 * params + 6 * layers * T * d_attn) for T in lengths))


def mfu(flops: float, seconds: float, gpus: int, device: str) -> float | None:
    """flops / (seconds x gpus x the device's PEAK_FLOPS); None on any device not in PEAK_FLOPS (CPU, other GPUs)."""
    peak = PEAK_FLOPS.get(device)
    return None if peak is None else flops / (seconds * gpus * peak)


# --- one rank: its shard of the policy (and critic, reference), its optimizers; a Ray actor
class TrainerRank:
    """One trainer rank. The driver (TrainerGroup) calls every method on every rank at once."""

    def __init__(self, rank: int, world_size: int, model_path: str, train: TrainArgs, fsdp: FsdpArgs,
                 ckpt: CkptArgs, loss: LossArgs, estimator: EstimatorArgs, temperature: float):
        self.rank, self.world_size, self.model_path, self.temperature = rank, world_size, model_path, temperature
        self.train, self.fsdp, self.ckpt, self.loss, self.estimator = train, fsdp, ckpt, loss, estimator
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")  # Ray shows each rank its GPU as 0
        if not self.cuda:
            torch.set_num_threads(1)  # ranks share the cores; one thread each is fastest and deterministic
        self.version = 0  # policy version: train steps taken, one refit each (0 = the loaded weights)
        self.optimizer_steps = 0  # AdamW steps (epochs x minibatches per train step): the lr schedule's clock
        self.router = None  # the Generator this rank refits (rank 0)
        self.moe, self.replay = None, None  # --train.routing_replay: (layers, top_k, experts); this forward's ids
        self.head_task = None  # --fsdp.logprob_chunk: (next ids, temperature, entropy, where): install_head
        self.adapted = set()  # --train.lora_rank: the policy's modules that carry an adapter

    def setup(self, master_addr: str, master_port: int) -> str | None:
        """Join the process group, load and shard the models, build the optimizers; returns this rank's Ray node (None
        for a rank built in a process outside Ray, as tests build one: asking Ray there would start a Ray instance)."""
        join_process_group(self, master_addr, master_port)  # also seeds every RNG and builds NeMo's device mesh
        self.model = build_model(self, AutoModelForCausalLM, lora=self.train.lora_rank > 0)
        setup_policy_extras(self)  # a VLM's processor, image_id and blank row; routing replay's moe; fused names
        adamw = lambda params: torch.optim.AdamW(params, lr=0.0, betas=self.train.betas,  # lr: set each step
                                                 weight_decay=self.train.weight_decay, fused=True)  # fused: one kernel
        self.optimizer = adamw([p for p in self.model.parameters() if p.requires_grad])   # --train.freeze_vision, LoRA
        fp16 = self.compute_dtype == torch.float16  # each optimizer's gradients come from its own scaled loss
        self.scaler, self.critic_scaler = (LossScale(fp16, 2.0 ** 16 if fp16 else 1.0) for _ in range(2))
        self.ref = self.critic = self.critic_optimizer = None
        if self.loss.needs_ref_model:
            self.ref = build_model(self, AutoModelForCausalLM).requires_grad_(False)  # the loaded weights, frozen
        if self.train.critic_lr is not None:
            self.critic = build_model(self, AutoModelForTokenClassification, num_labels=1)
            self.critic_optimizer = adamw(self.critic.parameters())
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def autocast(self, model) -> bool:
        """With one dp rank NeMo skips fully_shard, so its mixed-precision cast never happens: autocast such models."""
        return self.compute_dtype != torch.float32 and not isinstance(model, FSDPModule)

    # --- forwards: microbatches of rows, and the no-grad pass that every rank assembles into (B, T)
    def plan(self, batch: dict, minibatches: int) -> list:
        return plan_step(batch["lengths"].tolist(), minibatches=minibatches, dp_size=self.dp_size,
                         max_tokens=self.train.max_tokens_per_microbatch, pack=self.train.pack)

    def packed(self, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """--train.pack: x's rows end to end in one (1, max_tokens_per_microbatch) row (one shape: flex compiles once),
        the rest one filler sequence of id 0; -> its ids, position ids restarting at each sequence (from which
        transformers masks attention to within it), and each (b, t) token's place in it, 0 at t = 0 and padding."""
        lengths, N = x["lengths"].tolist(), self.train.max_tokens_per_microbatch
        t = torch.arange(x["ids"].shape[1], device=self.device)
        real = t < x["lengths"][:, None]  # (b, t)
        ids = torch.zeros(1, N, dtype=x["ids"].dtype, device=self.device)  # (1, N)
        ids[0, :sum(lengths)] = x["ids"][real]  # row-major: row 0's tokens, then row 1's, ...
        pos = torch.cat([torch.arange(n) for n in lengths + [N - sum(lengths)]])[None].to(self.device)  # (1, N)
        index = torch.zeros_like(x["ids"])  # (b, t)
        index[real] = torch.arange(sum(lengths), device=self.device)
        return ids, pos, torch.where(t > 0, index, 0)

    def unpack(self, y: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
        """(1, N) per-token values of a packed row -> (b, t); 0 at t = 0 (its packed place predicts across rows)."""
        return None if y is None else torch.where(index > 0, y[0, index], 0.0)

    def microbatch(self, batch: dict, rows: list[int]) -> dict[str, torch.Tensor]:
        """The rows' tensors cropped to their longest row, a VLM's image inputs, on this device; no rows: one pad."""
        tensors = {k: v for k, v in batch.items() if k != "images"}
        if not rows:
            return {k: torch.full_like(v[:1, :1] if v.ndim >= 2 else v[:1], -1 if k == "routed" else 0).to(self.device)
                    for k, v in tensors.items()}
        width = int(batch["lengths"][rows].max())
        x = {k: (v[rows, :width] if v.ndim >= 2 else v[rows]).to(self.device) for k, v in tensors.items()}
        if "images" in batch and (images := [image for r in rows for image in batch["images"][r]]):
            x["images"] = image_inputs(self, images)
        return x

    def policy_logprobs(self, model, x: dict, temperature: float, *, entropy: bool = False, every: bool = False):
        """(B, T) log-probs of x["ids"] under model's logits / temperature, and (B, T) entropy when asked; MoE layers
        replay x["routed"] (--train.routing_replay); a VLM sees x["images"], or without any the blank row. Through
        the chunked head, only x["mask"]'s tokens (the ones any loss reads) get them, 0 elsewhere, unless `every`."""
        B, T = x["ids"].shape
        ids, images = add_blank_row(self, x["ids"], x.get("images", {}))  # (B, T), or a VLM's (B + 1, T or more)
        pos = index = None
        if self.train.pack:  # one packed row (1, N): its log-probs, then back to (B, T)
            ids, pos, index = self.packed(x)
        self.replay = x.get("routed")  # read by replayed_ids in this forward and in its checkpoint recompute
        chunked = self.fsdp.logprob_chunk > 0 and self.fsdp.tp_size == 1
        if chunked and not getattr(model, "chunked_head", False):
            install_head(self, model)
        where = None  # the positions the head computes: each one that predicts a masked token, or every one
        if chunked and not every:
            where = torch.zeros_like(ids, dtype=torch.bool)
            if index is None:
                where[:B, :T] = next_ids(x["mask"]) > 0  # a VLM's blank row and its wider padding: none
            else:
                where[0, index[x["mask"] > 0] - 1] = True  # a token's packed place follows its predictor's
        self.head_task = (next_ids(ids), temperature, entropy, where) if chunked else None  # read by install_head's
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast(model)):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, **images).logits
        self.head_task = None
        if chunked:  # (B', T', 2): each position's log p of the next id, entropy; on to the id's own position
            out = logits if self.train.pack else logits[:B, :T]
            logp, h = shifted(out[..., 0]), shifted(out[..., 1]) if entropy else None
            return (logp, h) if index is None else (self.unpack(logp, index), self.unpack(h, index))
        if isinstance(logits, DTensor):  # --fsdp.tp_size: NeMo's plan shards the logits over the vocabulary
            logits = logits.full_tensor()
        logits = logits if self.train.pack else logits[:B, :T]  # (B, T, V), or packed (1, N, V)
        if self.image_id is not None:   # a VLM: the engine never samples its image id (banned), nor does the policy
            logits[..., self.image_id] = -1e4   # out of the softmax; -inf would make the entropy's 0 * log 0 NaN
        logp, h = token_logprobs(logits, ids if self.train.pack else x["ids"], temperature, entropy=entropy,
                                 entropy_grad=self.loss.needs_entropy_grad,
                                 compiled=self.cuda and self.fsdp.compile_logprobs)
        return (logp, h) if index is None else (self.unpack(logp, index), self.unpack(h, index))

    def replayed_ids(self, layer: int, live: torch.Tensor) -> torch.Tensor:
        """MoE layer `layer`'s (N, K) expert ids, N = b * t: recorded where >= 0, else live; the gate's softmax keeps
        its gradient. self.replay is bound per microbatch: a checkpoint recompute in backward replays the same ids."""
        if self.replay is None:
            return live
        recorded = self.replay[:, :, layer].reshape(live.shape).long()  # (N, K)
        return torch.where(recorded >= 0, recorded, live)

    def critic_values(self, x: dict) -> torch.Tensor:
        """(B, T) value of the state before each token of x["ids"]: the head's output at the previous position."""
        ids, pos, index = self.packed(x) if self.train.pack else (x["ids"], None, None)
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast(self.critic)):
            out = self.critic(input_ids=ids, position_ids=pos, use_cache=False).logits[..., 0]  # (B, T) or (1, N)
        out = torch.nn.functional.pad(out[:, :-1].float(), (1, 0))  # (B, T) or (1, N)
        return out if index is None else self.unpack(out, index)

    @torch.no_grad()
    def forward_rows(self, model, batch: dict, plan: list, temperature: float = 1.0, entropy: bool = False,
                     every: bool = False):
        """model's log-probs at temperature (the critic's: its values) of this rank's rows, as (B, T) on every rank;
        with entropy: (log-probs, entropy), each (B, T). At masked tokens only, unless `every` (policy_logprobs)."""
        out = torch.zeros((1 + entropy, *batch["ids"].shape), device=self.device)  # (1 or 2, B, T)
        model.eval()  # as the engine: no --train.lora_dropout (config dropout is zeroed at load), no checkpointing
        for minibatch in plan:
            for rows in minibatch[self.dp_rank]:
                x = self.microbatch(batch, rows)
                y = ((self.critic_values(x), None) if model is self.critic  # (b, t), (b, t) or None
                     else self.policy_logprobs(model, x, temperature, entropy=entropy, every=every))
                if not rows:  # this rank's share is empty: it ran a stand-in row for FSDP's collectives only
                    continue
                for k, part in enumerate(y):  # log-probs (the critic's values), then entropy when asked
                    if part is not None:
                        out[k, rows, :part.shape[1]] = part.float()
        model.train()
        dist.all_reduce(out, group=self.dp_group)  # rows are disjoint across dp ranks: the sum is a gather
        return (out[0].cpu(), out[1].cpu()) if entropy else out[0].cpu()

    # --- the train step: one flat sequence
    def train_step(self, segments: list[Segment]) -> tuple[list[tuple[float, dict]], int]:
        """One RL step on the whole batch -> (weight, metrics) records for the driver to merge, the new version."""
        batch = collate(segments, self.moe, vlm=self.processor is not None)  # every rank: the same tensors and plan
        mask = batch["mask"]  # (B, T)
        plan = self.plan(batch, self.train.minibatches)
        packed = self.train.max_tokens_per_microbatch if self.train.pack else None
        records = [(1.0, {"train/pad_frac": pad_frac(batch["lengths"].tolist(), plan, packed)})]
        if "routed" in batch:  # share of the batch's (token, MoE layer) positions whose recorded experts are replayed
            real = torch.arange(mask.shape[1]) < batch["lengths"][:, None]  # (B, T)
            records.append((1.0, {"train/replayed_frac": float((batch["routed"][..., 0] >= 0)[real].float().mean())}))
        # --- no-grad pass: old (proximal) and ref log-probs, values; on-policy in one step, old = new.detach(): skipped
        # (not with --train.lora_dropout: the loss forward's log-probs are noisy, the engine's and old's are not)
        on_policy = (self.train.epochs == 1 and self.train.minibatches == 1 and not self.train.lora_dropout
                     and bool((batch["versions"][mask] == self.version).all()))
        kl = None
        if not on_policy or self.ref is not None:
            batch["old_logp"] = self.forward_rows(self.model, batch, plan, self.temperature)
        if self.ref is not None:
            batch["ref_logp"] = self.forward_rows(self.ref, batch, plan, self.temperature)
            kl = torch.where(mask, batch["old_logp"] - batch["ref_logp"], 0.0)  # (B, T) k1: the estimator's KL reward
        if self.critic is not None:
            batch["values"] = self.forward_rows(self.critic, batch, plan)
        # --- advantages over the whole batch (estimators.py); gae turns the critic's values into returns
        batch["adv"], returns, metrics = compute_advantages(
            self.estimator, batch["rewards"], batch["group_ids"], batch["episode_ids"], mask,
            values=batch.get("values"), kl=kl, facts=rollout_facts(segments))
        if returns is not None:
            batch["returns"] = returns
        records.append((1.0, metrics))
        # --- epochs x minibatches: one optimizer step per minibatch; the critic's pass follows the policy's
        for _ in range(self.train.epochs):
            for minibatch in plan:
                rows = [i for rank_rows in minibatch for micro in rank_rows for i in micro]
                denoms, group_tokens = step_denoms(mask[rows], batch["group_ids"][rows])  # every rank: the same
                if self.loss.needs_batch_stats:  # the loss picks this step's tokens over all its rows (losses.py)
                    logp, entropy = self.forward_rows(self.model, batch, [minibatch], self.temperature, entropy=True)
                    step_mask = torch.zeros_like(mask).index_copy_(0, torch.tensor(rows), mask[rows])  # (B, T)
                    batch["selected"] = step_tokens(self.loss, logp, entropy, batch["adv"], step_mask,
                                                    step=self.optimizer_steps)  # (B, T)
                step_loss = torch.zeros((), device=self.device)
                for micro in minibatch[self.dp_rank]:
                    x = self.microbatch(batch, micro)
                    logp, entropy = self.policy_logprobs(self.model, x, self.temperature, entropy=True)
                    loss, loss_records = compute_policy_loss(
                        self.loss, logp, x.get("old_logp", logp.detach()), x["rollout_logp"], x["adv"], x["mask"],
                        versions=x["versions"], current_version=self.version, denoms=denoms, entropy=entropy,
                        group_tokens=group_tokens.to(self.device)[x["group_ids"]], ref_logp=x.get("ref_logp"),
                        selected=x.get("selected"))
                    # FSDP averages gradients over dp ranks; the shares already sum to the batch loss, so undo it
                    (loss * self.dp_size * self.scaler.scale).backward()
                    step_loss += loss.detach()
                    records += loss_records
                if self.critic is not None:
                    records += self.critic_step(batch, minibatch[self.dp_rank], denoms)
                records.append((1.0, self.policy_step(step_loss)))
        self.version += 1  # one new policy per train step, however many optimizer steps it took
        return records, self.version

    def critic_step(self, batch: dict, micros: list[list[int]], denoms: Denoms) -> list[tuple[float, dict]]:
        """One AdamW step of the critic over this rank's microbatches: it regresses the returns on the action tokens."""
        records = []
        for micro in micros:
            x = self.microbatch(batch, micro)
            v = self.critic_values(x)  # (b, t)
            loss, metrics = compute_value_loss(self.loss, v, x["values"], x["returns"], x["mask"], denoms=denoms)
            (loss * self.dp_size * self.critic_scaler.scale).backward()
            metrics["train/value_mean"] = float((v.detach() * x["mask"]).sum() / x["mask"].sum().clamp(min=1))
            records.append((float(x["mask"].sum()), metrics))
        grad_norm, _ = self.optimizer_step(self.critic, self.critic_optimizer, self.train.critic_lr, self.critic_scaler)
        return records + [(1.0, {"train/critic_grad_norm": grad_norm})]

    def optimizer_step(self, model, optimizer, base_lr: float, scaler: "LossScale") -> tuple[float, float]:
        """Clip model's gradients (of loss x scaler.scale), AdamW at the scheduled lr; -> (norm before clipping, lr)."""
        reduce_parallel_grads(self, model)  # --fsdp.tp_size, --fsdp.ep_size: NeMo's plans leave gradients partial
        grad_norm = clip_grad_norm(list(model.parameters()), self.train.grad_clip, scaler.scale)
        lr = lr_at(self.optimizer_steps, lr=base_lr, warmup_steps=self.train.warmup_steps, schedule=self.train.schedule,
                   total_steps=self.train.total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if scaler.update(math.isfinite(grad_norm)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def policy_step(self, step_loss: torch.Tensor) -> dict[str, float]:
        dist.all_reduce(step_loss, group=self.dp_group)
        grad_norm, lr = self.optimizer_step(self.model, self.optimizer, self.train.lr, self.scaler)
        self.optimizer_steps += 1
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0  # since the rank started
        metrics = {"train/loss": float(step_loss), "train/grad_norm": grad_norm, "train/lr": lr, "train/peak_gib": peak}
        if self.scaler.dynamic:  # float16: the scale after this step, and the steps skipped so far
            metrics.update({"train/loss_scale": self.scaler.scale, "train/skipped_steps": float(self.scaler.skipped)})
        return metrics

    def sft_step(self, segments: list[Segment]) -> tuple[list[tuple[float, dict]], int]:
        """One optimizer step of token NLL on the action tokens at temperature 1; MoE layers route live (unsampled)."""
        batch = collate(segments, vlm=self.processor is not None)
        mask, records, step_loss = batch["mask"], [], torch.zeros((), device=self.device)
        denoms = step_denoms(mask, torch.arange(len(mask)))[0]  # each SFT row is its own group
        for micro in self.plan(batch, 1)[0][self.dp_rank]:
            x = self.microbatch(batch, micro)
            loss, metrics = sft_loss(self.policy_logprobs(self.model, x, 1.0)[0], x["mask"], denoms=denoms)
            (loss * self.dp_size * self.scaler.scale).backward()
            step_loss += loss.detach()
            records.append((float(x["mask"].sum()), metrics))
        records.append((1.0, self.policy_step(step_loss)))
        self.version += 1
        return records, self.version

    def logprobs(self, segments: list[Segment], temperature: float | None) -> list[torch.Tensor] | None:
        """Every segment's (T,) recomputed log-probs (0 at t = 0) on rank 0; None on the others."""
        batch = collate(segments, self.moe, vlm=self.processor is not None)
        temperature = self.temperature if temperature is None else temperature
        logp = self.forward_rows(self.model, batch, self.plan(batch, 1), temperature, every=True)
        return [logp[i, :n] for i, n in enumerate(batch["lengths"].tolist())] if self.rank == 0 else None

    # --- the driver's calls: the rendezvous; batch invariance, refit, write_hf, save, load: bound at the file's end
    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0 hosts the process group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def mfu_facts(self) -> tuple[str, int]:
        """train/mfu's facts: this rank's device name ("cpu" without CUDA) and the policy's N (a tied head once)."""
        return (torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
                sum(p.numel() for p in self.model.parameters()))  # a DTensor's numel is the whole tensor's

    def shutdown(self) -> None:
        dist.destroy_process_group()


# === machinery: model loading, refit and HF export, checkpoint files, Ray ranks; read it when you change a dependency
# --- the driver: starts the ranks, hands each the batch, merges their metrics
class TrainerGroup:
    """--train.world_size TrainerRank actors in one process group. colocated: --launch.colocate (CUDA IPC refits);
    batch_invariant: the ranks run --vllm.batch_invariant's kernels too; rank_options: --launch.placement's per rank."""

    def __init__(self, model_path: str, train: TrainArgs, fsdp: FsdpArgs, ckpt: CkptArgs, loss: LossArgs,
                 estimator: EstimatorArgs, *, temperature: float, gpus_per_rank: float | None = None,
                 colocated: bool = False, batch_invariant: bool = False, rank_options: list[dict] | None = None):
        gpus = (1.0 if torch.cuda.is_available() else 0.0) if gpus_per_rank is None else gpus_per_rank
        check_args(train, fsdp, loss, estimator, cuda=gpus > 0)
        if batch_invariant and gpus == 0:
            raise ValueError("--vllm.batch_invariant on a CPU trainer: its Triton kernels need CUDA; drop the flag")
        if batch_invariant and fsdp.compile_layers:
            raise ValueError("--vllm.batch_invariant with --fsdp.compile_layers: compiled layers fuse past the "
                             "engine's kernels; leave one off")
        config, ep = AutoConfig.from_pretrained(model_path), fsdp.ep_size
        self.ckpt, self.colocated, self.vlm = ckpt, colocated, hasattr(config, "vision_config")
        if ep > 1 and (config.model_type != "qwen3_moe" or config.num_experts % ep or train.critic_lr is not None):
            raise ValueError(f"--fsdp.ep_size {ep}: expert parallelism needs a Qwen3-MoE policy whose expert count "
                             f"it divides, and no critic (a transformers class); {model_path} is {config.model_type} "
                             f"with {getattr(config, 'num_experts', 0)} experts; set another ep_size")
        if fsdp.tp_size > 1 and config.model_type == "qwen3_moe":
            raise ValueError(f"--fsdp.tp_size {fsdp.tp_size} with a Qwen3-MoE policy ({model_path}): NeMo 0.7.0's MoE "
                             "class refuses its own TP plan; set --fsdp.tp_size 1 (--fsdp.ep_size splits the experts)")
        if train.freeze_vision and not self.vlm:
            raise ValueError(f"--train.freeze_vision: {model_path} has no vision_config (not a VLM); leave it off")
        if train.lora_rank and (config.model_type == "qwen3_moe" or self.vlm):
            raise ValueError(f"--train.lora_rank {train.lora_rank} with {model_path} ({config.model_type}): LoRA "
                             "covers dense text models (not NeMo's MoE class, not VLMs); set --train.lora_rank 0")
        if train.pack and (config.model_type == "qwen3_moe" or self.vlm):  # HF's flex_attention path, text rows
            raise ValueError(f"--train.pack with {model_path} ({config.model_type}): NeMo's Qwen3-MoE class (its own "
                             "attention) and a VLM's image runs take no packed row; leave --train.pack off")
        if ckpt.hf_merged and not train.lora_rank:
            raise ValueError("--ckpt.hf_merged with --train.lora_rank 0: there is no adapter to merge; drop it")
        actor_class = ray.remote(num_cpus=0, num_gpus=gpus)(TrainerRank)
        self.actors = [actor_class.options(**(rank_options[r] if rank_options else {})).remote(
            r, train.world_size, model_path, train, fsdp, ckpt, loss, estimator, temperature)
            for r in range(train.world_size)]
        self.nodes = ["(starting)"] * train.world_size  # each rank's Ray node id once set up: an error names it
        try:
            addr, port = ray.get(self.actors[0].address.remote())
            if batch_invariant:  # before setup: vLLM's cuBLAS settings (env) hold only before a rank's first matmul
                self.call("enable_batch_invariance")
            self.nodes = self.call("setup", addr, port)
            devices, params = zip(*self.call("mfu_facts"))
        except Exception:  # a rank that failed to start leaves the others waiting in the rendezvous
            for a in self.actors:
                ray.kill(a)
            raise
        self.step, self.version, self.data_position, self.saved = 0, 0, None, (-1, None)
        self.config, self.params, self.epochs = config, params[0], train.epochs  # train/mfu's model FLOPs
        self.device_name = devices[0] if len(set(devices)) == 1 else "mixed"  # ranks on unlike GPUs: no one peak
        if ckpt.resume:
            if not (found := checkpoint_dirs(ckpt.dir)):
                raise ValueError(f"--ckpt.resume: no complete checkpoint under --ckpt.dir {ckpt.dir}; "
                                 "drop --ckpt.resume to start fresh")
            self.data_position = self.load(found[-1])
            self.saved = (self.step, found[-1])

    def call(self, method: str, *args) -> list:
        """method(*args) on every rank, results in rank order. A dead rank raises at once, named (the others may wait
        for it in a collective); a rank whose collective broke first waits PEER_DEATH_S for Ray to name the peer."""
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        waiting, failed = list(refs), None
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1, timeout=PEER_DEATH_S if failed else None)
            if not done:  # no rank died: the first failure is the cause
                raise failed
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                r = refs.index(done[0])
                raise RuntimeError(f"trainer rank {r} on Ray node {self.nodes[r]} died in {method}: {e}") from e
            except ray.exceptions.RayTaskError as e:
                failed = failed or e
        return ray.get(refs)

    def run_step(self, method: str, segments: list[Segment], data_position: dict | None) -> dict[str, float]:
        start = time.perf_counter()
        batch = collate(segments, vlm=self.vlm)  # refuse bad input here, before any rank sees it
        results = self.call(method, ray.put(segments))  # one copy in the object store, read by every rank
        metrics = merge_metrics([record for records, _ in results for record in records])
        self.step, self.version = self.step + 1, results[0][1]
        step_s = time.perf_counter() - start  # tokens_per_s: every token of the batch, prompt too
        metrics.update({"train/version": float(self.version), "train/step_s": step_s,
                        "train/tokens_per_s": float(batch["lengths"].sum()) / step_s})
        # train/mfu: the trained rows' model FLOPs (train_step: each row epochs times; not the critic's, not no-grad
        # passes) over train/step_s x world size x the ranks' peak; no key on CPU or on a GPU not in PEAK_FLOPS
        passes = self.epochs if method == "train_step" else 1
        flops = passes * model_flops(self.config, self.params, batch["lengths"].tolist())
        if (value := mfu(flops, step_s, len(self.actors), self.device_name)) is not None:
            metrics["train/mfu"] = value
        if self.ckpt.every and self.step % self.ckpt.every == 0:
            self.save(data_position)
        return metrics

    def train_step(self, segments: list[Segment], *, data_position: dict | None = None) -> dict[str, float]:
        """One RL step (see TrainerRank.train_step); data_position is stored with a checkpoint due after it."""
        return self.run_step("train_step", segments, data_position)

    def sft_step(self, segments: list[Segment], *, data_position: dict | None = None) -> dict[str, float]:
        """One SFT optimizer step on the segments' action tokens (sft_batch builds them from chat examples)."""
        return self.run_step("sft_step", segments, data_position)

    def logprobs(self, segments: list[Segment], *, temperature: float | None = None) -> list[torch.Tensor]:
        """Each segment's (T,) log-probs under the current weights at temperature (default: the rollout's)."""
        collate(segments, vlm=self.vlm)  # refused here, before any rank sees it
        return self.call("logprobs", ray.put(segments), temperature)[0]

    def refit(self, generator) -> dict:
        """The weights into a paused generator's engines as self.version; -> rank 0's report ("metrics": refit_*)."""
        report = self.call("refit", generator, self.colocated)[0]
        generator.version = self.version
        return report

    def export_hf(self, path: str) -> None:
        """Write the current weights as an HF model directory, or with LoRA peft's adapter one (see write_hf_dir)."""
        self.call("write_hf", path)

    def save(self, data_position: dict | None = None) -> str:
        """Checkpoint now under --ckpt.dir; returns the step_NNNNNN directory."""
        if self.ckpt.dir is None:
            raise ValueError("save: --ckpt.dir is not set")
        if self.version == 0:  # and get_state_dict would initialise AdamW's state with a step of lr 0
            raise ValueError("save: nothing trained yet; the model directory itself is that checkpoint")
        self.saved = (self.step, self.call("save", self.ckpt.dir, self.step, data_position)[0])
        return self.saved[1]

    def final_checkpoint(self, data_position: dict | None) -> str | None:
        """This step's checkpoint at a run's end: --ckpt.every's if written, else a new one; None without --ckpt.dir."""
        if self.ckpt.dir is None:
            return None
        return self.saved[1] if self.saved[0] == self.step else self.save(data_position)

    def load(self, path: str) -> dict | None:
        """Restore every rank from a checkpoint directory; returns the data position saved with it."""
        meta = self.call("load", path)[0]
        self.step, self.version = meta["step"], meta["version"]
        return meta["data_position"]

    def shutdown(self) -> None:
        """Leave the process group and end the rank processes (idempotent)."""
        if self.actors:
            self.call("shutdown")
            for a in self.actors:
                ray.kill(a)
            self.actors = []


# --- input checks and rows: flags against the machine, segments, routing replay's expert ids, SFT rows from chat
def check_args(train: TrainArgs, fsdp: FsdpArgs, loss: LossArgs, estimator: EstimatorArgs, *, cuda: bool) -> None:
    """Rules that span files or depend on the machine; checked before any actor starts."""
    if not cuda and fsdp.param_dtype != "float32":
        raise ValueError(f"--fsdp.param_dtype {fsdp.param_dtype} on CPU: CPU trains and samples float32; set float32")
    if not cuda and fsdp.offload != "none":
        raise ValueError("--fsdp.offload optimizer on CPU: weights already sit in host memory; set --fsdp.offload none")
    for flag, size, kind in (("tp_size", fsdp.tp_size, "tensor"), ("ep_size", fsdp.ep_size, "expert")):
        if train.world_size % size:
            raise ValueError(f"--fsdp.{flag} {size} with --train.world_size {train.world_size}: {kind}-parallel "
                             f"groups split the ranks evenly; set a --fsdp.{flag} that divides world_size")
    if fsdp.offload != "none" and train.world_size == 1:
        raise ValueError("--fsdp.offload optimizer with --train.world_size 1: NeMo's FSDP2 neither shards nor offloads "
                         "one rank; set --fsdp.offload none or raise --train.world_size")
    if estimator.needs_values != (train.critic_lr is not None):
        raise ValueError(f"--estimator.name {estimator.name} with --train.critic_lr {train.critic_lr}: an estimator "
                         "that reads a critic's values (gae) needs one, no other uses one; set both or neither")
    if estimator.needs_kl and not loss.needs_ref_model:
        raise ValueError("--estimator.kl_coef > 0 with --loss.kl_ref rollout: the KL reward needs --loss.kl_ref model")
    if fsdp.compile_layers and (not cuda or train.routing_replay):
        raise ValueError("--fsdp.compile_layers on CPU or with --train.routing_replay (its router hooks change per "
                         "forward): leave --fsdp.compile_layers off")
    if train.pack and not cuda:
        raise ValueError("--train.pack on CPU: torch runs flex_attention's backward only on GPUs; leave it off")
    if train.pack and fsdp.tp_size > 1:
        raise ValueError("--train.pack with --fsdp.tp_size > 1: flex_attention under NeMo's tensor-parallel plan is "
                         "untested (it needs several GPUs); set --fsdp.tp_size 1 or leave --train.pack off")


def check_segments(segments: list[Segment]) -> None:
    if not segments:
        raise ValueError("segments: empty batch; train_step needs at least one segment with an action token")
    for i, seg in enumerate(segments):
        try:
            seg.check()
        except ValueError as e:
            raise ValueError(f"segment {i}: {e}") from None
        if not seg.token_ids or seg.action_mask[0]:
            raise ValueError(f"segment {i} ({seg.episode_id!r}): empty, or its first token is an action "
                             "(nothing precedes it to predict it from)")
        if not math.isfinite(seg.reward):
            raise ValueError(f"segment {i} ({seg.episode_id!r}): reward {seg.reward} is not finite")
    if not any(any(seg.action_mask) for seg in segments):
        raise ValueError("segments: no action token in the whole batch; there is nothing to train")


def collate_routing(segments: list[Segment], T: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """(B, T, layers, top_k) int16 expert ids from routed_experts, -1 where none; ValueError names a bad segment. A row
    sampled across a refit routes live: no one recording has both the old weights' routing and the new KV cache."""
    if all(seg.routed_experts is None for seg in segments):
        raise ValueError("--train.routing_replay: no segment of the batch carries routed_experts; record them "
                         "(--vllm.return_routed_experts) or leave the flag off")
    out = np.full((len(segments), T, layers, top_k), -1, dtype=np.int16)  # (B, T, layers, top_k)
    for i, seg in enumerate(segments):
        if seg.routed_experts is None or len({v for v, m in zip(seg.versions, seg.action_mask) if m}) > 1:
            continue
        r = np.asarray(seg.routed_experts)
        where = f"segment {i} ({seg.episode_id!r})"
        if r.shape != (len(seg.token_ids), layers, top_k):
            raise ValueError(f"{where}: routed_experts has shape {r.shape}, the model needs (T, MoE layers, top_k) = "
                             f"{(len(seg.token_ids), layers, top_k)}")
        if r.size and (r.min() < -1 or r.max() >= experts or ((r < 0).any(-1) != (r < 0).all(-1)).any()):
            raise ValueError(f"{where}: routed_experts ids must lie in [0, {experts}), "
                             "or be -1 for all top_k of a (token, layer)")
        out[i, :len(seg.token_ids)] = r
    return out


def sft_batch(examples: list[dict], tokenizer, *, end_token: str = "<|im_end|>", template=None) -> list[Segment]:
    """Chat examples ({"messages", optional "tools"}) -> Segments (version 0); action tokens: each assistant turn's
    after `<|im_start|>assistant\\n` through end_token ("weight": 0: context only); each message prefix must render as a
    token prefix of the whole, else ValueError. Image parts: `template` (a VLM's ChatTemplate) expands each (mask 0)."""
    end_id = tokenizer.convert_tokens_to_ids(end_token)
    if end_id is None or end_id == tokenizer.unk_token_id:
        raise ValueError(f"end_token {end_token!r}: not a single token; pass the chat template's end-of-turn token")
    segments = []
    for i, example in enumerate(examples):
        messages, tools = example["messages"], example.get("tools") or None
        images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                  if p.get("type") == "image"]
        if images and getattr(template, "processor", None) is None:   # before any render: a text template may fail
            raise ValueError(f"example {i}: has images; pass template=ChatTemplate(model) of a VLM")
        render = functools.partial(tokenizer.apply_chat_template, tools=tools, tokenize=True, return_dict=False)
        ids = render(messages)
        mask = [False] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant" or message.get("weight", 1) == 0:   # OpenAI's fine-tuning format
                continue
            if turn == 0:
                raise ValueError(f"example {i}: starts with an assistant turn; nothing precedes it to condition on")
            start = len(before := render(messages[:turn], add_generation_prompt=True))
            upto = render(messages[:turn + 1])
            if ids[:start] != before or ids[:len(upto)] != upto or end_id not in upto[start:]:
                raise ValueError(f"example {i}, message {turn}: its rendered prefix is not a token prefix of the whole "
                                 f"(or the turn lacks {end_token}); the chat template would misplace SFT masks")
            stop = len(upto) - upto[::-1].index(end_id)  # one past the turn's last end_token
            mask[start:stop] = [True] * (stop - start)
        spans = []
        if images:
            try:
                ids, spans = template.expand_images(ids, images)
            except ValueError as e:
                raise ValueError(f"example {i}: {e}") from None
            for start, end, _ in spans:   # the mask expands as the ids did: once the runs before it are in, an image
                mask[start:start + 1] = [False] * (end - start)   # id's entry sits at its run's start
        segments.append(Segment(token_ids=ids, action_mask=mask, logprobs=[0.0] * len(ids), finish_reason="stop",
                                versions=[0 if m else -1 for m in mask], episode_id=f"sft-{i}", group_id=f"sft-{i}",
                                images=spans))
    return segments


# --- the models: the process group, NeMo AutoModel's FSDP2, a VLM's extras; gradient norm, float16; LoRA
def enable_batch_invariant_kernels(rank: TrainerRank) -> None:
    """--vllm.batch_invariant: this rank's matmuls, log-softmax and mean run the kernels its engines run (vLLM's)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    try:  # vLLM 0.26 (the GPU's); later versions moved the module to model_executor.determinism
        from vllm.model_executor.layers.batch_invariant import enable_batch_invariant_mode
    except ImportError:
        from vllm.model_executor.determinism.batch_invariant import enable_batch_invariant_mode
    enable_batch_invariant_mode()


def join_process_group(rank: TrainerRank, master_addr: str, master_port: int) -> None:
    """Join the process group, seed every RNG, build NeMo's device mesh; sets rank.compute_dtype, dist_setup, dp_*."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank.rank),
                      WORLD_SIZE=str(rank.world_size), LOCAL_RANK="0")
    if rank.cuda:
        torch.cuda.set_device(rank.device)
    dist.init_process_group("nccl" if rank.cuda else "gloo", rank=rank.rank, world_size=rank.world_size)
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(rank.train.seed)
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config  # rank-only: a slow import
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    compute_dtype = rank.compute_dtype = getattr(torch, rank.fsdp.param_dtype)
    rank.dist_setup = DistributedSetup.build(
        FSDP2Config(mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
                    offload_policy=CPUOffloadPolicy() if rank.fsdp.offload == "optimizer" else None),
        parallelism_sizes=ParallelismSizes(tp_size=rank.fsdp.tp_size, cp_size=1, ep_size=rank.fsdp.ep_size),
        activation_checkpointing=rank.fsdp.gradient_checkpointing, world_size=rank.world_size)
    dp_mesh = rank.dist_setup.mesh_context.device_mesh["dp"]
    rank.dp_rank, rank.dp_size, rank.dp_group = dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()


def build_model(rank: TrainerRank, auto_class, lora: bool = False, **kwargs) -> torch.nn.Module:
    """Load model_path in float32, sharded by NeMo's FSDP2: a Qwen3-MoE policy as NeMo's MoE class, others as HF's."""
    config = AutoConfig.from_pretrained(rank.model_path)
    if auto_class is AutoModelForCausalLM and hasattr(config, "vision_config"):   # a VLM: its own class
        auto_class = AutoModelForImageTextToText
    nemo_moe = auto_class is AutoModelForCausalLM and config.model_type == "qwen3_moe"
    if rank.train.pack:  # TrainerGroup refused the models that cannot take it
        kwargs["attn_implementation"] = "flex_attention"
    if nemo_moe:  # aux_loss_coeff 0: in train mode NeMo would add a load-balancing loss to ours
        from nemo_automodel.components.models.common import BackendConfig
        kwargs.update(backend=BackendConfig(experts="torch_mm"), moe_overrides={"aux_loss_coeff": 0.0})
    if rank.cuda:
        import nemo_automodel
        nemo_class = getattr(nemo_automodel, "NeMo" + auto_class.__name__)  # NeMoAutoModelForCausalLM, ...
        model = nemo_class.from_pretrained(rank.model_path, dtype=torch.float32, force_hf=not nemo_moe,
                                           use_liger_kernel=False, **kwargs)  # no Liger: the engine's math
    elif nemo_moe:  # NeMo's loader needs CUDA, and so does the class's rotary cache at construction
        from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
        config.dtype = torch.float32
        # no argument or device context reaches it: Qwen3MoeModel calls torch.cuda.current_device() itself
        with mock.patch.object(torch.cuda, "current_device", return_value=0):
            model = Qwen3MoeForCausalLM(config, **kwargs)
        model.model.rotary_emb.device = rank.device
        hf = {k: v for f in glob.glob(f"{rank.model_path}/*.safetensors") for k, v in load_file(f).items()}
        model.load_state_dict(model.state_dict_adapter.from_hf(hf), strict=True)
    else:
        model = auto_class.from_pretrained(rank.model_path, dtype=torch.float32, **kwargs)
    if rank.train.pack and model.config._attn_implementation != "flex_attention":  # NeMo falls back on errors
        raise ValueError(f"--train.pack: {rank.model_path} loaded with {model.config._attn_implementation} attention, "
                         "not flex_attention; leave --train.pack off")
    zero_dropout(model)  # before LoRA: --train.lora_dropout is the only dropout there is
    if rank.train.freeze_vision:   # the module built from config.vision_config, outermost first
        kind = type(config.vision_config)
        next(m for m in model.modules() if isinstance(getattr(m, "config", None), kind)).requires_grad_(False)
    if lora:  # --train.lora_rank: the policy's adapters, added before FSDP wraps its parameters
        rank.adapted = add_lora(model, rank.train)
    if auto_class is AutoModelForTokenClassification:
        torch.nn.init.zeros_(model.score.weight)  # the value head starts at V = 0, the same on every rank
        torch.nn.init.zeros_(model.score.bias)
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    model.train()  # from_pretrained returns eval mode, in which HF's (NeMo's) activation checkpointing is off; with
    # dropout zeroed, train mode changes nothing else (but --train.lora_dropout, live in the loss forward alone)
    model = parallelize_model(model.to(rank.device), rank.dist_setup.mesh_context)
    if rank.fsdp.compile_layers:  # FSDP2's gathers run in each layer's hooks, outside its compiled forward
        for layer in (m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")):
            layer.forward = torch.compile(layer.forward)
    if nemo_moe and not isinstance(model, FSDPModule):  # one rank: NeMo skips fully_shard and its bf16 cast, and
        fully_shard(model, mesh=rank.dist_setup.mesh_context.device_mesh["dp"],  # autocast is 2x further from vLLM
                    mp_policy=rank.dist_setup.mesh_context.strategy_config.mp_policy)
    return model


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, *, entropy: bool,
                  entropy_grad: bool, chunk: int, compiled: bool = False, banned: int | None = None) -> torch.Tensor:
    """rows_logprobs over head(hidden) for (N, H) hidden states, `chunk` rows at a time: a chunk's (chunk, V) logits
    live inside one checkpointed call and backward makes them again, so the (N, V) logits never exist. -> (N, 2): log
    p(targets), entropy (0 unless asked). banned: a vocabulary id kept out of the softmax (a VLM's image id)."""
    fn = compiled_logprobs() if compiled else rows_logprobs

    def part(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h)  # (n, V)
        if banned is not None:  # -1e4, not -inf: the entropy's 0 * log 0 would be NaN
            logits = logits.index_fill(-1, torch.tensor([banned], device=logits.device), -1e4)
        logp, ent = fn(logits, y, temperature, entropy, entropy_grad)
        return torch.stack([logp, ent if entropy else torch.zeros_like(logp)], -1)  # (n, 2)
    run = functools.partial(checkpoint, part, use_reentrant=False) if torch.is_grad_enabled() else part
    return torch.cat([run(hidden[i:i + chunk], targets[i:i + chunk]) for i in range(0, len(hidden), chunk)])


def install_head(rank: TrainerRank, model) -> None:
    """--fsdp.logprob_chunk: while rank.head_task is set, model's LM head returns each position's (log p of the next
    id, entropy) through head_logprobs, not its logits; FSDP's hooks around the head's call still gather its weight."""
    text = model.config.get_text_config()
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):  # the model would rescale our log-probs
        if getattr(text, key, None) not in (None, 1):
            raise ValueError(f"--fsdp.logprob_chunk with {rank.model_path}: its config's {key} rescales the head's "
                             "logits after the head; set --fsdp.logprob_chunk 0")
    head = model.get_output_embeddings()
    plain = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if rank.head_task is None:  # any other caller: the logits
            return plain(hidden)
        targets, temperature, entropy, where = rank.head_task
        flat, targets = hidden.flatten(0, -2), targets.flatten()
        logprobs = functools.partial(head_logprobs, plain, temperature=temperature, entropy=entropy,
                                     entropy_grad=rank.loss.needs_entropy_grad, chunk=rank.fsdp.logprob_chunk,
                                     compiled=rank.cuda and rank.fsdp.compile_logprobs, banned=rank.image_id)
        if where is None:  # every position
            return logprobs(flat, targets).view(*hidden.shape[:-1], 2)
        # only the positions asked for: a prompt's or a tool result's tokens cost the head nothing. One at least, so
        # that the head's weight has a gradient on every rank (FSDP reduces it on all of them)
        keep = where.flatten().nonzero()[:, 0]
        keep = keep if len(keep) else keep.new_zeros(1)
        part = logprobs(flat[keep], targets[keep])
        return part.new_zeros(len(flat), 2).index_copy(0, keep, part).view(*hidden.shape[:-1], 2)
    head.forward, model.chunked_head = forward, True


def zero_dropout(model: torch.nn.Module) -> None:
    """Every dropout rate of the model 0, as in vLLM: nn.Dropout modules and the float rates that layers and configs
    hold and read in train mode (attention_dropout, resid_pdrop, layerdrop, ...); the policy trains in train mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for key, value in list(getattr(owner, "__dict__", {}).items()):
                if "drop" in key and isinstance(value, float):
                    setattr(owner, key, 0.0)


def setup_policy_extras(rank: TrainerRank) -> None:
    """After the policy: a VLM's processor, image id and blank row; replay's gate hooks (rank.moe); fused names."""
    config = AutoConfig.from_pretrained(rank.model_path)
    rank.processor = AutoProcessor.from_pretrained(rank.model_path) if hasattr(config, "vision_config") else None
    rank.image_id = getattr(config, "image_token_id", None)
    rank.blank = None  # a VLM on several ranks: a blank image's run and inputs (add_blank_row says why)
    if rank.processor is not None and rank.dp_size > 1:
        from PIL import Image
        blank = Image.new("RGB", (64, 64))   # any size: the processor resizes it
        run = rank.processor(text=rank.processor.tokenizer.convert_ids_to_tokens(rank.image_id), images=[blank],
                             add_special_tokens=False)["input_ids"][0]
        rank.blank = (torch.tensor([run], device=rank.device), image_inputs(rank, [blank]))
    if rank.train.routing_replay:
        rank.moe = install_replay(rank, rank.model)
    meta = {export_name(n): torch.empty(p.shape, dtype=p.dtype, device="meta")
            for n, p in rank.model.named_parameters()}
    rank.fused = set(meta) - set(revert_weight_conversion(rank.model, meta))  # reverted as save_pretrained does


def install_replay(rank: TrainerRank, model) -> tuple[int, int, int]:
    """Point every MoE gate of model (NeMo's Qwen3-MoE class) at replayed_ids; -> (MoE layers, top_k, experts)."""
    from nemo_automodel.components.moe.layers import Gate
    gates = [m for m in model.modules() if isinstance(m, Gate)]  # in layer order
    if not gates:
        raise ValueError(f"--train.routing_replay: {rank.model_path} has no Qwen3-MoE router; leave the flag off")
    for layer, gate in enumerate(gates):  # a gate routes by router_replay.apply(its live top-k ids)
        gate.router_replay = types.SimpleNamespace(apply=functools.partial(rank.replayed_ids, layer))
    return len(gates), gates[0].topk, gates[0].n_experts


def reduce_parallel_grads(rank: TrainerRank, model) -> None:
    """Gradients that NeMo's parallel plans leave partial or scaled, made as one rank's would be (EP: the policy's)."""
    if rank.fsdp.ep_size > 1:  # experts sum every ep rank's tokens, and FSDP averages them over dp / ep_size
        for name, p in model.named_parameters():  # ranks, not dp: ep_size x the scale of the others
            if ".experts." in name and p.grad is not None:
                p.grad.div_(rank.fsdp.ep_size)
    if rank.fsdp.tp_size > 1:  # NeMo's plan keeps Qwen3's q_norm/k_norm whole, each rank normalizing its own heads:
        from nemo_automodel.components.distributed.tp_replicas import synchronize_tp_replica_gradients
        synchronize_tp_replica_gradients([model], rank.dist_setup.mesh_context.device_mesh)  # (NeMo's recipes do it)


def image_inputs(rank: TrainerRank, images: list) -> dict[str, torch.Tensor]:
    return {k: v.to(rank.device) for k, v in rank.processor.image_processor(images=images, return_tensors="pt").items()}


def add_blank_row(rank: TrainerRank, ids: torch.Tensor, images: dict) -> tuple[torch.Tensor, dict]:
    """A VLM on several ranks runs the tower in every forward (FSDP gathers each vision layer: else one rank's vision
    all-gather meets another's text one): without an image, one more row, a blank image's, whose logits are dropped."""
    if images or rank.blank is None:
        return ids, images
    run, images = rank.blank
    width = max(ids.shape[1], run.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))
    return torch.cat([pad(ids), pad(run)]), images  # (B + 1, width): right padding leaves the rows' logits as they are


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None, scale: float = 1.0) -> float:
    """Global L2 norm of the gradients of loss x scale over all ranks and meshes, / scale; then clipped to max_norm."""
    groups = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads, norm_type=2.0) for grads in groups.values()]  # DTensors: partial
    norms = [(norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu() for norm in norms]
    total = float(torch.stack(norms).norm()) / scale if norms else 0.0
    factor = (max_norm / (total + 1e-6) if max_norm is not None and total > max_norm else 1.0) / scale
    if factor != 1.0 and math.isfinite(total):
        for grads in groups.values():
            torch._foreach_mul_(grads, factor)
    return total


@dataclass
class LossScale:
    """float16 dynamic loss scaling (https://arxiv.org/abs/1710.03740): backward runs on loss x scale; a non-finite
    gradient skips its step and halves the scale (floor 1), `growth_steps` finite steps double it. Not dynamic: 1.
    A non-finite gradient with no scale left to back off (not float16, or at the floor) raises FloatingPointError."""
    dynamic: bool
    scale: float = 1.0
    growth_steps: int = 2000  # torch.amp.GradScaler's default, as is the start scale 2**16 (trainer's setup)
    good_steps: int = 0
    skipped: int = 0

    def update(self, finite: bool) -> bool:
        """Record one optimizer step's gradient (finite or not); -> whether to take the step."""
        if not finite and (not self.dynamic or self.scale <= 1.0):  # no float16 overflow: a NaN / inf upstream
            kind = "float16 at its floor" if self.dynamic else "float32 / bfloat16: no scaling"
            raise FloatingPointError(
                f"non-finite gradient at loss scale {self.scale} ({kind}); the step was not taken. A NaN or inf in the "
                "loss, the batch (rewards, log-probs) or the weights: check them, or lower --train.lr / "
                "--train.critic_lr and resume")
        if not self.dynamic:
            return True
        if not finite:
            self.scale, self.good_steps, self.skipped = max(self.scale / 2, 1.0), 0, self.skipped + 1
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_steps:
            self.scale, self.good_steps = self.scale * 2, 0
        return True


@functools.cache
def compiled_logprobs():
    """rows_logprobs under torch.compile, made on first use (GPU only): compiled at import, it loaded Inductor in every
    process that imports this file, CPU ranks and tests included (import: 6.2 -> 5.0 CPU-s on 2 cores). Inductor's
    coalesce tiling analysis (torch 2.11) asserts on this function's fused backward at small shapes."""
    return torch.compile(rows_logprobs, dynamic=True, options={"triton.coalesce_tiling_analysis": False})


# --- LoRA (--train.lora_rank): NeMo AutoModel's adapter linears; peft's names and config for refit and export
def add_lora(model: torch.nn.Module, train: TrainArgs) -> set[str]:
    """Freeze model and give each linear module named in --train.lora_targets NeMo's LoRA: y = W x + (alpha / r)
    B A dropout(x), B zero at the start. -> the adapted modules' names; ValueError names a target with no module."""
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in
             train.lora_targets]
    if missing := set(train.lora_targets) - {n.rsplit(".", 1)[-1] for n in names}:
        raise ValueError(f"--train.lora_targets {sorted(missing)}: no linear module of the model has that name")
    # exact names (NeMo's matcher reads "*" patterns as regexes); dropout on the adapter's input, as peft does
    config = PeftConfig(target_modules=names, dim=train.lora_rank, alpha=train.lora_alpha, dropout=train.lora_dropout,
                        dropout_position="pre")
    if apply_lora_to_linear_modules(model, config) != len(names):
        raise RuntimeError(f"LoRA: NeMo's matcher adapted other modules than {names}")
    return {export_name(n) for n in names}


def peft_config(train: TrainArgs, model_path: str) -> dict:
    """adapter_config.json in peft's format, which vLLM and peft read: scale alpha / r, no bias, no rsLoRA."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model_path,
            "r": train.lora_rank, "lora_alpha": train.lora_alpha, "lora_dropout": train.lora_dropout,
            "target_modules": list(train.lora_targets), "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "modules_to_save": None}


def merge_lora(pairs, adapted: set[str], scale: float):
    """(name, full tensor) pairs of a LoRA model -> the base model's: each adapted W + scale B A, no lora_A / lora_B."""
    held = {}
    for name, tensor in pairs:
        stem = name.removesuffix(".weight")
        module = stem.removesuffix(".lora_A").removesuffix(".lora_B")
        if stem == name or module not in adapted:
            yield name, tensor
            continue
        parts = held.setdefault(module, {})
        parts[stem[len(module):]] = tensor  # "", ".lora_A" or ".lora_B"
        if len(parts) == 3:
            del held[module]
            yield module + ".weight", parts[""] + scale * (parts[".lora_B"] @ parts[".lora_A"])


# --- refit and HF export: full tensors under HF names, in buckets
def export_name(name: str) -> str:
    """The HF parameter name: activation checkpointing and torch.compile wrap modules and insert these segments."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def full_params(rank: TrainerRank, params: list[tuple[str, torch.nn.Parameter]]):
    """(checkpoint name, whole tensor) of each parameter as save_pretrained writes it; every rank must iterate."""
    adapter = getattr(rank.model, "state_dict_adapter", None)
    for name, param in params:
        name, full = export_name(name), param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
        yield from (adapter.convert_single_tensor_to_hf(name, full) if adapter is not None
                    else revert_weight_conversion(rank.model, {name: full}).items() if name in rank.fused
                    else [(name, full)])


def refit_pairs(rank: TrainerRank, dtype: torch.dtype, adapter: bool):
    """(HF name, tensor in dtype) a refit sends: the adapter, else trained weights (LoRA merged); all ranks iterate."""
    trained = [(n, p) for n, p in rank.model.named_parameters() if p.requires_grad]
    full = hf_params(rank, adapter) if adapter or rank.adapted else full_params(rank, trained)
    return ((name, tensor.to(dtype)) for name, tensor in full)


def refit_from(rank: TrainerRank, generator, colocated: bool) -> dict | None:
    """Rank 0 streams refit_pairs in the engine's dtype: to update_adapter (no pause) if the engines serve LoRA, else
    update_weights (paused). Rank 0 keeps its first router copy: it holds the NCCL group a cross-GPU refit opens."""
    if rank.router is None or rank.router.id != generator.id:
        rank.router = generator
    pairs = refit_pairs(rank, getattr(torch, generator.dtype), generator.serves_adapters)
    if generator.serves_adapters:
        update = lambda: rank.router.update_adapter(pairs, peft_config(rank.train, rank.model_path), rank.version)
    else:  # keep: --train.freeze_vision's tower (never fused); a LoRA's frozen base goes out merged
        keep = () if rank.adapted else [export_name(n) for n, p in rank.model.named_parameters() if not p.requires_grad]
        update = lambda: rank.router.update_weights(pairs, rank.version, colocated=colocated, keep=keep)
    try:
        if rank.rank == 0:
            return asyncio.run(update())
    finally:
        for _ in pairs:  # the other ranks join every gather rank 0 makes; a refused refit leaves none waiting
            pass
    return None


def hf_params(rank: TrainerRank, adapter: bool):
    """(checkpoint name, full tensor) of peft's adapter alone (adapter), else of every weight, a LoRA merged in."""
    if adapter:
        trained = [(n, p) for n, p in rank.model.named_parameters() if p.requires_grad]
        return ((PEFT_PREFIX + name, full) for name, full in full_params(rank, trained))
    full = full_params(rank, list(rank.model.named_parameters()))
    return merge_lora(full, rank.adapted, rank.train.lora_alpha / rank.train.lora_rank) if rank.adapted else full


def write_hf_dir(rank: TrainerRank, path: str, merged: bool | None = None) -> None:
    """An HF model directory (the weights in one safetensors file, model_path's other files); LoRA: peft's adapter
    directory, unless merged (default --ckpt.hf_merged): then the full weights, the adapter merged in."""
    adapter = bool(rank.adapted) and not (rank.ckpt.hf_merged if merged is None else merged)
    tensors = {name: full.to("cpu", copy=True) for name, full in hf_params(rank, adapter) if rank.rank == 0}
    if rank.rank == 0:  # every rank joined each gather above; only rank 0 copied to host
        os.makedirs(path, exist_ok=True)
        weights = os.path.join(path, "adapter_model.safetensors" if adapter else "model.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
        if adapter:
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                json.dump(peft_config(rank.train, rank.model_path), f, indent=2)
        else:
            for name in os.listdir(rank.model_path):
                if os.path.isfile(os.path.join(rank.model_path, name)) and not WEIGHT_FILES.fullmatch(name):
                    shutil.copy(os.path.join(rank.model_path, name), path)


# --- checkpoints: sharded model + optimizer (DCP), RNG per rank, counters and data position
def checkpoint_dirs(root: str) -> list[str]:
    """Complete checkpoints under root, oldest first: step_NNNNNN, else its .old (a crash mid re-save); never a .tmp."""
    names = set(os.listdir(root)) if os.path.isdir(root) else set()
    steps = sorted({int(m.group(1)) for name in names if (m := re.fullmatch(r"step_(\d+)(\.old)?", name))})
    return [os.path.join(root, f"step_{s:06d}" + ("" if f"step_{s:06d}" in names else ".old")) for s in steps]


def checkpoint_state(rank: TrainerRank) -> dict:
    """The DCP state: sharded model and optimizer state dicts (critic's too); with LoRA the adapter's alone."""
    model_sd, optim_sd = get_state_dict(rank.model, rank.optimizer)
    if rank.adapted:  # a tied head is no parameter of its own: frozen-parameter filters miss it
        model_sd = {k: v for k, v in model_sd.items() if ".lora_" in k}
    state = {"model": model_sd, "optim": optim_sd}
    if rank.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(rank.critic, rank.critic_optimizer)
    return state


def save_checkpoint(rank: TrainerRank, root: str, step: int, data_position: dict | None) -> str:
    """Write step_NNNNNN.tmp, rename it step_NNNNNN (atomic), delete all but the newest --ckpt.keep; killed anywhere,
    the newest complete one is still listed. A failed write on any rank removes the .tmp; OSError names the disk."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp, old = final + ".tmp", final + ".old"
    if rank.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftover
        os.makedirs(tmp)
    dist.barrier()
    failure = None
    try:
        dcp.save(checkpoint_state(rank), checkpoint_id=os.path.join(tmp, "dcp"))  # a failed rank fails it on every rank
        if rank.ckpt.save_hf:
            write_hf_dir(rank, os.path.join(tmp, "hf"))  # its collectives run before its writes: no rank skips one
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
               "cuda": torch.cuda.get_rng_state_all() if rank.cuda else None}
        torch.save(rng, os.path.join(tmp, f"rng_rank{rank.rank}.pt"))
        if rank.rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"step": step, "version": rank.version, "optimizer_steps": rank.optimizer_steps,
                           "world_size": rank.world_size, "data_position": data_position,
                           **{key: [s.scale, s.good_steps, s.skipped] for key, s in scalers(rank)}}, f)
    except CheckpointException as e:  # DCP raises it on every rank when one rank's write failed
        failed, (cause, _) = next(iter(e.failures.items()))
        failure = f"{type(cause).__name__}: {cause} on rank {failed}"
    except OSError as e:
        failure = f"{type(e).__name__}: {e} on rank {rank.rank}"
    failures = [None] * rank.world_size
    dist.all_gather_object(failures, failure)  # every rank learns of any failure (after the others' writes)
    if any(failures):
        if rank.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()  # no rank raises before the .tmp is gone: the caller sees the first error at once
        disk = os.path.abspath(root)
        while not os.path.ismount(disk):
            disk = os.path.dirname(disk)
        free = shutil.disk_usage(disk).free / 2**30
        raise OSError(f"checkpoint {final}: {next(f for f in failures if f)}; the disk at {disk} has {free:.2f} "
                      f"GiB free. Removed {tmp}; the earlier checkpoints are untouched")
    if rank.rank == 0:
        if os.path.isdir(final):  # the same step saved again: set the complete one aside, never delete it first
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        for stale in checkpoint_dirs(root)[:-rank.ckpt.keep]:
            shutil.rmtree(stale)
    dist.barrier()
    return final


def load_checkpoint(rank: TrainerRank, path: str) -> dict:
    """Restore model, optimizer, counters and RNG from a complete checkpoint; returns its meta (data position)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world_size"] != rank.world_size:
        raise ValueError(f"checkpoint {path}: written by {meta['world_size']} ranks, this trainer has "
                         f"--train.world_size {rank.world_size} (the RNG state is per rank)")
    state = checkpoint_state(rank)
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(rank.model, rank.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not rank.adapted))  # LoRA: the base stays as loaded
    if rank.critic is not None:
        set_state_dict(rank.critic, rank.critic_optimizer, model_state_dict=state["critic"],
                       optim_state_dict=state["critic_optim"])
    rng = torch.load(os.path.join(path, f"rng_rank{rank.rank}.pt"), weights_only=False)
    for key, restore in (("torch", torch.set_rng_state), ("python", random.setstate), ("numpy", np.random.set_state)):
        restore(rng[key])
    if rank.cuda:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "optimizer_steps" not in meta:  # written when the version counted AdamW steps and the step train steps
        meta = {**meta, "optimizer_steps": meta["version"], "version": meta["step"]}
    rank.version, rank.optimizer_steps = meta["version"], meta["optimizer_steps"]
    for key, scaler in scalers(rank):  # float16: resume at the scales the run had reached (older files: no critic's)
        if scaler.dynamic and key in meta:
            scaler.scale, scaler.good_steps, scaler.skipped = meta[key]
    return meta


def scalers(rank: TrainerRank) -> list[tuple[str, "LossScale"]]:
    """meta.json's key of each optimizer's float16 loss scale."""
    return [("loss_scale", rank.scaler), ("critic_loss_scale", rank.critic_scaler)]


# TrainerRank's methods that are machinery: TrainerGroup.call invokes them by name on the Ray actors
TrainerRank.refit, TrainerRank.write_hf, TrainerRank.save = refit_from, write_hf_dir, save_checkpoint
TrainerRank.load, TrainerRank.enable_batch_invariance = load_checkpoint, enable_batch_invariant_kernels
