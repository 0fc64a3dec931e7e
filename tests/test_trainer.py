"""trainer.py on CPU: real Ray actors, real FSDP2 (gloo) through NeMo AutoModel, the tiny chars model.

References are independent of the trainer: a plain transformers forward of the same weights, the
checkpoint's own safetensors file, and counts derived by hand. Trainer groups are module-scoped
(each start costs ~15 s of imports); tests that need untouched weights say so and come first.
"""
import json
import math
import os
import random
import shutil
import socket
import tempfile

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from estimators import EstimatorArgs
from generator import Segment
from losses import LossArgs
from trainer import (CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, TrainerRank, check_args, collate, lr_at, mfu,
                     model_flops, pad_frac, plan_step, refit_pairs, sft_batch, token_logprobs, zero_dropout)

VOCAB = 72  # tiny_chars_model


def make_segments(version: int = 0, *, groups: int = 3, per_group: int = 3, seed: int = 0,
                  reward=None) -> list[Segment]:
    """Prompt groups of random ids with random-length completions (ragged rows exercise padding)."""
    rng = random.Random(seed)
    segments = []
    for g in range(groups):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))]
        for k in range(per_group):
            completion = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 10))]
            mask = [False] * len(prompt) + [True] * len(completion)
            segments.append(Segment(token_ids=prompt + completion, action_mask=mask,
                                    logprobs=[-4.0 if m else 0.0 for m in mask],
                                    versions=[version if m else -1 for m in mask],
                                    reward=rng.random() if reward is None else reward,
                                    episode_id=f"e{g}.{k}", group_id=f"g{g}"))
    return segments


def start_group(model_path, *, world_size=1, ckpt=None, loss=None, estimator=None, temperature=1.0, fsdp=None,
                **train) -> TrainerGroup:
    train = TrainArgs(**{"lr": 1e-3, "world_size": world_size, **train})
    return TrainerGroup(model_path, train, fsdp or FsdpArgs(), ckpt or CkptArgs(), loss or LossArgs(),
                        estimator or EstimatorArgs(), temperature=temperature, gpus_per_rank=0)


def exported(group: TrainerGroup) -> dict[str, torch.Tensor]:
    """The group's weights by HF name, as vLLM loads them: its HF export's safetensors file."""
    with tempfile.TemporaryDirectory() as path:
        group.export_hf(path)
        return load_file(os.path.join(path, "model.safetensors"))


def hf_logprobs(model, segments, temperature) -> list[torch.Tensor]:
    """Reference: one plain transformers forward per row, log_softmax(logits / T) at the next token."""
    out = []
    with torch.no_grad():
        for seg in segments:
            ids = torch.tensor([seg.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double() / temperature, -1)  # (T-1, V)
            out.append(torch.cat([torch.zeros(1), logp.gather(-1, ids[0, 1:, None])[:, 0].float()]))
    return out


def hf_model_with(model_path, weights) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied: lm_head is embed_tokens
    return model.eval()


@pytest.fixture(scope="module")
def ws1(ray_local, tiny_chars_model, tmp_path_factory):
    group = start_group(tiny_chars_model, ckpt=CkptArgs(dir=str(tmp_path_factory.mktemp("ckpt")), save_hf=True))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def ws2(ray_local, tiny_chars_model):
    # the head in chunks of 7 tokens under FSDP2 (its weight gathered for each chunk's remake in backward); ws1's step
    # takes the default chunk (all of a step's tokens at once): test_world_size_2_step_equals_world_size_1_step
    group = start_group(tiny_chars_model, world_size=2, fsdp=FsdpArgs(logprob_chunk=7))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def ws1_after_one_step(ws1):
    """The world-size-1, one-microbatch reference step: (metrics, parameters after it)."""
    assert ws1.version == 0, "this fixture needs the untouched weights"
    metrics = ws1.train_step(make_segments())
    return metrics, exported(ws1)


# --- pure functions

def test_microbatch_plan_bounds_padded_tokens_and_gives_every_rank_the_same_count():
    lengths = [10, 3, 7, 7, 2, 9]
    plan = plan_step(lengths, minibatches=2, dp_size=2, max_tokens=16)
    # minibatch 0 = rows 0-2, minibatch 1 = rows 3-5 (contiguous); longest first to the least-loaded rank:
    # mb0: 0 (10) -> rank 0, 2 (7) -> rank 1, 1 (3) -> rank 1 (load 7 < 10); rank 1 packs [2, 1]: 2 x 7 = 14 <= 16
    assert plan[0] == [[[0]], [[2, 1]]]
    # mb1: 5 (9) -> rank 0, 3 (7) -> rank 1, 4 (2) -> rank 1; [3, 4] = 2 x 7 = 14 <= 16
    assert plan[1] == [[[5]], [[3, 4]]]
    # positions computed: [0] 1 x 10, [2, 1] 2 x 7, [5] 1 x 9, [3, 4] 2 x 7 = 47; real tokens 10+10+9+9 = 38
    assert pad_frac(lengths, plan) == pytest.approx(9 / 47)
    tight = plan_step(lengths, minibatches=1, dp_size=2, max_tokens=10)
    assert [len(r) for r in tight[0]] == [len(tight[0][0])] * 2  # the short rank is padded with empty microbatches
    for rank in tight[0]:
        for micro in rank:
            assert not micro or len(micro) * max(lengths[i] for i in micro) <= 10
    assert sorted(i for rank in tight[0] for micro in rank for i in micro) == list(range(6))
    with pytest.raises(ValueError, match="segment 0: 10 tokens > --train.max_tokens_per_microbatch 9"):
        plan_step(lengths, minibatches=1, dp_size=1, max_tokens=9)


def pack_rank(model_path: str, max_tokens: int) -> TrainerRank:
    """A rank as far as --train.pack's layout and policy_logprobs need: no process group, no loaded model."""
    rank = TrainerRank(0, 1, model_path, TrainArgs(pack=True, max_tokens_per_microbatch=max_tokens), FsdpArgs(),
                       CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0)
    rank.dp_size, rank.compute_dtype, rank.image_id, rank.blank = 1, torch.float32, None, None
    return rank


def test_pack_fills_rows_first_fit_and_restarts_positions_at_each_segment():
    lengths = [10, 3, 7, 7, 2, 9]
    # longest first, each into the first row with room for it (16 tokens): 0 (10) -> row a; 5 (9): a would hold 19
    # -> row b; 2 (7): a 17, b 16 -> b; 3 (7): a 17, b 23 -> row c; 1 (3): a 13 -> a; 4 (2): a 15 -> a
    plan = plan_step(lengths, minibatches=1, dp_size=1, max_tokens=16, pack=True)
    assert plan == [[[[0, 1, 4], [5, 2], [3]]]]
    # 3 packed rows x 16 positions = 48, real tokens 38 (the filled layout's 4 microbatches would compute 51)
    assert pad_frac(lengths, plan, packed=16) == pytest.approx(10 / 48)
    rank = pack_rank("unused", 16)
    ids = [[100 + k for k in range(n)] for n in (10, 3, 2)]  # rows 0, 1, 4 with distinct ids
    segments = [Segment(token_ids=row, action_mask=[False] + [True] * (len(row) - 1), logprobs=[0.0] * len(row),
                        versions=[-1] + [0] * (len(row) - 1), episode_id=f"e{i}", group_id="g") for i, row in
                enumerate(ids)]
    row, pos, index = rank.packed(rank.microbatch(collate(segments), [0, 1, 2]))
    assert row.tolist() == [ids[0] + ids[1] + ids[2] + [0]]  # end to end; the 16th token is the filler's
    assert pos.tolist() == [list(range(10)) + [0, 1, 2] + [0, 1] + [0]]
    # rows start at offsets 0, 10, 13; t = 0 and padding read nothing (0): t = 0's place predicts across rows
    assert index.tolist() == [list(range(10)), [0, 11, 12] + [0] * 7, [0, 14] + [0] * 8]


def test_pack_is_refused_where_it_cannot_run_naming_the_flags(tiny_moe_model, tmp_path):
    with pytest.raises(ValueError, match="--train.pack with --train.routing_replay"):
        TrainArgs(pack=True, routing_replay=True)
    with pytest.raises(ValueError, match="--train.pack on CPU"):  # FlexAttention does not support backward on CPU
        check_args(TrainArgs(pack=True), FsdpArgs(), LossArgs(), EstimatorArgs(), cuda=False)
    with pytest.raises(ValueError, match="--train.pack with --fsdp.tp_size > 1"):
        check_args(TrainArgs(pack=True, world_size=2), FsdpArgs(tp_size=2), LossArgs(), EstimatorArgs(), cuda=True)
    check_args(TrainArgs(pack=True), FsdpArgs(), LossArgs(), EstimatorArgs(), cuda=True)
    with pytest.raises(ValueError, match="--train.pack with .* NeMo's Qwen3-MoE class"):  # before any actor starts
        TrainerGroup(tiny_moe_model, TrainArgs(pack=True), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                     temperature=1.0, gpus_per_rank=1.0)
    from recipes.tiny_vlm import build_tiny_vlm
    with pytest.raises(ValueError, match="--train.pack with .* a VLM's image runs"):
        TrainerGroup(build_tiny_vlm(str(tmp_path), seed=0), TrainArgs(pack=True), FsdpArgs(), CkptArgs(), LossArgs(),
                     EstimatorArgs(), temperature=1.0, gpus_per_rank=1.0)


def test_compile_layers_is_refused_where_it_cannot_run_naming_the_flags():
    compiled = FsdpArgs(compile_layers=True)
    with pytest.raises(ValueError, match="--fsdp.compile_layers on CPU"):
        check_args(TrainArgs(), compiled, LossArgs(), EstimatorArgs(), cuda=False)
    with pytest.raises(ValueError, match="--fsdp.compile_layers .* --train.routing_replay"):
        check_args(TrainArgs(routing_replay=True), compiled, LossArgs(), EstimatorArgs(), cuda=True)
    check_args(TrainArgs(), compiled, LossArgs(), EstimatorArgs(), cuda=True)
    with pytest.raises(ValueError, match="--vllm.batch_invariant with --fsdp.compile_layers"):  # before any actor
        TrainerGroup("unused", TrainArgs(), compiled, CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0,
                     gpus_per_rank=1.0, batch_invariant=True)


def test_packed_forward_under_flex_attention_equals_each_row_alone(tiny_chars_model):
    # torch runs flex_attention's backward only on GPUs (test_gpu.py trains a packed step): here the forward
    segments = make_segments()[:4]
    rank = pack_rank(tiny_chars_model, 64)
    x = rank.microbatch(collate(segments), [0, 1, 2, 3])
    lengths = x["lengths"].tolist()
    assert sum(lengths) <= 64
    flex = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32,
                                                attn_implementation="flex_attention").eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logp, h = rank.policy_logprobs(flex, x, 1.0, entropy=True, every=True)  # (b, t), via rank.packed and unpack
        asked = rank.policy_logprobs(flex, x, 1.0, entropy=True)  # the action tokens only, 0 elsewhere
        for a, b in zip(asked, (logp, h)):
            assert torch.equal(a, torch.where(x["mask"], b, 0.0))
        assert logp.shape == x["ids"].shape
        for i, (seg, expected) in enumerate(zip(segments, hf_logprobs(plain, segments, 1.0))):
            assert torch.allclose(logp[i, :lengths[i]], expected, atol=1e-5), i
            assert not logp[i, lengths[i]:].any()
            alone = token_logprobs(plain(input_ids=torch.tensor([seg.token_ids])).logits, torch.tensor([seg.token_ids]),
                                   1.0, entropy=True, entropy_grad=False)[1]
            assert torch.allclose(h[i, :lengths[i]], alone[0], atol=1e-5), i
        # the mask does the work: one causal row over the same ids (positions 0..N-1) lets row 2 on see earlier rows
        ids, _, index = rank.packed(x)
        causal = rank.unpack(token_logprobs(flex(input_ids=ids, use_cache=False).logits, ids, 1.0, entropy=False,
                                            entropy_grad=False)[0], index)
        for i in range(1, len(segments)):
            assert (causal[i] - logp[i]).abs().max() > 1e-2, i

def test_chunked_head_gives_the_whole_logits_log_probs_entropy_and_gradients_never_holding_them(tiny_chars_model):
    # --fsdp.logprob_chunk 5 against 0 (the whole (N, V) logits) on the same weights, temperature 0.7, the entropy in
    # the loss (its gradient too): equal values and parameter gradients at the action tokens, and the head never sees
    # more than 5 rows. In chunks it sees only the M positions that predict an action token (0 elsewhere); asked for
    # every position (TrainerGroup.logprobs), all N, equal to the whole logits' there too
    segments = make_segments()
    batch = collate(segments)
    calls = []
    out = {}
    for chunk in (5, 0):
        rank = TrainerRank(0, 1, tiny_chars_model, TrainArgs(), FsdpArgs(logprob_chunk=chunk), CkptArgs(),
                           LossArgs(entropy_coef=0.01), EstimatorArgs(), temperature=0.7)
        rank.dp_size, rank.compute_dtype, rank.image_id, rank.blank = 1, torch.float32, None, None
        model = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32)
        plain = model.lm_head.forward
        model.lm_head.forward = lambda h, plain=plain, chunk=chunk: (calls.append((chunk, h.shape[:-1].numel())),
                                                                               plain(h))[1]
        x = rank.microbatch(batch, list(range(len(segments))))
        B, T = x["ids"].shape  # rows x the longest row
        logp, h = rank.policy_logprobs(model, x, 0.7, entropy=True)
        weights = torch.randn(2, B, T, generator=torch.Generator().manual_seed(0)) * x["mask"]
        ((logp * weights[0]).sum() + (h * weights[1]).sum()).backward()
        with torch.no_grad():
            every = rank.policy_logprobs(model, x, 0.7, entropy=True, every=True)
        out[chunk] = logp.detach(), h.detach(), {n: p.grad for n, p in model.named_parameters()}, every
    # M action tokens (each completion's, after a prompt: none at t = 0) in 5-row chunks: M // 5 full ones and one
    # of M % 5 rows in forward, then backward remakes each, last first; then every position, N = B x T, no backward
    M, N = sum(sum(s.action_mask) for s in segments), B * T
    cut = lambda n: [5] * (n // 5) + ([n % 5] if n % 5 else [])
    assert [n for c, n in calls if c == 5] == cut(M) + cut(M)[::-1] + cut(N)
    assert [n for c, n in calls if c == 0] == [N, N]  # the whole path: one (N, V) call, kept for backward; then again
    (logp5, h5, grads5, every5), (logp0, h0, grads0, _) = out[5], out[0]
    mask = x["mask"]
    assert logp0[:, 1:].abs().min() > 0 and h0[:, 1:].min() > 0  # not trivially equal
    assert torch.allclose(logp5[mask], logp0[mask], atol=1e-6, rtol=0)
    assert torch.allclose(h5[mask], h0[mask], atol=1e-6, rtol=0)
    assert not logp5[~mask].any() and not h5[~mask].any()  # prompts, padding and t = 0: nothing asked, 0
    for a, b in zip(every5, (logp0, h0)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    for name, grad in grads0.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(grads5[name], grad, atol=1e-6, rtol=1e-5), name


def test_chunked_head_refuses_a_model_that_rescales_its_logits_after_the_head(tiny_chars_model):
    # Gemma-2's softcapping, Cohere's logit_scale, Granite's logits_scaling act on the head's output, which in
    # chunks is log-probs: the run must say so, not train on rescaled log-probs
    from trainer import install_head
    rank = TrainerRank(0, 1, tiny_chars_model, TrainArgs(), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                       temperature=1.0)
    for key, value in (("final_logit_softcapping", 30.0), ("logit_scale", 0.0625), ("logits_scaling", 8.0)):
        model = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32)
        setattr(model.config, key, value)
        with pytest.raises(ValueError, match=f"--fsdp.logprob_chunk with .*{key} rescales .* --fsdp.logprob_chunk 0"):
            install_head(rank, model)
    model = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32)
    model.config.logit_scale = 1.0  # a scale of 1 changes nothing
    install_head(rank, model)
    assert model.chunked_head


def test_token_logprobs_shift_by_one_and_scale_by_temperature():
    # row 0 at t = 0: logits (0, 2 ln 3) / T=2 -> p = (1/4, 3/4); row 1 at t = 1: (ln 4, 0) / 2 -> p = (2/3, 1/3)
    ln = torch.log
    logits = torch.zeros(2, 3, 2)
    logits[0, 0, 1] = 2 * ln(torch.tensor(3.0))
    logits[1, 1, 0] = 2 * ln(torch.tensor(2.0))
    logits.requires_grad_(True)
    ids = torch.tensor([[0, 1, 0], [1, 1, 0]])
    logp, h = token_logprobs(logits, ids, 2.0, entropy=True, entropy_grad=False)
    H = lambda *p: -sum(q * torch.log(torch.tensor(q)) for q in p)
    # t = 0 is 0; row 0: t=1 reads (1/4, 3/4) at id 1, t=2 uniform; row 1: t=1 uniform, t=2 reads (2/3, 1/3) at id 0
    assert torch.allclose(logp, torch.tensor([[0.0, ln(torch.tensor(0.75)), ln(torch.tensor(0.5))],
                                              [0.0, ln(torch.tensor(0.5)), ln(torch.tensor(2 / 3))]]), atol=1e-6)
    assert torch.allclose(h, torch.tensor([[0.0, H(0.25, 0.75), H(0.5, 0.5)],
                                           [0.0, H(0.5, 0.5), H(2 / 3, 1 / 3)]]), atol=1e-6)
    assert logp.requires_grad and not h.requires_grad  # the entropy gets a graph only when the loss uses it
    logp[0, 1].backward()  # d log p_1 / d logits = (onehot(1) - p) / T = ((0 - 1/4) / 2, (1 - 3/4) / 2) at [0, 0]
    expected = torch.zeros(2, 3, 2)
    expected[0, 0] = torch.tensor([-0.125, 0.125])
    assert torch.allclose(logits.grad, expected, atol=1e-6)
    assert token_logprobs(logits, ids, 2.0, entropy=True, entropy_grad=True)[1].requires_grad


def test_cosine_schedule_warms_up_then_decays_to_zero():
    # warmup 2: steps 0, 1 -> 1/2, 2/2; then cos over steps 2..6: progress 0, 0.5, 1 -> 1, 0.5, 0
    lr = [lr_at(s, lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6) for s in (0, 1, 2, 4, 6, 9)]
    assert lr == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    assert lr_at(5, lr=0.1, warmup_steps=0, schedule="constant", total_steps=None) == 0.1


def test_mfu_counts_6n_plus_causal_attention_at_each_rows_length_against_the_dense_bf16_peak():
    from transformers import Qwen3Config
    config = Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, head_dim=128,
                         num_key_value_heads=8, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
    # Qwen3-0.6B's N by hand: embedding 151,936 x 1,024 = 155,582,464 (the tied head adds nothing); per layer
    # q 1,024 x 2,048 + k, v 2 x 1,024 x 1,024 + o 2,048 x 1,024 = 6,291,456, MLP 3 x 1,024 x 3,072 = 9,437,184,
    # norms q, k 2 x 128 + input, post 2 x 1,024 = 2,304: 15,730,944 x 28 = 440,466,432; final norm 1,024.
    n = 155_582_464 + 440_466_432 + 1_024  # 596,049,920
    # per token at T = 16,384: 6N = 3,576,299,520, + 6 x 28 x 16,384 x (16 x 128) = 5,637,144,576 -> 9.21 GFLOP
    per_token = 9_213_444_096
    assert model_flops(config, n, [16384]) == 16384 * per_token
    # each row at its own length: two 8,192-token rows, 6N + 6 x 28 x 8,192 x 2,048 = 6,394,871,808 per token
    assert model_flops(config, n, [8192, 8192]) == 2 * 8192 * 6_394_871_808
    # the H200 rates, one 16,384-token row: 24,683 tokens/s x 9.2134e9 / 989e12 = 0.2299 (23%),
    # 30,657 x 9.2134e9 / 989e12 = 0.2856 (28.6%); the step's time is 16,384 / rate
    for rate, expected in ((24683, 0.230), (30657, 0.286)):
        assert round(mfu(model_flops(config, n, [16384]), 16384 / rate, 1, "NVIDIA H200"), 3) == expected
        assert round(mfu(model_flops(config, n, [16384]), 16384 / rate, 1, "NVIDIA H100 80GB HBM3"), 3) == expected
    # two ranks, one such row each, in the same time: twice the FLOPs over twice the peak, the same MFU
    assert mfu(model_flops(config, n, [16384] * 2), 16384 / 24683, 2, "NVIDIA H200") == pytest.approx(0.2299, 1e-3)
    for device in ("cpu", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"):  # no peak of ours: no number at all
        assert mfu(1e15, 1.0, 1, device) is None


def test_cpu_step_logs_no_mfu_and_every_rank_counts_each_parameter_once(ws1_after_one_step, ws2):
    assert "train/mfu" not in ws1_after_one_step[0] and "train/tokens_per_s" in ws1_after_one_step[0]
    # tiny_chars_model's N by hand (hidden 128, 2 layers, 4 x 64 heads, 2 KV heads, MLP 256, 72 ids, tied):
    # embedding 72 x 128 = 9,216; per layer q 128 x 256 + k, v 2 x 128 x 128 + o 256 x 128 = 98,304,
    # MLP 3 x 128 x 256 = 98,304, norms 2 x 64 + 2 x 128 = 384: 196,992 x 2 = 393,984; final norm 128
    assert ws2.call("mfu_facts") == [("cpu", 9216 + 393_984 + 128)] * 2  # FSDP-sharded at world size 2: still N


def test_flag_combinations_are_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--train.schedule cosine with --train.total_steps"):
        TrainArgs(schedule="cosine")
    with pytest.raises(ValueError, match="--train.schedule 'linear'"):
        TrainArgs(schedule="linear")
    with pytest.raises(ValueError, match="--ckpt.every / --ckpt.resume / --ckpt.save_hf without --ckpt.dir"):
        CkptArgs(every=5)
    with pytest.raises(ValueError, match="--estimator.name gae with --train.critic_lr None"):
        check_args(TrainArgs(), FsdpArgs(), LossArgs(), EstimatorArgs(name="gae"), cuda=False)
    with pytest.raises(ValueError, match="--estimator.name grpo with --train.critic_lr 0.1"):
        check_args(TrainArgs(critic_lr=0.1), FsdpArgs(), LossArgs(), EstimatorArgs(), cuda=False)
    check_args(TrainArgs(critic_lr=0.1), FsdpArgs(), LossArgs(), EstimatorArgs(name="gae"), cuda=False)
    with pytest.raises(ValueError, match="--estimator.kl_coef > 0 with --loss.kl_ref rollout"):
        check_args(TrainArgs(), FsdpArgs(), LossArgs(), EstimatorArgs(name="reinforce", kl_coef=0.1), cuda=False)
    check_args(TrainArgs(), FsdpArgs(), LossArgs(kl_ref="model"), EstimatorArgs(name="reinforce", kl_coef=0.1),
               cuda=False)
    with pytest.raises(ValueError, match="--fsdp.param_dtype bfloat16 on CPU"):
        TrainerGroup("unused", TrainArgs(), FsdpArgs(param_dtype="bfloat16"), CkptArgs(), LossArgs(), EstimatorArgs(),
                     temperature=1.0, gpus_per_rank=0)  # refused before any actor starts
    with pytest.raises(ValueError, match="--fsdp.offload optimizer on CPU"):
        check_args(TrainArgs(world_size=2), FsdpArgs(offload="optimizer"), LossArgs(), EstimatorArgs(), cuda=False)


def test_sft_mask_covers_exactly_each_assistant_turn_and_its_end_token(tiny_chars_model):
    messages = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "34"},
                 {"role": "user", "content": "5"}, {"role": "assistant", "content": "6"}]
    tok = AutoTokenizer.from_pretrained(tiny_chars_model)
    (seg,) = sft_batch([{"messages": messages}], tok)
    # chars tokenizer: one token per character, role words and ChatML markers are single tokens:
    #  0-6  <|im_start|> user \n 1 2 <|im_end|> \n       7-13  <|im_start|> assistant \n [3 4 <|im_end|>] \n
    # 14-19 <|im_start|> user \n 5 <|im_end|> \n        20-25 <|im_start|> assistant \n [6 <|im_end|>] \n
    tokens = tok.convert_ids_to_tokens(seg.token_ids)
    assert [t for t, m in zip(tokens, seg.action_mask) if m] == ["3", "4", "<|im_end|>", "6", "<|im_end|>"]
    assert [i for i, m in enumerate(seg.action_mask) if m] == [10, 11, 12, 23, 24]
    seg.check()  # a valid Segment: versions 0 on action tokens, -1 elsewhere
    # "weight": 0 (OpenAI's fine-tuning format) keeps a turn as context: the same tokens, only turn 2 trained
    (kept,) = sft_batch([{"messages": [messages[0], {**messages[1], "weight": 0}] + messages[2:]}], tok)
    assert kept.token_ids == seg.token_ids and [i for i, m in enumerate(kept.action_mask) if m] == [23, 24]


# --- the actor: forward consistency and refit export need the untouched weights


def test_recomputed_logprobs_equal_hf_forward(ws2, tiny_chars_model):
    assert ws2.version == 0, "needs the untouched weights"
    segments = make_segments(groups=2, per_group=3, seed=1)
    reference = AutoModelForCausalLM.from_pretrained(tiny_chars_model, dtype=torch.float32).eval()
    ours = {}
    for temperature in (1.0, 0.7):
        ours[temperature] = ws2.logprobs(segments, temperature=temperature)
        expected = hf_logprobs(reference, segments, temperature)
        assert [len(x) for x in ours[temperature]] == [len(s.token_ids) for s in segments]
        for row, (a, b) in enumerate(zip(ours[temperature], expected)):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (
                f"row {row} at T={temperature}: max diff {(a - b).abs().max()}")
    assert (ours[1.0][0] - ours[0.7][0]).abs().max() > 0.1  # the temperature reaches the log-probs


def test_refit_export_covers_every_parameter_once_in_the_engines_dtype(tiny_chars_model):
    """What a refit sends (refit_pairs) from a fresh TrainerRank in this process (gloo, world size 1); the engine
    packs it into buckets (generator.py's iter_buckets, tested in test_generator.py)."""
    threads = torch.get_num_threads()  # a CPU rank takes one thread: give the session's back after
    rank = TrainerRank(0, 1, tiny_chars_model, TrainArgs(), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                       temperature=1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port)
    try:
        on_disk = load_file(os.path.join(tiny_chars_model, "model.safetensors"))  # tied: no lm_head.weight in the file
        sent = list(refit_pairs(rank, torch.float32, adapter=False))  # a float32 engine (the checkpoint's dtype)
        names = [name for name, _ in sent]
        assert len(names) == len(set(names)) and set(names) == set(on_disk)
        for name, tensor in sent:
            assert tensor.dtype == on_disk[name].dtype and torch.equal(tensor, on_disk[name]), name
        cast = list(refit_pairs(rank, torch.bfloat16, adapter=False))  # a bfloat16 engine
        assert [n for n, _ in cast] == names and all(t.dtype == torch.bfloat16 for _, t in cast)
    finally:
        rank.shutdown()
        torch.set_num_threads(threads)


def live_dropout(model: torch.nn.Module) -> list[str]:
    """Where a train-mode forward drops activations: an nn.Dropout's p, a float rate layers read (attention_dropout)."""
    live = []
    for name, m in model.named_modules():
        rates = {"p": m.p} if isinstance(m, torch.nn.Dropout) else {}
        rates.update({k: v for k, v in vars(m).items() if "drop" in k and isinstance(v, float)})
        live += [f"{name}.{k}" for k, v in rates.items() if v > 0]
    return live


def test_config_dropout_is_off_in_every_pass_of_policy_reference_and_critic(ray_local, tiny_chars_model, tmp_path):
    """A config with dropout (attention_dropout 0.5; the critic head's classifier_dropout 0.5). vLLM has none, and the
    trainer keeps its models in train mode (activation checkpointing needs it), so a live rate makes the old, ref and
    new log-probs and the values random: before the fix two identical logprobs() calls differed by up to 0.58."""
    model_path = str(tmp_path / "dropout_model")
    shutil.copytree(tiny_chars_model, model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model_path, "config.json"), "w") as f:
        json.dump({**config, "attention_dropout": 0.5, "classifier_dropout": 0.5}, f)
    threads = torch.get_num_threads()  # a CPU rank takes one thread: give the session's back after
    rank = TrainerRank(0, 1, model_path, TrainArgs(critic_lr=1e-3), FsdpArgs(), CkptArgs(), LossArgs(kl_ref="model"),
                       EstimatorArgs(name="gae"), temperature=1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port)
    try:
        assert [live_dropout(m) for m in (rank.model, rank.ref, rank.critic)] == [[], [], []]
        assert rank.model.training and rank.critic.training  # kept for checkpointing: rates 0 make it harmless
        segments = make_segments(seed=4)
        first, second = rank.logprobs(segments, None), rank.logprobs(segments, None)
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        # and they are the dropout-free function: transformers in eval mode (no dropout) on the same weights
        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        for a, b in zip(first, hf_logprobs(reference, segments, 1.0)):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
        x = rank.microbatch(collate(segments), list(range(len(segments))))
        for model in (rank.model, rank.ref):  # the loss forward (train mode, with grad) and the reference's
            a, b = (rank.policy_logprobs(model, x, 1.0)[0].detach() for _ in range(2))
            assert torch.equal(a, b)
        assert torch.equal(rank.critic_values(x).detach(), rank.critic_values(x).detach())
    finally:
        rank.shutdown()
        torch.set_num_threads(threads)


def test_zero_dropout_silences_gpt2_opt_and_phi_style_rates():
    """GPT-2 drops through nn.Dropout modules, OPT through float rates its layers read (and LayerDrop), Phi both. At
    rate 0.5 a train-mode forward is random; zeroed, it equals the eval-mode one (dropout is the only difference)."""
    from transformers import GPT2Config, OPTConfig, PhiConfig
    small = dict(num_attention_heads=2, vocab_size=50, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = [GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0,
                          resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5),
               OPTConfig(hidden_size=32, num_hidden_layers=1, ffn_dim=64, word_embed_proj_dim=32, **small,
                         dropout=0.5, attention_dropout=0.5, activation_dropout=0.5, layerdrop=0.5),
               PhiConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, **small, resid_pdrop=0.5,
                         embd_pdrop=0.5, attention_dropout=0.5)]
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for config in configs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        with torch.no_grad():
            assert not torch.equal(model(ids).logits, model(ids).logits), type(model).__name__  # dropout is live
            zero_dropout(model)
            assert live_dropout(model) == [] and model.training
            assert torch.equal(model(ids).logits, model.eval()(ids).logits), type(model).__name__


# --- the train step: sharding and microbatching do not change the math


def test_world_size_2_step_equals_world_size_1_step(ws1_after_one_step, ws2, tiny_chars_model):
    metrics1, params1 = ws1_after_one_step
    metrics2 = ws2.train_step(make_segments())
    params2 = exported(ws2)
    initial = load_file(os.path.join(tiny_chars_model, "model.safetensors"))
    assert max(float((params1[k] - initial[k]).abs().max()) for k in initial) > 1e-4  # the step moved the weights
    for name in initial:
        assert torch.allclose(params1[name], params2[name], atol=1e-5, rtol=0), name
    assert metrics1["train/grad_norm"] == pytest.approx(metrics2["train/grad_norm"], rel=1e-5)
    for key in ("train/loss", "train/lr", "train/step_s", "train/tokens_per_s", "loss/pg", "loss/vllm_kl",
                "loss/mismatch_k3", "loss/entropy", "estimator/adv_std"):
        assert key in metrics2
    assert metrics1["train/version"] == metrics2["train/version"] == 1.0
    lengths = [len(s.token_ids) for s in make_segments()]  # world size 1: the 9 rows are one microbatch
    assert metrics1["train/pad_frac"] == pytest.approx(1 - sum(lengths) / (len(lengths) * max(lengths)))


def test_rollout_facts_reach_reward_shaping_inside_the_trainer(ray_local, tiny_chars_model):
    # The rows cross Ray to the rank, which hands estimators.shape_rewards each row's RolloutFacts: 9 episodes at
    # reward 0.5, rows 1 and 4 cut off, --estimator.truncated_reward -1: per episode (7 x 0.5 + 2 x -1) / 9 = 1/6.
    segments = make_segments(reward=0.5)
    for i in (1, 4):
        segments[i].truncated = True
    group = start_group(tiny_chars_model, estimator=EstimatorArgs(truncated_reward=-1.0))
    try:
        assert group.train_step(segments)["estimator/reward_mean"] == pytest.approx(1 / 6)
    finally:
        group.shutdown()


def test_accumulated_microbatches_equal_one_batch(ws1_after_one_step, ray_local, tiny_chars_model):
    metrics_one, params_one = ws1_after_one_step
    segments = make_segments()
    lengths = [len(s.token_ids) for s in segments]
    assert len(plan_step(lengths, minibatches=1, dp_size=1, max_tokens=20)[0][0]) >= 5  # really accumulates
    group = start_group(tiny_chars_model, max_tokens_per_microbatch=20)
    try:
        metrics_acc = group.train_step(segments)
        params_acc = exported(group)
    finally:
        group.shutdown()
    # Adam's first step is lr * g / (|g| + eps): an element whose gradient nearly cancels turns fp32
    # summation-order noise into a visible share of lr (measured: 1e-5 on one element of 16384), so the
    # gradient norm is compared tightly and the parameters to 5% of one step.
    assert metrics_acc["train/grad_norm"] == pytest.approx(metrics_one["train/grad_norm"], rel=1e-6)
    for name, tensor in params_one.items():
        assert torch.allclose(tensor, params_acc[name], atol=5e-5, rtol=0), name


@pytest.mark.slow
def test_top_entropy_tokens_are_chosen_over_the_whole_step_whatever_the_microbatches_and_ranks(
        ws1_after_one_step, ray_local, tiny_chars_model):
    # --loss.top_entropy_frac 0.5 keeps the ceil(N / 2) highest-entropy action tokens of the step's N. Chosen over
    # the whole step (losses.step_tokens), the step is the same with one microbatch on one rank as with microbatches
    # of <= 20 tokens on two ranks; a choice made per microbatch would differ (each would keep its own top half).
    segments = make_segments()
    n = sum(sum(s.action_mask) for s in segments)
    out = []
    for world_size, max_tokens in ((1, 4096), (2, 20)):
        group = start_group(tiny_chars_model, world_size=world_size, max_tokens_per_microbatch=max_tokens,
                            loss=LossArgs(top_entropy_frac=0.5))
        try:
            out.append((group.train_step(segments), exported(group)))
        finally:
            group.shutdown()
    (one, params_one), (split, params_split) = out
    assert one["loss/selected_frac"] == split["loss/selected_frac"] == pytest.approx(math.ceil(n / 2) / n)
    assert split["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
    for name, tensor in params_one.items():
        assert torch.allclose(tensor, params_split[name], atol=5e-5, rtol=0), name
    # Half the tokens train: not the step of every token (ws1_after_one_step, same batch and weights).
    assert abs(one["train/grad_norm"] / ws1_after_one_step[0]["train/grad_norm"] - 1) > 0.05


def test_gradient_checkpointing_changes_neither_the_step_nor_the_export_names(ws1_after_one_step, ray_local,
                                                                             tiny_chars_model):
    metrics_one, params_one = ws1_after_one_step
    group = TrainerGroup(tiny_chars_model, TrainArgs(lr=1e-3, world_size=2), FsdpArgs(gradient_checkpointing=True),
                         CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    try:
        metrics = group.train_step(make_segments())
        params = exported(group)  # NeMo wraps each layer; the export must still use the HF names
    finally:
        group.shutdown()
    assert set(params) == set(params_one)
    assert metrics["train/grad_norm"] == pytest.approx(metrics_one["train/grad_norm"], rel=1e-5)
    for name, tensor in params_one.items():
        assert torch.allclose(tensor, params[name], atol=5e-5, rtol=0), name


# --- checkpoints and exports


def test_hf_export_reloads_with_identical_logits(ws1, ws1_after_one_step, tiny_chars_model, tmp_path):
    path = ws1.save({"prompt_index": 3})
    assert os.path.basename(path) == f"step_{ws1.step:06d}" and not os.path.exists(path + ".tmp")
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(path, "hf")).eval()
    AutoTokenizer.from_pretrained(os.path.join(path, "hf"))  # the tokenizer travels with it
    reference = hf_model_with(tiny_chars_model, exported(ws1))
    ids = torch.tensor([make_segments(seed=2)[0].token_ids])
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    segments = make_segments(seed=2)
    for a, b in zip(ws1.logprobs(segments), hf_logprobs(reloaded, segments, 1.0)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    ws1.export_hf(str(tmp_path / "hf"))  # the same export outside a checkpoint (launch.py's SFT output)
    standalone, in_checkpoint = (load_file(tmp_path / "hf" / "model.safetensors"),
                                 load_file(os.path.join(path, "hf", "model.safetensors")))
    assert standalone.keys() == in_checkpoint.keys() and all(torch.equal(standalone[k], in_checkpoint[k])
                                                             for k in standalone)


def test_resume_is_bit_exact(ws1, ws1_after_one_step, ray_local, tiny_chars_model):
    saved = ws1.save({"prompt_index": 12})
    version = ws1.version
    ws1.train_step(make_segments(version, seed=3))  # step n + 1, uninterrupted
    uninterrupted = exported(ws1)
    os.makedirs(os.path.join(ws1.ckpt.dir, "step_999999.tmp"))  # a half-written checkpoint is never picked up
    resumed = TrainerGroup(tiny_chars_model, TrainArgs(lr=1e-3), FsdpArgs(), CkptArgs(dir=ws1.ckpt.dir, resume=True),
                           LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)  # new processes
    try:
        assert resumed.data_position == {"prompt_index": 12} and resumed.version == version
        assert os.path.basename(saved) == f"step_{resumed.step:06d}"
        resumed.train_step(make_segments(version, seed=3))
        after = exported(resumed)
    finally:
        resumed.shutdown()
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, after[name]), name


def test_version_counts_train_steps_and_the_lr_schedule_optimizer_steps_across_a_resume(ray_local, tiny_chars_model,
                                                                                          tmp_path):
    # --train.minibatches 2 x --train.epochs 2: 4 AdamW steps per train step, one policy version (one refit).
    # Warmup 16 at lr 1e-3: AdamW step s (0-based) runs at 1e-3 (s + 1) / 16, and a train step logs the mean of its 4:
    # steps 0-3 -> 2.5 / 16, steps 4-7 -> 6.5 / 16, and after a resume steps 8-11 -> 10.5 / 16.
    import json
    start = lambda **ckpt: start_group(tiny_chars_model, ckpt=CkptArgs(dir=str(tmp_path), **ckpt), minibatches=2,
                                       epochs=2, warmup_steps=16)
    lr = lambda s: pytest.approx(1e-3 * s / 16, rel=1e-6)
    group = start()
    try:
        metrics = [group.train_step(make_segments(group.version, seed=s)) for s in range(2)]
        path = group.save()
    finally:
        group.shutdown()
    assert [m["train/version"] for m in metrics] == [1.0, 2.0] and [m["train/lr"] for m in metrics] == [lr(2.5),
                                                                                                          lr(6.5)]
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    # A checkpoint written before versions counted refits holds version = its AdamW steps, 8, and no
    # optimizer_steps: it resumes at version 2 (its train steps) with the schedule at AdamW step 8.
    old = {k: v for k, v in meta.items() if k != "optimizer_steps"} | {"version": 8}
    for written in (meta, old):
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(written, f)
        resumed = start(resume=True)
        try:
            assert resumed.version == 2
            after = resumed.train_step(make_segments(2, seed=2))
        finally:
            resumed.shutdown()
        assert after["train/version"] == 3.0 and after["train/lr"] == lr(10.5)


# --- critic, SFT, bad input


@pytest.fixture(scope="module")
def critic_run(ray_local, tiny_chars_model):
    """A policy at lr 0 with a critic trained 8 steps (epochs 2 x minibatches 2) on rewards of 1: (group, metrics)."""
    group = start_group(tiny_chars_model, lr=0.0, critic_lr=3e-3, epochs=2, minibatches=2,
                        loss=LossArgs(kl_ref="model"), estimator=EstimatorArgs(name="gae"))
    history = [group.train_step(make_segments(group.version, reward=1.0, seed=s)) for s in range(8)]
    yield group, history
    group.shutdown()


def test_critic_learns_constant_value(critic_run):
    # Every reward is 1 and gamma = lam = 1, so the GAE return at every action token is exactly 1:
    # the critic's values there must approach 1. Policy lr 0 keeps policy == reference, so the k3 KL
    # to the frozen reference model is exp(0) - 0 - 1 = 0 exactly.
    _, history = critic_run
    assert history[0]["train/value_mean"] < 0.5  # the value head starts at 0
    assert history[-1]["train/value_mean"] == pytest.approx(1.0, abs=0.05)
    assert history[-1]["loss/value"] < 0.01
    assert all(m["loss/kl"] == 0.0 for m in history) and history[-1]["train/version"] == 8  # one per train step


def test_critic_values_are_the_same_on_every_pass_in_train_mode(critic_run):
    # The no-grad pass's "old values" and the loss pass's values must be one function: no dropout in the head
    # (transformers' default for a token-classification head is 0.1), though the critic stays in train mode.
    import ray
    group, _ = critic_run
    actor = group.actors[0]
    ids = torch.tensor([make_segments(seed=9)[0].token_ids])
    assert ray.get(actor.__ray_call__.remote(lambda rank: rank.critic.training))
    first, second = (ray.get(actor.critic_values.remote({"ids": ids})) for _ in range(2))
    assert first.abs().max() > 0.1 and torch.equal(first, second)  # trained values, not the head's initial zeros


def test_sft_loss_only_on_assistant_tokens(ws1, tiny_chars_model):
    tok = AutoTokenizer.from_pretrained(tiny_chars_model)
    examples = [{"messages": [{"role": "user", "content": "12"}, {"role": "assistant", "content": "34"}]},
                {"messages": [{"role": "user", "content": "7"}, {"role": "assistant", "content": "8"},
                              {"role": "user", "content": "9"}, {"role": "assistant", "content": "0"}]}]
    segments = sft_batch(examples, tok)
    reference = hf_model_with(tiny_chars_model, exported(ws1))  # the weights the step starts from
    nll = [-lp[torch.tensor(s.action_mask)] for s, lp in zip(segments, hf_logprobs(reference, segments, 1.0))]
    metrics = ws1.sft_step(segments)
    # the loss is the mean NLL over exactly the assistant tokens (3 + 2 + 2 of them), nothing else
    assert sum(len(x) for x in nll) == 7
    assert metrics["loss/sft_nll"] == pytest.approx(float(torch.cat(nll).mean()), abs=1e-5)
    assert metrics["train/loss"] == pytest.approx(float(torch.cat(nll).mean()), abs=1e-5)


def test_bad_batches_are_refused_naming_the_segment(ws1, ws1_after_one_step):
    segments = make_segments(ws1.version)
    segments[1].action_mask = segments[1].action_mask[:-1]
    with pytest.raises(ValueError, match="segment 1: segment 'e0.1': action_mask has"):
        ws1.train_step(segments)
    with pytest.raises(ValueError, match="segments: empty batch"):
        ws1.train_step([])
    prompt_only = make_segments(ws1.version)[:1]
    prompt_only[0].action_mask = [False] * len(prompt_only[0].token_ids)
    prompt_only[0].logprobs, prompt_only[0].versions = ([0.0] * len(prompt_only[0].token_ids),
                                                        [-1] * len(prompt_only[0].token_ids))
    with pytest.raises(ValueError, match="no action token"):
        ws1.train_step(prompt_only)
    # the version guard: tokens the trainer's weights did not sample need an importance correction
    assert ws1.version >= 1
    with pytest.raises(ValueError, match="stale/mixed policy versions"):
        ws1.train_step(make_segments(ws1.version - 1))
    with pytest.raises(ValueError, match="newer"):
        ws1.train_step(make_segments(ws1.version + 1))


def test_fp32_step_with_a_nonfinite_gradient_stops_before_the_step(ws1, ws1_after_one_step):
    """float32 and bfloat16 build the same non-scaling LossScale: no loss scale can back off from a NaN / inf, so the
    step must not be taken. Before the fix AdamW stepped it: every weight NaN, refit into the engine as such."""
    import ray

    def nan_step(rank):
        params = [p for p in rank.model.parameters() if p.requires_grad]
        before, steps = [p.detach().clone() for p in params], rank.optimizer_steps
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        params[0].grad[0] = float("nan")  # one element of one tensor
        try:
            rank.policy_step(torch.zeros(()))
            error = None
        except FloatingPointError as e:
            error = str(e)
        finally:
            rank.optimizer.zero_grad(set_to_none=True)  # the module's later tests start from clean gradients
        return error, all(torch.equal(a, p) for a, p in zip(before, params)), rank.optimizer_steps - steps

    error, unchanged, steps = ray.get(ws1.actors[0].__ray_call__.remote(nan_step))
    assert error is not None and "non-finite gradient at loss scale 1.0 (float32 / bfloat16" in error
    assert "--train.lr" in error and unchanged and steps == 0


def test_rank_metrics_merge_as_token_weighted_means_except_the_named_extremes():
    from trainer import merge_metrics
    records = [(2.0, {"loss/pg": 1.0, "estimator/adv_max": 3.0, "train/peak_gib": 1.5, "loss/mismatch_max_abs": 0.5}),
               (1.0, {"loss/pg": 4.0, "estimator/adv_max": 5.0, "train/peak_gib": 2.5, "loss/mismatch_max_abs": 0.25}),
               (0.0, {"loss/pg": 100.0})]  # a rank with no action tokens carries no weight
    # loss/pg: (2 x 1 + 1 x 4) / 3 = 2; the extremes: max(3, 5), max(1.5, 2.5) (a mean would give 1.83), max(0.5, 0.25)
    assert merge_metrics(records) == {"loss/pg": 2.0, "estimator/adv_max": 5.0, "train/peak_gib": 2.5,
                                      "loss/mismatch_max_abs": 0.5}
