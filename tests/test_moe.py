"""Qwen3-MoE in the trainer on CPU as NeMo AutoModel's own MoE class: expert parallelism, export, checkpoint.

Two TrainerGroups (real Ray actors, real FSDP2 on gloo) over tiny_moe_model (2 MoE layers, 4 experts, top-2),
both replaying the same routing (transformers' top-k under other weights, half of the positions -1 = live):
one rank, and two ranks with --fsdp.ep_size 2 (each holds 2 of every layer's 4 experts) and activation
checkpointing. References: the one-rank group, a plain transformers forward of the exported directory, and
the checkpoint's own tensors. The refusals come first (they start no actor); the tests after them run in
order on the same groups (one train step, then export, then a checkpoint round trip).
"""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_routing import hf_selection, make_segments, with_routing
from test_trainer import exported
from transformers import AutoModelForCausalLM

from estimators import EstimatorArgs
from generator import Segment
from losses import LossArgs
from recipes.tiny_model import build_tiny_model
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, check_args


def start(model_path, *, world_size=1, ckpt=None, **fsdp) -> TrainerGroup:
    return TrainerGroup(model_path, TrainArgs(lr=1e-3, routing_replay=True, world_size=world_size),
                        FsdpArgs(**fsdp), ckpt or CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0,
                        gpus_per_rank=0)


def test_expert_parallelism_is_refused_where_it_cannot_split_the_experts(tiny_chars_model, tmp_path):
    with pytest.raises(ValueError, match="--fsdp.ep_size 2 with --train.world_size 3: .* divides world_size"):
        check_args(TrainArgs(world_size=3), FsdpArgs(ep_size=2), LossArgs(), EstimatorArgs(), cuda=False)
    with pytest.raises(ValueError, match="--fsdp.ep_size 2: .* a Qwen3-MoE policy .* is qwen3 with 0 experts"):
        start(tiny_chars_model, world_size=2, ep_size=2)
    three = build_tiny_model(str(tmp_path / "moe3"), tokenizer="chars", moe=True, experts=3)
    with pytest.raises(ValueError, match="--fsdp.ep_size 2: .* expert count it divides.* with 3 experts"):
        start(three, world_size=2, ep_size=2)


@pytest.fixture(scope="module")
def groups(ray_local, tiny_moe_model, tmp_path_factory):
    one = start(tiny_moe_model)
    ep = start(tiny_moe_model, world_size=2, ep_size=2, gradient_checkpointing=True,
               ckpt=CkptArgs(dir=str(tmp_path_factory.mktemp("moe_ckpt"))))
    yield one, ep
    one.shutdown()
    ep.shutdown()


@pytest.fixture(scope="module")
def segments(tiny_moe_model, tmp_path_factory):
    """make_segments' 3 rows (the ep group's plan puts the longest on one rank, the other two on the other)
    with routing from other weights, half of the (token, layer) positions unrecorded."""
    other = build_tiny_model(str(tmp_path_factory.mktemp("moe_seed1")), seed=1, tokenizer="chars", moe=True)
    rows = make_segments(AutoModelForCausalLM.from_pretrained(tiny_moe_model).config.vocab_size)
    routing = hf_selection(AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval(), rows)
    rng = np.random.default_rng(0)
    for r in routing:
        r[rng.random(r.shape[:2]) < 0.5] = -1
    return with_routing(rows, routing)


@pytest.mark.slow
def test_expert_parallel_ranks_compute_the_same_logprobs_and_step_as_one_rank(groups, segments):
    one, ep = groups
    for a, b in zip(one.logprobs(segments), ep.logprobs(segments)):
        assert float((a - b).abs().max()) <= 1e-5  # fp32: each token's sums are the same, on another rank
    # Both steps take the gradient of the same batch loss: every rank sees the whole batch, so the loss
    # denominators are the batch's, and the two ranks' shares sum to it (each scaled by dp_size = 2 to undo
    # FSDP's mean over dp ranks). An expert's gradient already sums both ranks' tokens (they are sent to the rank
    # that holds it) and FSDP averages it over dp / ep_size = 1 rank: twice the one-rank gradient until the
    # trainer divides it by ep_size. Equal gradients, equal norms.
    m1, m2 = one.train_step(segments), ep.train_step(segments)
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], rel=1e-5, abs=1e-7)
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert m1["train/grad_norm"] > 1e-3  # a step that moves the weights, else equal norms show nothing
    for a, b in zip(one.logprobs(segments), ep.logprobs(segments)):
        assert float((a - b).abs().max()) <= 1e-5  # equal gradients, so the same AdamW step


@pytest.mark.slow
def test_export_has_the_checkpoint_names_and_loads_in_transformers_with_equal_logprobs(groups, segments,
                                                                                       tiny_moe_model, tmp_path):
    _, ep = groups  # experts sharded over two ranks, trained one step above: the export gathers them whole
    ep.export_hf(str(tmp_path / "hf"))
    original, saved = load_file(f"{tiny_moe_model}/model.safetensors"), load_file(f"{tmp_path}/hf/model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in saved  # per expert, as vLLM loads them
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    live = with_routing(segments, [np.full_like(s.routed_experts, -1) for s in segments])  # routed live
    for seg, trained in zip(live, ep.logprobs(live)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seg.token_ids])).logits[0, :-1]  # (T-1, V)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seg.token_ids[1:])[:, None])[:, 0]
        assert float((trained[1:] - expected).abs().max()) <= 1e-5
    assert any(not torch.equal(saved[k], original[k]) for k in saved)  # the trained weights, not the loaded ones


@pytest.mark.slow
def test_checkpoint_restores_expert_parallel_weights(groups, segments):
    _, ep = groups
    path, saved = ep.save(), exported(ep)
    ep.train_step([Segment(**{**s.__dict__, "versions": [1 if m else -1 for m in s.action_mask]}) for s in segments])
    moved = exported(ep)
    assert any(not torch.equal(moved[k], saved[k]) for k in saved)  # the step moved them, so the load has work
    ep.load(path)
    restored = exported(ep)
    assert all(torch.equal(restored[k], saved[k]) for k in saved) and ep.version == 1
