"""generator.py: token-exact capture over a real vLLM engine (one per session), real Ray, tiny model.

References are independent of the engine: a transformers forward of the same weights (teacher forcing:
logits / T, log_softmax, gather) for log-probs, hand-derived numbers for everything else.
"""
import asyncio
import dataclasses
import copy
import functools
import os
import shutil

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import generator
from generator import (Completion, Generator, RolloutArgs, Segment, VllmArgs, batch_kv_gb, build_engine_args,
                       check_tensor, engine_dtype, iter_buckets, pack, pick_engine, refit_transport, token_versions,
                       unpack, versions_from_spans)
from conftest import held, hold

run = asyncio.run
PROMPT = [5, 17, 300, 42, 9, 77]


@pytest.fixture(scope="module")
def original(tiny_model) -> dict:
    """The engine's start-up weights, by checkpoint name."""
    return load_file(os.path.join(tiny_model, "model.safetensors"))


def perturb(weights: dict) -> dict:
    """Other weights of the same shapes: noise as large as the init (std 0.02) moves log-probs a lot."""
    g = torch.Generator().manual_seed(0)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def copy_with(model_dir: str, weights: dict, out_dir) -> str:
    """The model directory with other weights: transformers loads them itself (it fuses MoE experts)."""
    shutil.copytree(model_dir, out_dir)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


@pytest.fixture(scope="module")
def perturbed(original, tiny_model, tmp_path_factory) -> tuple[dict, str]:
    """Perturbed weights, and a model directory holding them for the reference forward."""
    weights = perturb(original)
    return weights, copy_with(tiny_model, weights, tmp_path_factory.mktemp("perturbed") / "model")


@functools.cache
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def reference(model_dir: str, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Teacher-forced log-probs of completion after prompt, from transformers: log_softmax(logits / T)."""
    with torch.no_grad():
        logits = hf_model(model_dir)(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # (T, V)
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def mean_abs(a, b) -> float:
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().mean().item()


async def refit(gen: Generator, weights: dict | list, version: int) -> dict:
    """pause -> update_weights (a dict goes in name order) -> resume, resuming even when it is refused."""
    await gen.pause()
    try:
        return await gen.update_weights(sorted(weights.items()) if isinstance(weights, dict) else weights, version)
    finally:
        await gen.resume()


def serves(gen: Generator) -> bool:
    return len(run(gen.generate([5, 6], max_new_tokens=2, ignore_eos=True)).token_ids) == 2


# --- pure parts: flags, the data contract, routing, spans, buckets, wire format

@pytest.mark.parametrize("cls, kwargs, match", [
    (VllmArgs, {"enable_expert_parallel": True}, "tensor_parallel_size 1"),
    (VllmArgs, {"kv_cache_gb": -1.0}, "kv_cache_gb"),
    (VllmArgs, {"num_engines": 0}, "num_engines"),
    (VllmArgs, {"cpu_threads": 0}, "cpu_threads"),
    (VllmArgs, {"num_speculative_tokens": -1}, "num_speculative_tokens"),
    (VllmArgs, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    (VllmArgs, {"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_seqs 512"),
    (VllmArgs, {"max_num_seqs": 0}, "max_num_seqs 0"),
    (RolloutArgs, {"temperature": 0.0}, "temperature"),
    (RolloutArgs, {"top_p": 0.0}, "top_p"),
    (RolloutArgs, {"top_k": 0}, "top_k"),
])
def test_flags_refuse_impossible_values_naming_the_flag(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("kwargs, cuda, match", [
    ({"tensor_parallel_size": 2}, False, "need GPUs"),
    ({"return_routed_experts": True}, False, "needs Triton"),
    ({"gpu_memory_utilization": 0.9}, False, "size its KV cache with --vllm.kv_cache_gb"),
    ({"cpu_threads": 4}, True, "cpu_threads on a GPU engine"),
    ({"num_speculative_tokens": 3, "speculative_method": "ngram"}, False, "num_speculative_tokens on a CPU engine"),
])
def test_engine_refuses_flags_its_machine_cannot_honour(tiny_model, kwargs, cuda, match):
    with pytest.raises(ValueError, match=match):
        build_engine_args(tiny_model, VllmArgs(**kwargs), cuda=cuda)


@pytest.mark.parametrize("dtype, expected", [("auto", "float32"), ("float32", "float32"), ("bfloat16", "bfloat16"),
                                             ("float16", "float16")])
def test_engine_dtype_auto_is_the_checkpoints_own(tiny_model, dtype, expected):
    assert engine_dtype(tiny_model, dtype) == expected  # the factory saves "dtype": "float32" in config.json


def test_engines_sharing_a_gpu_size_their_cache_for_their_whole_batch_where_it_fits(tiny_model):
    """tiny_model: 2 layers x 2 KV heads x 64 dims, K and V: 512 values a token, 2,048 bytes in float32 (its own
    dtype) and 1,024 in bf16. Two engines, 64 sequences of 1,024 tokens: each 32 x 1,024 = 32,768 tokens, 64 MiB in
    float32 = 1/16 GiB. Its share of --vllm.gpu_memory_utilization 0.5 is 0.25 of the GPU, 80% of it 0.2: a 256 MiB
    GPU gives 51.2 MiB, under the cache alone, so that GPU leaves the engines to vLLM's profiling (0)."""
    vllm = VllmArgs(max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.5)
    assert batch_kv_gb(tiny_model, vllm, 2, 80 << 30) == 1 / 16
    assert batch_kv_gb(tiny_model, dataclasses.replace(vllm, dtype="bfloat16"), 2, 80 << 30) == 1 / 32
    assert batch_kv_gb(tiny_model, vllm, 1, 80 << 30) == 1 / 8  # one engine: the whole batch
    assert batch_kv_gb(tiny_model, vllm, 2, 256 << 20) == 0.0


@pytest.mark.parametrize("kv_cache_gb, cuda, expected", [(0.0, False, 1 << 30), (0.25, False, 1 << 28),
                                                          (0.0, True, None), (2.0, True, 2 << 30)])
def test_kv_cache_gb_sizes_the_cache_and_unset_on_a_gpu_leaves_it_to_vllm(tiny_model, kv_cache_gb, cuda, expected):
    """0: 1 GiB on CPU; on a GPU, none, so vLLM sizes it by --vllm.gpu_memory_utilization (profiling the free memory,
    which is why engines sharing a GPU then start one by one: Generator)."""
    args = build_engine_args(tiny_model, VllmArgs(kv_cache_gb=kv_cache_gb), cuda=cuda)
    assert args.kv_cache_memory_bytes == expected


def test_scheduler_limits_reach_the_engine_unchanged(tiny_model):
    args = build_engine_args(tiny_model, VllmArgs(max_num_seqs=3, max_num_batched_tokens=96), cuda=False)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (3, 96)  # not vLLM's per-usage defaults (128, 2048)


def test_engine_refuses_a_kv_cache_env_var_that_would_override_the_flag(tiny_model, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        build_engine_args(tiny_model, VllmArgs(), cuda=False)


@pytest.mark.parametrize("rollout", [RolloutArgs(top_p=0.9), RolloutArgs(top_k=20)])
def test_truncated_sampling_is_refused_with_importance_correction_or_kl(rollout):
    with pytest.raises(ValueError, match="truncated distribution"):
        rollout.check_logprobs_usable(importance_correction=True, kl_to_rollout=False)
    with pytest.raises(ValueError, match="truncated distribution"):
        rollout.check_logprobs_usable(importance_correction=False, kl_to_rollout=True)
    rollout.check_logprobs_usable(importance_correction=False, kl_to_rollout=False)
    RolloutArgs(temperature=0.7).check_logprobs_usable(importance_correction=True, kl_to_rollout=True)


def test_segment_check_accepts_a_consistent_row_and_names_each_violation():
    def row(**changes):  # prompt of 2 tokens, then 2 sampled ones under versions 3 and 4
        fields = dict(token_ids=[1, 2, 3, 4], action_mask=[False, False, True, True],
                      logprobs=[0.0, 0.0, -0.5, -1.5], versions=[-1, -1, 3, 4])
        return Segment(**{**fields, **changes}, episode_id="e")
    row().check()
    for changes, match in [({"logprobs": [0.0, 0.0, -0.5]}, "logprobs has 3"),
                           ({"versions": [-1, -1, -1, 4]}, "action token 2 has version -1"),
                           ({"logprobs": [0.0, 0.0, 0.5, -1.5]}, "log-prob 0.5"),
                           ({"versions": [0, -1, 3, 4]}, "non-action token 0"),
                           ({"routed_experts": [[[0, 1]]]}, "routed_experts has 1 rows")]:
        with pytest.raises(ValueError, match=match):
            row(**changes).check()


def test_segment_routing_keeps_the_rows_the_engine_ran_and_marks_the_rest():
    from generator import segment_routing
    # a 3-token prompt and 2 sampled tokens: vLLM ran 3 + 2 - 1 = 4 tokens, so it returns 4 rows (2 layers,
    # top-2, uint8 as vLLM stores them); the segment has 5 tokens, the last one never ran: -1 (routed live)
    ran = np.arange(16, dtype=np.uint8).reshape(4, 2, 2)
    r = segment_routing(ran, 5)
    assert r.dtype == np.int16 and r.shape == (5, 2, 2)
    assert r[:4].tolist() == ran.tolist() and (r[4] == -1).all()
    # an Env episode that ended on an observation never sent: 2 more rows beyond the call's, both -1
    r = segment_routing(ran, 7)
    assert r[:4].tolist() == ran.tolist() and (r[4:] == -1).all()


def test_pick_engine_is_crc32_so_every_process_agrees():
    # CRC-32 of "123456789" is 0xCBF43926 = 3421780262 (the standard's check value): mod 4 = 0x26 & 3 = 2,
    # mod 3 = 2 (digit sum 35). Python's hash() would give another value in every process.
    assert pick_engine("123456789", 4) == 2 and pick_engine("123456789", 3) == 2
    assert pick_engine("", 5) == 0  # CRC-32 of the empty string is 0
    assert {pick_engine(f"episode-{i}", 2) for i in range(100)} == {0, 1}


def test_token_versions_switch_at_each_refit_mark():
    # started under 3; refit to 4 after 2 output tokens, to 6 after 5: tokens 0-1 are 3, 2-4 are 4, 5-6 are 6
    assert token_versions(3, [(2, 4), (5, 6)], 7) == [3, 3, 4, 4, 4, 6, 6]
    assert token_versions(3, [], 2) == [3, 3] and token_versions(3, [(0, 4)], 2) == [4, 4]


def test_versions_from_spans_expands_one_version_per_token():
    assert versions_from_spans([("3", 0, 2), ("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert versions_from_spans([], 0) == []
    with pytest.raises(RuntimeError, match="cover 2 tokens"):
        versions_from_spans([("3", 0, 2)], 3)


def test_iter_buckets_packs_in_order_up_to_the_limit():
    t = {n: torch.zeros(k) for n, k in [("a", 2), ("b", 2), ("c", 1), ("d", 8), ("e", 1)]}  # fp32: 8 8 4 32 4 B
    # 16 B: a+b = 16 fits; c (4) + d (32) would not; d alone exceeds the limit but goes alone; e last.
    buckets = list(iter_buckets(t.items(), 16))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e"]]


def test_pack_keeps_dtype_shape_and_bits_of_every_tensor_at_aligned_offsets():
    bucket = [("a", torch.randn(3, 5).to(torch.bfloat16)), ("b", torch.randn(4, 2).half().t()),
              ("c", torch.tensor(7, dtype=torch.int64)), ("d", torch.randn(2, 3, 4))]
    layout, flat = pack(bucket)
    # bf16 3x5 = 30 B -> next at 256; fp16 2x4 = 16 B -> 512; int64 scalar 8 B -> 768; fp32 24 x 4 = 96 B -> 1024
    assert [row[3] for row in layout] == [0, 256, 512, 768] and flat.dtype == torch.uint8 and flat.numel() == 1024
    for (name, tensor), (back_name, back) in zip(bucket, unpack(layout, flat)):
        assert back_name == name and back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8))
    # into a bigger buffer (CUDA IPC reuses one): its first 1,024 bytes hold the same tensors; the rest is untouched
    buffer = torch.full((2048,), 255, dtype=torch.uint8)
    layout2, flat2 = pack(bucket, buffer)
    assert layout2 == layout and flat2.data_ptr() == buffer.data_ptr() and flat2.numel() == 1024
    assert all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for (_, a), (_, b) in zip(unpack(layout, flat2), unpack(layout, flat)))
    assert bool((buffer[1024:] == 255).all())


def test_refit_transport_follows_colocate_and_refuses_a_placement_that_contradicts_it():
    # CPU tensors (no uuid) go as bytes whatever the flag says; on a GPU the flag picks IPC or NCCL.
    assert refit_transport(None, [], True) == refit_transport(None, ["GPU-a"], False) == "bytes"
    assert refit_transport("GPU-a", ["GPU-a"], True) == "ipc"
    assert refit_transport("GPU-a", ["GPU-b", "GPU-c"], False) == "nccl"
    # colocated, but one engine (or every one) is elsewhere: IPC cannot reach it
    for engines in (["GPU-b"], ["GPU-a", "GPU-b"], []):
        with pytest.raises(ValueError, match="--launch.colocate: the engines' GPUs"):
            refit_transport("GPU-a", engines, True)
    # not colocated, but an engine is on the trainer's GPU: NCCL needs two GPUs
    with pytest.raises(ValueError, match="set --launch.colocate"):
        refit_transport("GPU-a", ["GPU-b", "GPU-a"], False)


def test_check_tensor_refuses_unknown_repeated_reshaped_and_recast_parameters():
    shapes, seen, w = {"w": (2, 3)}, set(), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown parameter 'lm_head.weight' .*ties it"):
        check_tensor("lm_head.weight", w, shapes, "float32", seen)
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        check_tensor("w", w.t(), shapes, "float32", seen)
    with pytest.raises(ValueError, match="torch.bfloat16, the engine runs float32"):
        check_tensor("w", w.bfloat16(), shapes, "float32", seen)
    assert check_tensor("w", w, shapes, "float32", seen)[0] == "w"
    with pytest.raises(ValueError, match="given twice"):
        check_tensor("w", w, shapes, "float32", seen)


# --- the engine: log-probs, versions, refit

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward(tiny_generator, tiny_model, temperature):
    gen = copy.copy(tiny_generator)  # the same engine, sampling at another temperature
    gen.rollout = RolloutArgs(temperature=temperature)
    c = run(gen.generate(PROMPT, max_new_tokens=32, seed=11, ignore_eos=True))
    assert len(c.token_ids) == len(c.logprobs) == 32 and c.finish_reason == "length"
    assert c.versions == [tiny_generator.version] * 32
    assert mean_abs(c.logprobs, reference(tiny_model, PROMPT, c.token_ids, temperature)) <= 1e-4
    if temperature != 1.0:  # the check has teeth: unscaled logits give other log-probs
        assert mean_abs(c.logprobs, reference(tiny_model, PROMPT, c.token_ids, 1.0)) > 1e-2


def test_refit_mid_request_versions_are_exact(tiny_generator, tiny_model, original, perturbed):
    gen, v, n = tiny_generator, tiny_generator.version, 40

    async def scenario() -> tuple[Completion, list[dict]]:
        await hold(gen, seed=1, after=8)
        long = asyncio.create_task(gen.generate(PROMPT, max_new_tokens=n, seed=1, ignore_eos=True))
        try:
            at = await held(gen, 1)  # `long` stops 8 tokens in, and stays in flight until released
            await refit(gen, perturbed[0], v + 1)
        finally:
            await hold(gen, None)
        try:
            return await long, at
        finally:
            await refit(gen, original, v + 2)
    c, at = run(scenario())
    k = c.versions.count(v)
    assert [list(e.values()) for e in at] == [[8]] and c.versions == [v] * 8 + [v + 1] * (n - 8)
    before = reference(tiny_model, PROMPT, c.token_ids, 1.0)
    after = reference(perturbed[1], PROMPT, c.token_ids, 1.0)
    assert mean_abs(c.logprobs[:k], before[:k]) <= 1e-4
    assert mean_abs(c.logprobs[k:], after[k:]) <= 1e-4
    assert mean_abs(before[k:], after[k:]) > 1e-2  # the two weight sets are told apart


def test_update_weights_roundtrip(tiny_generator, tiny_model, original, perturbed):
    gen, v = tiny_generator, tiny_generator.version
    report = run(refit(gen, perturbed[0], v + 1))
    try:
        applied = [(name, dtype) for bucket in report["applied"] for name, dtype in bucket]
        assert sorted(name for name, _ in applied) == sorted(original)  # each parameter exactly once
        assert {dtype for _, dtype in applied} == {"float32"}  # the worker received the dtype that was sent
        # 1 MiB buckets over the names in sorted order (fp32 bytes; vocab 1030, hidden 128, head_dim 64):
        # embed 527360, L0 input_ln 512, down/gate/up 131072 each, post_ln 512, k_norm 256, k_proj 65536
        # = 987392 (8 tensors; o_proj would pass 1048576); then L0 o/q_norm/q/v, L1 input_ln/down/gate/up/
        # post_ln/k_norm/k/o/q_norm = 919296 (13; q_proj would pass); then L1 q_proj, v_proj, norm (3).
        assert AutoConfig.from_pretrained(tiny_model).vocab_size == 1030
        assert [len(bucket) for bucket in report["applied"]] == [8, 13, 3]
        c = run(gen.generate(PROMPT, max_new_tokens=24, seed=3, ignore_eos=True))
        assert c.versions == [v + 1] * 24
        assert mean_abs(c.logprobs, reference(perturbed[1], PROMPT, c.token_ids, 1.0)) <= 1e-4
    finally:
        run(refit(gen, original, v + 2))
    c = run(gen.generate(PROMPT, max_new_tokens=24, seed=3, ignore_eos=True))
    assert mean_abs(c.logprobs, reference(tiny_model, PROMPT, c.token_ids, 1.0)) <= 1e-4


def test_64_concurrent_requests_across_a_refit_keep_version_order(tiny_generator, original, perturbed):
    gen, v = tiny_generator, tiny_generator.version

    async def scenario() -> list[Completion]:
        await hold(gen, seed=63, after=8)  # the longest (71 tokens) is mid-request at the refit, whatever the others
        tasks = [asyncio.create_task(gen.generate([7 + i, 3, 11], max_new_tokens=8 + i, seed=i, ignore_eos=True))
                 for i in range(64)]
        try:
            await held(gen, 1)
            await refit(gen, perturbed[0], v + 1)
        finally:
            await hold(gen, None)
        try:
            return await asyncio.gather(*tasks)
        finally:
            await refit(gen, original, v + 2)
    outs = run(scenario())
    for i, c in enumerate(outs):
        k = c.versions.count(v)
        assert len(c.token_ids) == 8 + i and c.versions == [v] * k + [v + 1] * (8 + i - k), i
    assert outs[63].versions.count(v) == 8  # the refit landed mid-request


def test_counted_boundaries_agree_with_vllms_spans_over_three_refits(tiny_generator, original, perturbed):
    # The boundary is counted from what vLLM had emitted at each pause (the path vLLM 0.26 takes); vLLM 0.32
    # here also labels spans, and the engine raises if the two disagree on any request.
    gen, v = tiny_generator, tiny_generator.version

    async def scenario() -> tuple[list[Completion], dict]:
        before = await gen.metrics()
        tasks = [asyncio.create_task(gen.generate([9 + i, 4], max_new_tokens=40 + 4 * i, seed=i, ignore_eos=True))
                 for i in range(32)]
        try:
            for r in range(3):  # each refit after one more short request: the long ones are mid-way
                await gen.generate(PROMPT, max_new_tokens=4, seed=100 + r, ignore_eos=True)
                await refit(gen, perturbed[0] if r % 2 == 0 else original, v + 1 + r)
            return await asyncio.gather(*tasks), before
        finally:
            await refit(gen, original, v + 4)
    outs, before = run(scenario())
    crossed = 0
    for i, c in enumerate(outs):
        assert len(c.versions) == 40 + 4 * i and c.versions == sorted(c.versions), i
        assert set(c.versions) <= {v, v + 1, v + 2, v + 3}, i
        crossed += len(set(c.versions)) > 1
    checked = run(gen.metrics())["generator/boundaries_checked"] - before["generator/boundaries_checked"]
    assert crossed > 0 and checked >= crossed  # every request cut by a refit had its boundary checked


def test_a_request_sent_during_a_refit_samples_only_the_new_weights(tiny_generator, tiny_model, original, perturbed):
    gen, v = tiny_generator, tiny_generator.version

    async def scenario() -> Completion:
        await gen.pause()
        late = asyncio.create_task(gen.generate(PROMPT, max_new_tokens=16, seed=5, ignore_eos=True))
        try:
            await gen.update_weights(sorted(perturbed[0].items()), version=v + 1)
        finally:
            await gen.resume()
        return await late
    try:
        c = run(scenario())
    finally:
        run(refit(gen, original, v + 2))
    assert c.versions == [v + 1] * 16
    assert mean_abs(c.logprobs, reference(perturbed[1], PROMPT, c.token_ids, 1.0)) <= 1e-4


# --- bad input: refused with a clear message, the engine keeps serving

@pytest.mark.parametrize("prompt, match", [([], "empty prompt"), ([5, 1030], r"outside the vocabulary \[0, 1030\)"),
                                           ([-1, 5], "outside the vocabulary"), ([5] * 512, "max_model_len 512")])
def test_bad_prompt_is_refused_and_engine_keeps_serving(tiny_generator, prompt, match):
    with pytest.raises(ValueError, match=match):
        run(tiny_generator.generate(prompt))
    assert serves(tiny_generator)


def test_update_while_running_is_refused(tiny_generator, original):
    v = tiny_generator.version
    with pytest.raises(ValueError, match="call pause"):
        run(tiny_generator.update_weights(original.items(), v + 1))
    assert tiny_generator.version == v and serves(tiny_generator)


@pytest.mark.parametrize("bad, match", [
    (("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128)), "unknown parameter 'model.layers.9"),
    (("lm_head.weight", torch.zeros(1030, 128)), "ties it to the input embedding"),
    (("model.norm.weight", torch.zeros(128, dtype=torch.float16)), "torch.float16, the engine runs float32"),
])
def test_bad_refit_tensor_is_refused_before_loading_and_engine_keeps_serving(tiny_generator, tiny_model, original,
                                                                            bad, match):
    v = tiny_generator.version
    with pytest.raises(ValueError, match=match):
        run(refit(tiny_generator, [bad, *sorted(original.items())], v + 1))
    assert tiny_generator.version == v
    c = run(tiny_generator.generate(PROMPT, max_new_tokens=16, seed=5, ignore_eos=True))
    assert mean_abs(c.logprobs, reference(tiny_model, PROMPT, c.token_ids, 1.0)) <= 1e-4


def test_refit_broken_off_mid_stream_is_loud_and_a_full_resend_recovers(tiny_generator, tiny_model, original):
    gen, v = tiny_generator, tiny_generator.version
    named = sorted(original.items())
    with pytest.raises(ValueError, match="unknown parameter 'bogus'"):  # after two 1 MiB buckets went out
        run(refit(gen, named + [("bogus", torch.zeros(1))], v + 1))
    with pytest.raises(ValueError, match=r"\['model.norm.weight'\] \(of 1\) were not given"):
        run(refit(gen, named[:-1], v + 1))
    run(refit(gen, original, v + 1))
    c = run(gen.generate(PROMPT, max_new_tokens=16, seed=6, ignore_eos=True))
    assert c.versions == [v + 1] * 16
    assert mean_abs(c.logprobs, reference(tiny_model, PROMPT, c.token_ids, 1.0)) <= 1e-4


def test_dead_engine_raises_an_error_naming_it_instead_of_hanging(tiny_generator, tiny_model):
    dead = generator.Engine.remote(tiny_model, VllmArgs())
    ray.kill(dead)
    router = copy.copy(tiny_generator)
    router._engines = [dead]  # a router whose only engine has died
    with pytest.raises(RuntimeError, match="engine 0 died"):
        run(asyncio.wait_for(router.generate([5, 6]), timeout=120))


# --- the router as agent workers use it

def test_router_pickled_into_another_ray_worker_samples(tiny_generator):
    @ray.remote(num_cpus=0)
    def sample(gen: Generator) -> list[int]:
        return asyncio.run(gen.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True, affinity="episode-1")).token_ids
    assert len(ray.get(sample.remote(tiny_generator), timeout=120)) == 3


def test_metrics_count_requests_and_tokens(tiny_generator):
    before = run(tiny_generator.metrics())
    for n in (3, 5):
        run(tiny_generator.generate([5, 6, 7, 8], max_new_tokens=n, ignore_eos=True))
    after = run(tiny_generator.metrics())
    assert after["generator/requests"] - before["generator/requests"] == 2
    assert after["generator/tokens"] - before["generator/tokens"] == 3 + 5
    assert after["generator/prompt_tokens"] - before["generator/prompt_tokens"] == 4 + 4
    assert after["generator/version"] == tiny_generator.version


def test_requests_of_one_event_loop_turn_share_one_ray_call_and_each_answer_comes_back_as_it_ends(tiny_generator):
    # 8 requests made together (as a group's episodes start) travel in 1 generate_many call; the 1-token one answers
    # while the 48-token ones still sample (one engine step against 48); a request made afterwards is a 2nd call
    async def main():
        before = await tiny_generator.metrics()
        short = asyncio.ensure_future(tiny_generator.generate([5, 6], max_new_tokens=1, ignore_eos=True))
        long = [asyncio.ensure_future(tiny_generator.generate([5, 6, i], max_new_tokens=48, ignore_eos=True))
                for i in range(7)]
        done, _ = await asyncio.wait([short, *long], return_when=asyncio.FIRST_COMPLETED)
        assert done == {short} and not any(task.done() for task in long)
        answers = await asyncio.gather(*long)
        after_group = await tiny_generator.metrics()
        await tiny_generator.generate([7], max_new_tokens=2)
        return before, after_group, await tiny_generator.metrics(), short.result(), answers
    before, group, after, short, answers = run(main())
    assert group["generator/ray_calls"] - before["generator/ray_calls"] == 1
    assert group["generator/requests"] - before["generator/requests"] == 8
    assert after["generator/ray_calls"] - group["generator/ray_calls"] == 1
    assert len(short.token_ids) == 1 and [len(c.token_ids) for c in answers] == [48] * 7


def test_a_refused_request_fails_alone_in_its_ray_call(tiny_generator):
    # the engine refuses images for a text model (a ValueError: the asker's); its neighbour in the call samples
    async def main():
        bad = tiny_generator.generate([5, 6, 7], images=[(0, 2, b"png")], max_new_tokens=2)
        good = tiny_generator.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True)
        return await asyncio.gather(bad, good, return_exceptions=True)
    bad, good = run(main())
    assert isinstance(bad, ValueError) and "not a VLM" in str(bad)
    assert len(good.token_ids) == 3


def test_a_call_that_fails_outside_ray_fails_each_of_its_requests_instead_of_hanging(tiny_generator):
    # a request that cannot be serialized (a generator object as its seed) makes the drain's own Ray call raise a
    # TypeError, no Ray error: every request of that call (the bad one and its neighbour) fails, naming the engine,
    # within the bound (it used to wait forever); the engine keeps serving
    async def main():
        bad = tiny_generator.generate([5, 6, 7], seed=(n for n in range(3)), max_new_tokens=2)
        good = tiny_generator.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True)
        return await asyncio.wait_for(asyncio.gather(bad, good, return_exceptions=True), timeout=60)
    answers = run(main())
    assert all(isinstance(a, RuntimeError) and "engine 0" in str(a) and "pickle" in str(a) for a in answers), answers
    assert tiny_generator.dead is None and serves(tiny_generator)


def test_a_cancelled_request_is_aborted_on_the_engine(tiny_generator):
    # a 400-token request (ignore_eos; 6 + 400 < max_model_len 512), held 8 tokens in, is cancelled: the engine ends
    # it (vLLM's abort) instead of decoding its other 392 tokens once released. Its asker gets CancelledError once
    # the engine took the abort, and the engine's counters then hold it as ended with its 8 tokens (unaborted, it
    # would still be in flight: 0 requests ended)
    gen = tiny_generator

    async def main():
        before = await gen.metrics()
        await hold(gen, seed=5, after=8)
        long = asyncio.ensure_future(gen.generate(PROMPT, max_new_tokens=400, seed=5, ignore_eos=True))
        try:
            await held(gen, 1)
            long.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long
            return before, await gen.metrics()
        finally:
            await hold(gen, None)
    before, after = run(main())
    assert after["generator/requests"] - before["generator/requests"] == 1
    assert after["generator/tokens"] - before["generator/tokens"] == 8
    assert serves(gen)


def test_a_request_cancelled_before_it_reaches_vllm_never_starts(tiny_generator):
    # The engines are paused (a refit under way), so a 400-token request waits at the engine's gate, not yet in vLLM,
    # when its asker gives up: vLLM's abort of an id it does not know does nothing. Once the engines resume, an
    # 8-token request runs to its end; the first must not have started: no request of the engine's is in flight
    # then (it would still be decoding: 400 tokens take ~50x the 8), and the engines count 1 request and 8 tokens.
    gen = tiny_generator

    async def main():
        before = await gen.metrics()
        await gen.pause()
        long = asyncio.ensure_future(gen.generate(PROMPT, max_new_tokens=400, ignore_eos=True))
        await asyncio.sleep(0)  # its request is queued for the engine (a loop turn, not a wait for timing)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        await gen.resume()
        await gen.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
        in_flight = [await gen._await(i, e.sampled_counts.remote()) for i, e in enumerate(gen._engines)]
        return before, await gen.metrics(), in_flight
    before, after, in_flight = run(main())
    assert in_flight == [{}] * len(gen._engines)
    assert after["generator/requests"] - before["generator/requests"] == 1
    assert after["generator/tokens"] - before["generator/tokens"] == 8
    assert serves(gen)


# --- mixture of experts: its own engine (vLLM's CPU reload skips the experts' repacking)

@pytest.fixture(scope="module")
def moe_generator(tiny_moe_model, ray_local):
    gen = Generator(tiny_moe_model, VllmArgs(max_model_len=256, kv_cache_gb=0.25), RolloutArgs())
    yield gen
    run(gen.shutdown())


def test_moe_refit_roundtrip_matches_teacher_forcing(moe_generator, tiny_moe_model, tmp_path):
    original = load_file(os.path.join(tiny_moe_model, "model.safetensors"))
    other = perturb(original)  # experts, router and attention all move
    other_dir = copy_with(tiny_moe_model, other, tmp_path / "model")
    prompt = [5, 17, 30, 42, 9]
    for weights, model_dir, version in [(other, other_dir, 1), (original, tiny_moe_model, 2)]:
        run(refit(moe_generator, weights, version))
        c = run(moe_generator.generate(prompt, max_new_tokens=24, seed=7, ignore_eos=True))
        assert c.versions == [version] * 24
        assert mean_abs(c.logprobs, reference(model_dir, prompt, c.token_ids, 1.0)) <= 1e-4, version


def test_moe_trainer_refit_sends_the_checkpoint_layout(moe_generator, tiny_moe_model, tmp_path):
    # transformers 5 holds each layer's experts fused (experts.gate_up_proj (E, 2I, H)); the checkpoint and
    # vLLM name them per expert. After the engine was moved to other weights, a refit from a trainer that
    # loaded the original checkpoint must bring the engine back to the original model's function.
    from estimators import EstimatorArgs
    from losses import LossArgs
    from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup
    original = load_file(os.path.join(tiny_moe_model, "model.safetensors"))
    run(refit(moe_generator, perturb(original), 5))
    trainer = TrainerGroup(tiny_moe_model, TrainArgs(lr=0.0), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                           temperature=1.0)
    try:
        run(moe_generator.pause())
        trainer.refit(moe_generator)
        run(moe_generator.resume())
    finally:
        trainer.shutdown()
    prompt = [5, 17, 30, 42, 9]
    c = run(moe_generator.generate(prompt, max_new_tokens=24, seed=7, ignore_eos=True))
    assert mean_abs(c.logprobs, reference(tiny_moe_model, prompt, c.token_ids, 1.0)) <= 1e-4


# --- several engines: a GPU's share split between them, a group on one engine, one refit reaching each

def test_engines_sharing_a_gpu_split_its_memory_and_batch_and_cuda_graphs_cover_each_batch(tiny_model):
    # 4 engines on one GPU with 0.6 of it and 1,024 sequences: 0.6 / 4 = 0.15 and 1,024 / 4 = 256 each, graphs up
    # to 256. 3 engines round up: ceil(1,024 / 3) = 342 sequences; with 2 MTP drafts a decode step of 342 sequences
    # runs 342 x (1 + 2) = 1,026 tokens. One engine: graphs up to all 1,024 (vLLM's default stops at 512).
    vllm = VllmArgs(max_num_seqs=1024, gpu_memory_utilization=0.6, enforce_eager=False)
    four = build_engine_args(tiny_model, vllm, cuda=True, share=4)
    assert (four.gpu_memory_utilization, four.max_num_seqs, four.max_cudagraph_capture_size) == (0.15, 256, 256)
    three = build_engine_args(tiny_model, VllmArgs(max_num_seqs=1024, num_speculative_tokens=2), cuda=True, share=3)
    assert (three.max_num_seqs, three.max_cudagraph_capture_size) == (342, 1026)
    one = build_engine_args(tiny_model, vllm, cuda=True)
    assert (one.gpu_memory_utilization, one.max_num_seqs, one.max_cudagraph_capture_size) == (0.6, 1024, 1024)
    assert build_engine_args(tiny_model, VllmArgs(), cuda=False).max_cudagraph_capture_size is None  # no graphs


def test_ngram_drafts_reach_the_engine_matching_from_two_tokens(tiny_model):
    # vLLM's n-gram proposer defaults to 5-token matches (prompt_lookup_min = max = 5); ours looks up 2..5 tokens
    args = build_engine_args(tiny_model, VllmArgs(num_speculative_tokens=3, speculative_method="ngram"), cuda=True)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 5}
    assert build_engine_args(tiny_model, VllmArgs(), cuda=True).speculative_config is None


def test_colocate_takes_several_engines_and_refuses_ranks_or_engines_across_gpus(ray_local):
    import launch
    flags = ["--launch.model", "m", "--launch.colocate"]
    cfg = launch.parse_args([*flags, "--vllm.num_engines", "4"])  # four engines beside the rank: only no GPU stops it
    with pytest.raises(ValueError, match="no GPUs to share"):
        launch.gpu_shares(cfg["launch"], cfg["train"], cfg["vllm"])
    for more in (["--vllm.tensor_parallel_size", "2"], ["--train.world_size", "2"]):  # each would need a second GPU
        cfg = launch.parse_args([*flags, *more])
        with pytest.raises(ValueError, match="set --train.world_size 1 and --vllm.tensor_parallel_size 1"):
            launch.gpu_shares(cfg["launch"], cfg["train"], cfg["vllm"])


@pytest.mark.slow
def test_two_engines_keep_a_group_on_one_engine_and_one_refit_versions_each_exactly(tiny_model, ray_local, perturbed):
    gen = Generator(tiny_model, VllmArgs(num_engines=2, max_model_len=512, kv_cache_gb=0.25, refit_bucket_mb=1),
                    RolloutArgs(max_new_tokens=16))
    keys = {pick_engine(f"group-{i}", 2): f"group-{i}" for i in range(8)}  # a group id that each engine serves
    n = 40

    async def scenario() -> list[Completion]:
        # group 0: one long request and 4 short ones; group 1: one long and 2 short (round robin would split 4 / 4).
        # The long ones are held 8 tokens in, so they are in flight on both engines when the pause lands.
        await hold(gen, seed=1, after=8)
        longs = [asyncio.ensure_future(gen.generate(PROMPT, max_new_tokens=n, seed=1, ignore_eos=True,
                                                    affinity=keys[e])) for e in (0, 1)]
        try:
            await asyncio.gather(*(gen.generate(PROMPT, max_new_tokens=8, ignore_eos=True, affinity=keys[e])
                                   for e in (0, 0, 0, 0, 1, 1)))
            await held(gen, 2)
            await refit(gen, perturbed[0], 1)  # one pause -> update_weights -> resume over both engines
        finally:
            await hold(gen, None)
        return await asyncio.gather(*longs)
    try:
        longs = run(scenario())
        counts = [ray.get(e.metrics.remote()) for e in gen._engines]
        assert [c["generator/requests"] for c in counts] == [5, 3]  # each group's requests on its engine alone
        for c in longs:  # each engine's request in flight: old weights' 8 tokens, then the new version's
            k = c.versions.count(0)
            assert c.versions == [0] * 8 + [1] * (n - 8)
            after = reference(perturbed[1], PROMPT, c.token_ids, 1.0)
            assert mean_abs(c.logprobs[k:], after[k:]) <= 1e-4  # this engine loaded the new weights
        assert [c["generator/boundaries_checked"] for c in counts] == [1, 1]  # vLLM's spans agree on each engine
    finally:
        run(gen.shutdown())
