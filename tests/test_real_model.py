"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct (recipes/smollm2.py) through the trainer,
the session's vLLM engine, refit and the HF export.

The tiny random models of the other tests have near-uniform distributions; a real model's peaked ones
and its tied 49k-row embedding make a stale prepacked lm_head or a wrong dtype plain to see. Both sides
run fp32, so the rollout-trainer gap is summation-order noise: measured 7e-6 mean |d log p| on this stack.
The bound MATCH = 1e-4 sits 10x above that and ~400x below a bf16 engine's gap (0.044, measured).
Expected model numbers come from the model card / GGUF metadata, not from the converted files.
"""
import asyncio
import functools
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipes.smollm2 as smollm2
from estimators import EstimatorArgs
from generator import Generator, RolloutArgs, Segment, VllmArgs
from losses import LossArgs
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup

run = asyncio.run
MATCH = 1e-4  # mean |d log p| of two fp32 forwards of the same weights (see the docstring)
LR = 1e-3  # Adam's first step moves every weight with a gradient by ~lr: log-probs move by ~0.1 or more
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.", "What is 2 + 3?"]
SAMPLES = 2  # per question: a GRPO group, rewards 0 and 1 so the advantages are nonzero


def mean_abs(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().mean().item()


@functools.cache
def prompts(model_dir: str) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in QUESTIONS]


def sample(gen: Generator, model_dir: str, version: int) -> tuple[list[Segment], list[list[int]]]:
    """SAMPLES seeded completions per question as Segments labelled `version` (the weights the engine holds),
    and the versions the engine reported per sampled token."""
    async def all_of():
        return await asyncio.gather(*[gen.generate(p, seed=s) for p in prompts(model_dir) for s in range(SAMPLES)])
    segments, completions = [], run(all_of())
    for k, c in enumerate(completions):
        p, n = prompts(model_dir)[k // SAMPLES], len(c.token_ids)
        segments.append(Segment(token_ids=p + c.token_ids, action_mask=[False] * len(p) + [True] * n,
                                logprobs=[0.0] * len(p) + c.logprobs, versions=[-1] * len(p) + [version] * n,
                                reward=float(k % SAMPLES), episode_id=f"e{k}", group_id=f"q{k // SAMPLES}",
                                finish_reason=c.finish_reason))
    return segments, [c.versions for c in completions]


def actions(segments: list[Segment], logps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine, recomputed) log-probs of every action token of the batch, flattened."""
    mask = [torch.tensor(s.action_mask) for s in segments]
    engine = torch.cat([torch.tensor(s.logprobs)[m] for s, m in zip(segments, mask)])
    return engine, torch.cat([lp[m] for lp, m in zip(logps, mask)])


def hf_logprobs(model, segments: list[Segment]) -> list[torch.Tensor]:
    """Plain transformers teacher forcing, log_softmax(logits) at the next token, 0 at t = 0."""
    out = []
    with torch.no_grad():
        for s in segments:
            ids = torch.tensor([s.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), logp]))
    return out


def refit_from(trainer: TrainerGroup, gen: Generator) -> dict:
    """pause -> the trainer's refit -> resume, resuming even when it is refused."""
    run(gen.pause())
    try:
        return trainer.refit(gen)
    finally:
        run(gen.resume())


async def refit_with(gen: Generator, weights: dict, version: int) -> None:
    """pause -> update_weights -> resume, resuming even when it is refused."""
    await gen.pause()
    try:
        await gen.update_weights(sorted(weights.items()), version)
    finally:
        await gen.resume()


@pytest.fixture(scope="module")
def trainer(ray_local, smollm2_model):
    group = TrainerGroup(smollm2_model, TrainArgs(lr=LR), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                         temperature=1.0, gpus_per_rank=0)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def sampled(smollm2_generator, smollm2_model, trainer) -> list[Segment]:
    """Completions of the engine's start-up weights, which are the trainer's version 0."""
    assert trainer.version == 0, "needs the untouched weights"
    return sample(smollm2_generator, smollm2_model, trainer.version)[0]


@pytest.fixture(scope="module")
def stepped(trainer, sampled, tmp_path_factory) -> dict:
    """One RL step at LR on the sampled batch; the weights after it, by HF name, as the HF export writes them."""
    trainer.train_step(sampled)
    path = str(tmp_path_factory.mktemp("stepped"))
    trainer.export_hf(path)
    return load_file(os.path.join(path, "model.safetensors"))


# --- recipes/smollm2.py: the package's file, checked, converted


def test_gguf_with_a_wrong_checksum_is_refused_naming_the_file(tmp_path, monkeypatch):
    fake = tmp_path / smollm2.GGUF
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setattr(smollm2, "find_gguf", lambda: str(fake))
    with pytest.raises(RuntimeError, match=f"{fake}: SHA-256 [0-9a-f]{{64}}, expected {smollm2.SHA256}"):
        smollm2.smollm2_dir(str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == [smollm2.GGUF]  # nothing was converted or half-written


@pytest.mark.slow
def test_converted_model_has_smollm2_135m_shape(smollm2_model):
    config = json.load(open(os.path.join(smollm2_model, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    with safe_open(os.path.join(smollm2_model, "model.safetensors"), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert "lm_head.weight" not in shapes and shapes["model.embed_tokens.weight"] == [49152, 576]
    # embedding 49152*576 = 28,311,552; a layer: q, o 576^2 each, k, v 576*192 each, MLP 3*576*1536, two
    # norms of 576 = 3,540,096; 30 layers = 106,202,880; the final norm 576: total 134,515,008
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 134_515_008


# --- trainer and engine compute the same function, before and after a refit


@pytest.mark.slow
def test_trainer_logprobs_match_engine_sampling_logprobs(trainer, sampled):
    assert all(sum(s.action_mask) >= 4 for s in sampled)
    engine, ours = actions(sampled, trainer.logprobs(sampled))
    assert mean_abs(engine, ours) <= MATCH and (engine - ours).abs().max() <= 10 * MATCH


@pytest.mark.slow
def test_refit_after_a_large_step_serves_the_new_weights_with_a_fresh_tied_head(
        trainer, sampled, stepped, smollm2_generator, smollm2_model):
    gen = smollm2_generator
    original = load_file(os.path.join(smollm2_model, "model.safetensors"))
    assert set(stepped) == set(original) and "lm_head.weight" not in stepped  # one tied matrix, under its HF name
    moved = (stepped["model.embed_tokens.weight"] - original["model.embed_tokens.weight"]).abs().max()
    assert moved >= 0.5 * LR  # Adam's first step moves an element by ~lr: the embedding (= the head) moved
    try:
        report = refit_from(trainer, gen)
        assert "lm_head.weight" not in {name for bucket in report["applied"] for name, _ in bucket}
        after, versions = sample(gen, smollm2_model, trainer.version)
        assert all(v == [trainer.version] * sum(s.action_mask) for s, v in zip(after, versions))
        engine, ours = actions(after, trainer.logprobs(after))
        assert mean_abs(engine, ours) <= MATCH
        # the check has teeth: the old weights, and the new ones with the old embedding as output head (what
        # the CPU build's stale prepacked tied lm_head computes), both give other log-probs
        model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
        assert mean_abs(engine, actions(after, hf_logprobs(model, after))[1]) > 100 * MATCH
        model.load_state_dict(stepped, strict=False)
        model.lm_head.weight = torch.nn.Parameter(original["model.embed_tokens.weight"])  # untied, old
        assert mean_abs(engine, actions(after, hf_logprobs(model, after))[1]) > 100 * MATCH
    finally:
        run(refit_with(gen, original, gen.version + 1))


@pytest.mark.slow
def test_hf_export_reloads_in_transformers_and_vllm_with_the_trainers_logprobs(
        trainer, sampled, stepped, smollm2_model, tmp_path):
    path = str(tmp_path / "hf")
    trainer.export_hf(path)
    on_disk = load_file(os.path.join(path, "model.safetensors"))
    assert on_disk.keys() == stepped.keys() and all(torch.equal(on_disk[k], stepped[k]) for k in stepped)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # tied again
    _, hf = actions(sampled, hf_logprobs(reloaded, sampled))
    _, trained = actions(sampled, trainer.logprobs(sampled))
    assert mean_abs(hf, trained) <= 1e-5  # the same torch kernels, other thread counts
    gen = Generator(path, VllmArgs(max_model_len=512, kv_cache_gb=0.25), RolloutArgs(max_new_tokens=16))
    try:
        fresh = sample(gen, path, trainer.version)[0]
    finally:
        run(gen.shutdown())
    engine, ours = actions(fresh, trainer.logprobs(fresh))
    assert mean_abs(engine, ours) <= MATCH
