"""Precision modes on CPU: the fp16 mode's wiring (engine dtype, the trainer's autocast dtype over float32 masters,
the refit's dtype, dynamic loss scaling) and the batch-invariant mode's refusals and engine switch.

The CPU stack trains and samples in float32, so fp16 and batch invariance are refused there (a trainer run through
TrainerGroup or launch.py never sees them); the trainer's pieces are built here directly, one TrainerRank in this
process on gloo. What they compute against vLLM is measured on the GPU (tests/bench_gpu.py precision).
"""
import dataclasses
import os
import socket

import pytest
import torch

import launch
from estimators import EstimatorArgs
from generator import Segment, VllmArgs, build_engine_args, check_tensor, checkpoint_shapes
from losses import LossArgs
from trainer import (CkptArgs, FsdpArgs, LossScale, TrainArgs, TrainerGroup, TrainerRank, check_args, clip_grad_norm,
                     collate, refit_pairs)

# --- the flags: one predicate ties the two sides' float16 together; CPU refuses what it cannot run


@pytest.mark.parametrize("flags, refused", [
    (["--vllm.dtype", "float16"], "--fsdp.param_dtype float32 with --vllm.dtype float16"),
    (["--fsdp.param_dtype", "float16", "--vllm.dtype", "bfloat16"], "float16 runs on both sides or on neither"),
    (["--vllm.batch_invariant"], "--vllm.batch_invariant with --fsdp.compile_logprobs"),
    (["--fsdp.param_dtype", "float16", "--vllm.dtype", "float16"], None),
    (["--fsdp.param_dtype", "bfloat16", "--vllm.dtype", "bfloat16"], None),
    (["--vllm.batch_invariant", "--no-fsdp.compile_logprobs"], None),
])
def test_launch_refuses_an_engine_that_computes_in_another_precision_than_the_trainer(flags, refused, capsys):
    argv = ["--launch.model", "m", *flags]
    if refused is None:
        launch.parse_args(argv)
        return
    with pytest.raises(SystemExit):
        launch.parse_args(argv)
    assert refused in capsys.readouterr().err


@pytest.mark.parametrize("flags, engine", [
    ([], "auto"),  # float32 training: the engine takes the checkpoint's dtype (engine_dtype)
    (["--fsdp.param_dtype", "bfloat16"], "bfloat16"),  # it samples in the dtype the trainer computes in
    (["--fsdp.param_dtype", "float16"], "float16"),
    (["--fsdp.param_dtype", "bfloat16", "--vllm.dtype", "float32"], "float32"),  # set: kept
])
def test_engine_dtype_auto_follows_the_trainers_param_dtype(flags, engine):
    assert launch.parse_args(["--launch.model", "m", *flags])["vllm"].dtype == engine


def test_cpu_refuses_fp16_and_batch_invariance_before_anything_starts(tiny_model):
    with pytest.raises(ValueError, match="--fsdp.param_dtype float16 on CPU"):
        check_args(TrainArgs(), FsdpArgs(param_dtype="float16"), LossArgs(), EstimatorArgs(), cuda=False)
    with pytest.raises(ValueError, match="--vllm.batch_invariant on a CPU engine: .* Triton kernels"):
        build_engine_args(tiny_model, VllmArgs(batch_invariant=True), cuda=False)
    with pytest.raises(ValueError, match="--vllm.batch_invariant on a CPU trainer"):
        TrainerGroup("unused", TrainArgs(), FsdpArgs(compile_logprobs=False), CkptArgs(), LossArgs(), EstimatorArgs(),
                     temperature=1.0, gpus_per_rank=0, batch_invariant=True)  # refused before any actor starts


def test_gpu_engine_gets_float16_and_vllms_batch_invariant_switch(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # restored after the test
    args = build_engine_args(tiny_model, VllmArgs(dtype="float16"), cuda=True)
    assert args.dtype == "float16" and os.environ["VLLM_BATCH_INVARIANT"] == "0"
    build_engine_args(tiny_model, VllmArgs(dtype="float16", batch_invariant=True), cuda=True)
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1"  # the engine's processes start with it


# --- dynamic loss scaling: pure pieces on hand-made tensors


def test_loss_scale_skips_a_nonfinite_step_halves_and_grows_back():
    s = LossScale(dynamic=True, scale=8.0, growth_steps=3)
    assert s.update(True) and s.update(True) and s.scale == 8.0  # 2 finite steps of the 3 that double it
    assert not s.update(False) and (s.scale, s.good_steps, s.skipped) == (4.0, 0, 1)  # skipped, halved, count reset
    assert s.update(True) and s.update(True) and s.scale == 4.0
    assert s.update(True) and (s.scale, s.good_steps) == (8.0, 0)  # the 3rd finite step in a row doubles it
    fixed = LossScale(dynamic=False)
    assert fixed.update(True) and (fixed.scale, fixed.skipped) == (1.0, 0)  # float32 / bfloat16: no scaling
    with pytest.raises(FloatingPointError, match="float32 / bfloat16: no scaling"):  # nothing to back off: no step
        fixed.update(False)


def test_loss_scale_backs_off_to_a_floor_of_1_then_stops():
    # From 2^16, 16 non-finite steps halve it to exactly 2^16 / 2^16 = 1. Another one cannot be a float16 overflow
    # (the loss is unscaled): stop, naming it. Without the floor 1,091 in a row reached 0.0 (denormal from the
    # 1,039th), and clip_grad_norm's division by the scale raised ZeroDivisionError.
    s = LossScale(dynamic=True, scale=2.0 ** 16)
    assert not any(s.update(False) for _ in range(16)) and (s.scale, s.skipped) == (1.0, 16)
    with pytest.raises(FloatingPointError, match="loss scale 1.0 \\(float16 at its floor\\)"):
        s.update(False)
    assert (s.scale, s.skipped) == (1.0, 16)
    odd = LossScale(dynamic=True, scale=1.5)  # a scale between 1 and 2 halves to the floor, not below
    assert not odd.update(False) and odd.scale == 1.0


def test_clip_divides_out_the_loss_scale_in_the_same_pass():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0]) * 1024  # the gradient of a loss x 1024
    assert clip_grad_norm([p], None, 1024.0) == 5.0  # sqrt(3^2 + 4^2), unscaled
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))  # 1024 is a power of 2: exact
    p.grad = torch.tensor([3.0, 4.0]) * 1024
    assert clip_grad_norm([p], 1.0, 1024.0) == 5.0
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]))  # unscaled, then clipped to norm 1: (3, 4) / 5
    p.grad = torch.tensor([float("inf"), 4.0])
    assert clip_grad_norm([p], 1.0, 1024.0) == float("inf")  # the caller skips this step


# --- one float16 TrainerRank in this process (gloo, world size 1): the pieces TrainerGroup refuses on CPU


@pytest.fixture(scope="module")
def fp16_rank(tiny_chars_model):
    threads = torch.get_num_threads()  # a CPU rank takes one thread: give the session's back after
    rank = TrainerRank(0, 1, tiny_chars_model, TrainArgs(lr=1e-2, critic_lr=1e-2), FsdpArgs(param_dtype="float16"),
                       CkptArgs(), LossArgs(), EstimatorArgs(name="gae"), temperature=1.0)  # a critic: its own scale
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port)
    yield rank
    rank.shutdown()
    torch.set_num_threads(threads)


def sft_rows() -> list[Segment]:
    ids = [[5, 9, 12, 30, 31, 40, 7, 8], [6, 10, 11, 20, 21, 22]]
    return [Segment(token_ids=r, action_mask=[False] * 3 + [True] * (len(r) - 3), logprobs=[0.0] * len(r),
                    versions=[-1] * 3 + [0] * (len(r) - 3), episode_id=f"e{i}", group_id=f"g{i}")
            for i, r in enumerate(ids)]


def test_fp16_trainer_computes_in_float16_over_float32_masters(fp16_rank):
    rank = fp16_rank
    assert all(p.dtype == torch.float32 for p in rank.model.parameters())  # master weights
    assert rank.autocast(rank.model) and (rank.scaler.dynamic, rank.scaler.scale) == (True, 2.0 ** 16)
    policy = rank.dist_setup.mesh_context.strategy_config.mp_policy  # what FSDP2 casts to with several ranks
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)
    seen = []
    linear = next(m for m in rank.model.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    try:
        x = rank.microbatch(collate(sft_rows()), [0, 1])
        logp, _ = rank.policy_logprobs(rank.model, x, 1.0)
    finally:
        hook.remove()
    assert seen == [torch.float16] and logp.dtype == torch.float32  # matmuls in float16, log-softmax in float32


def test_fp16_loss_scale_is_divided_out_of_the_gradient(fp16_rank):
    """The same batch at scale 2^16 and at scale 1, lr 0 (the weights stay): the reported gradient norm is the
    loss's own in both. Forgetting to scale the loss would make the first 2^16 times smaller, forgetting to divide
    it out 2^16 times larger; float16 rounding moves it by far less than 1%."""
    rank, train = fp16_rank, fp16_rank.train
    rank.train = dataclasses.replace(train, lr=0.0)
    try:
        scaled = rank.sft_step(sft_rows())[0][-1][1]["train/grad_norm"]
        rank.scaler.scale = 1.0
        plain = rank.sft_step(sft_rows())[0][-1][1]["train/grad_norm"]
    finally:
        rank.train, rank.scaler = train, LossScale(True, 2.0 ** 16)
    assert plain > 0 and abs(scaled - plain) < 0.01 * plain, (scaled, plain)


def test_fp16_step_with_an_inf_gradient_is_skipped_and_backs_off(fp16_rank):
    rank, steps = fp16_rank, fp16_rank.optimizer_steps
    params = [p for p in rank.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    params[0].grad[0] = float("inf")  # an overflow in one element of one tensor
    metrics = rank.policy_step(torch.zeros(()))
    assert metrics["train/skipped_steps"] == 1.0 and metrics["train/loss_scale"] == 2.0 ** 15
    assert all(torch.equal(a, p) for a, p in zip(before, params)) and all(p.grad is None for p in params)
    assert rank.optimizer_steps == steps + 1  # a skipped step still advances the lr schedule, as a taken one would
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    metrics = rank.policy_step(torch.zeros(()))
    assert metrics["train/skipped_steps"] == 1.0 and metrics["train/loss_scale"] == 2.0 ** 15
    assert not torch.equal(before[0], params[0])  # a finite gradient takes the step


def test_fp16_refit_export_is_what_a_float16_engine_loads(fp16_rank, tiny_chars_model):
    """The refit casts to the engine's dtype (Generator.dtype: float16 under --vllm.dtype float16) and the engine's
    check accepts exactly that; a float32 tensor is refused (a refit never casts)."""
    shapes, seen = checkpoint_shapes(tiny_chars_model), set()
    bucket = list(refit_pairs(fp16_rank, torch.float16, adapter=False))
    assert len(bucket) == len(shapes) and {n for n, _ in bucket} == set(shapes)
    for name, tensor in bucket:
        assert tensor.dtype == torch.float16
        check_tensor(name, tensor, shapes, "float16", seen)
    with pytest.raises(ValueError, match="torch.float32, the engine runs float16"):
        check_tensor(name, tensor.float(), shapes, "float16", set())


def test_fp16_checkpoint_keeps_the_loss_scale(fp16_rank, tmp_path):
    """A resume must not restart at 2^16 and re-skip the overflowing steps the run had already backed off from."""
    rank = fp16_rank
    rank.optimizer_steps = max(rank.optimizer_steps, 1)  # a trained rank (save's meta records it)
    rank.scaler.scale, rank.scaler.good_steps, rank.scaler.skipped = 2.0 ** 9, 17, 7
    path = rank.save(str(tmp_path), 3, None)
    rank.scaler = LossScale(True, 2.0 ** 16)  # as a fresh rank starts
    rank.load(path)
    assert (rank.scaler.scale, rank.scaler.good_steps, rank.scaler.skipped) == (2.0 ** 9, 17, 7)


def test_fp16_checkpoint_keeps_the_critics_loss_scale(fp16_rank, tmp_path):
    """The critic's scale backs off on its own gradients: a resume that restarts it at 2^16 re-skips the steps it took
    to come down (2^16 -> 2^5: 11 skipped critic steps). A checkpoint written before it was saved still loads."""
    import json
    rank = fp16_rank
    rank.optimizer_steps = max(rank.optimizer_steps, 1)
    rank.scaler = LossScale(True, 2.0 ** 16)
    critic = rank.critic_scaler
    critic.scale, critic.good_steps, critic.skipped = 2.0 ** 5, 3, 11
    path = rank.save(str(tmp_path), 4, None)
    rank.critic_scaler = LossScale(True, 2.0 ** 16)  # as a fresh rank starts
    rank.load(path)
    assert (rank.critic_scaler.scale, rank.critic_scaler.good_steps, rank.critic_scaler.skipped) == (2.0 ** 5, 3, 11)
    assert rank.scaler.scale == 2.0 ** 16  # the policy's own, restored from its own entry
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "critic_loss_scale"}, f)  # an older checkpoint
    rank.critic_scaler = LossScale(True, 2.0 ** 16)
    rank.load(path)
    assert rank.critic_scaler.scale == 2.0 ** 16
