"""--train.routing_replay on CPU: one in-process TrainerRank (world size 1, gloo, NeMo's activation
checkpointing on) over the tiny Qwen3-MoE model (2 MoE layers, 4 experts, top-2), which the trainer
builds as NeMo AutoModel's own Qwen3-MoE class.

The replayed selections come from plain transformers forwards: the same architecture under other
weights (seed 1), so they differ from the trainer's own choice, or the same weights (the trainer's
own live choice). What the experts actually ran is read by a forward pre-hook on each of NeMo's
experts modules, independent of the replay in the gate. The train step runs last: every other test
needs the loaded weights.
"""
import random
import socket

import numpy as np
import pytest
import torch
from nemo_automodel.components.moe.experts import GroupedExperts
from nemo_automodel.components.moe.layers import Gate
from transformers import AutoModelForCausalLM

from estimators import EstimatorArgs
from generator import Segment
from losses import LossArgs
from recipes.tiny_model import build_tiny_model
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerRank, collate, install_replay

LAYERS, TOP_K, EXPERTS = 2, 2, 4  # tiny_moe_model


def make_segments(vocab: int, *, seed: int = 0) -> list[Segment]:
    rng = random.Random(seed)
    segments = []
    for k in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 6))]
        completion = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 9))]
        mask = [False] * len(prompt) + [True] * len(completion)
        segments.append(Segment(token_ids=prompt + completion, action_mask=mask,
                                logprobs=[-4.0 if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask],
                                reward=float(k), episode_id=f"e{k}", group_id="g0"))
    return segments


def hf_selection(model, segments) -> list[np.ndarray]:
    """Each segment's (T, layers, top_k) top-k experts of a plain transformers forward (one row at a time)."""
    out = []
    with torch.no_grad():
        for seg in segments:
            # layers x (T, E)
            logits = model(input_ids=torch.tensor([seg.token_ids]), output_router_logits=True).router_logits
            out.append(torch.stack([r.topk(TOP_K, dim=-1).indices for r in logits], 1).numpy().astype(np.int16))
    return out


def with_routing(segments, routing) -> list[Segment]:
    return [Segment(**{**seg.__dict__, "routed_experts": r}) for seg, r in zip(segments, routing)]


class Observed:
    """Per MoE layer, every call's (gate input, gate weight, experts' ids, experts' weights), in call order.
    NeMo's Gate.forward(x, token_mask, cp_mesh) and GroupedExperts.forward(x, token_mask, weights, indices);
    the weight is copied because FSDP frees its unsharded storage after backward."""

    def __init__(self, model):
        self.calls = [[] for _ in range(LAYERS)]
        self.handles = []
        gates = [m for m in model.modules() if isinstance(m, Gate)]
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        assert len(gates) == len(experts) == LAYERS
        for layer, (gate, expert) in enumerate(zip(gates, experts)):
            self.handles.append(gate.register_forward_pre_hook(
                lambda m, args, layer=layer: self.calls[layer].append([args[0].detach(), m.weight.detach().clone()])))
            self.handles.append(expert.register_forward_pre_hook(
                lambda m, args, layer=layer: self.calls[layer][-1].extend([args[3], args[2].detach()])))

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def rank(tiny_moe_model):
    r = TrainerRank(0, 1, tiny_moe_model, TrainArgs(lr=1e-3, routing_replay=True),
                    FsdpArgs(gradient_checkpointing=True), CkptArgs(), LossArgs(), EstimatorArgs(), 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r.setup("127.0.0.1", port)
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def segments(tiny_moe_model):
    return make_segments(AutoModelForCausalLM.from_pretrained(tiny_moe_model).config.vocab_size)


@pytest.fixture(scope="module")
def own_selection(tiny_moe_model, segments):
    return hf_selection(AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval(), segments)


@pytest.fixture(scope="module")
def other_selection(tmp_path_factory, segments, own_selection):
    other = build_tiny_model(str(tmp_path_factory.mktemp("tiny_moe_seed1")), seed=1, tokenizer="chars", moe=True)
    sel = hf_selection(AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval(), segments)
    assert any((np.sort(a, -1) != np.sort(b, -1)).any() for a, b in zip(sel, own_selection)), (
        "the other weights must route differently somewhere")
    return sel


def forward_observed(rank, segments, *, grad: bool):
    """Rows in batch order as one microbatch: (observed calls, x, logp (B, T))."""
    batch = collate(segments, rank.moe)
    x = rank.microbatch(batch, list(range(len(segments))))
    seen = Observed(rank.model)
    try:
        with torch.set_grad_enabled(grad):
            logp = rank.policy_logprobs(rank.model, x, 1.0)[0]
        if grad:
            rank.model.zero_grad(set_to_none=True)
            (logp * x["mask"]).sum().backward()
    finally:
        seen.close()
    return seen, x, logp


def ids_at(call, B, T) -> torch.Tensor:
    return call[2].view(B, T, TOP_K)


def test_replay_runs_the_recorded_experts_in_forward_and_checkpoint_recompute_and_the_gate_gets_gradient(
        rank, segments, other_selection):
    seen, x, _ = forward_observed(rank, with_routing(segments, other_selection), grad=True)
    B, T = x["ids"].shape
    for layer in range(LAYERS):
        # forward + NeMo's activation-checkpoint recompute in backward: both must replay the same ids
        assert len(seen.calls[layer]) == 2
        for h, w, ids, weights in seen.calls[layer]:
            ids = ids.view(B, T, TOP_K)
            for i, seg in enumerate(segments):
                n = len(seg.token_ids)
                # 100% of positions
                assert torch.equal(ids[i, :n], torch.from_numpy(other_selection[i][:, layer]).long())
            # weights: softmax over all 4 experts of the trainer's own gate logits, gathered at the replayed ids,
            # renormalized
            p = torch.softmax(h @ w.T, -1).gather(-1, ids.view(-1, TOP_K))  # (N, K)
            assert torch.allclose(weights, p / p.sum(-1, keepdim=True), atol=1e-6)
    for gate in [m for m in rank.model.modules() if isinstance(m, Gate)]:
        assert gate.weight.grad.full_tensor().abs().sum() > 0  # DTensor: NeMo's class is sharded at 1 rank too


def test_positions_marked_minus_one_route_live(rank, segments, other_selection):
    routing, rng = [], np.random.default_rng(0)
    for sel in other_selection:
        r = sel.copy()
        r[rng.random(r.shape[:2]) < 0.5] = -1  # half of the (token, layer) positions unrecorded
        routing.append(r)
    seen, x, _ = forward_observed(rank, with_routing(segments, routing), grad=False)
    B, T = x["ids"].shape
    differs = False
    for layer in range(LAYERS):
        (h, w, ids, _), = seen.calls[layer]
        # the trainer's own top-k in this forward
        live = torch.softmax(h @ w.T, -1).topk(TOP_K, -1).indices.view(B, T, TOP_K)
        ids = ids.view(B, T, TOP_K)
        for i, seg in enumerate(segments):
            n = len(seg.token_ids)
            r = torch.from_numpy(routing[i][:, layer]).long()
            unrecorded = r[:, 0] < 0
            assert unrecorded.any() and (~unrecorded).any()
            assert torch.equal(ids[i, :n][unrecorded], live[i, :n][unrecorded])
            assert torch.equal(ids[i, :n][~unrecorded], r[~unrecorded])
            differs |= bool((ids[i, :n][~unrecorded].sort(-1).values != live[i, :n][~unrecorded].sort(-1).values).any())
    assert differs, "replayed positions must differ from live routing somewhere, else this test shows nothing"


def test_replaying_the_own_live_choice_leaves_logprobs_unchanged(rank, tiny_moe_model, segments, own_selection,
                                                                 other_selection):
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32).eval()
    with torch.no_grad():  # reference: a plain transformers forward per row, its own routing
        expected = [torch.cat([torch.zeros(1),
                               torch.log_softmax(ref(input_ids=torch.tensor([s.token_ids])).logits[0, :-1], -1)
                               .gather(-1, torch.tensor(s.token_ids[1:])[:, None])[:, 0]]) for s in segments]
    own = rank.logprobs(with_routing(segments, own_selection), 1.0)
    other = rank.logprobs(with_routing(segments, other_selection), 1.0)
    for e, a, b in zip(expected, own, other):
        assert torch.allclose(a, e, atol=1e-5)
    assert max(float((b - e).abs().max()) for e, b in zip(expected, other)) > 1e-3  # replay does change the function


def test_routing_that_does_not_fit_the_model_is_refused_naming_the_segment(rank, tiny_chars_model, segments,
                                                                           own_selection):
    bad = list(own_selection)
    bad[1] = np.concatenate([bad[1], bad[1][:, :, :1]], -1)  # top_k 3 for a top-2 model
    with pytest.raises(ValueError, match=r"segment 1 \('e1'\): routed_experts has shape .*3\), the model needs"):
        collate(with_routing(segments, bad), rank.moe)
    bad = list(own_selection)
    bad[2] = bad[2][:, :1]  # one MoE layer of two
    with pytest.raises(ValueError, match=r"segment 2 \('e2'\): routed_experts has shape"):
        collate(with_routing(segments, bad), rank.moe)
    bad = list(own_selection)
    bad[0] = bad[0][1:]  # a row short
    with pytest.raises(ValueError, match=r"segment 0: segment 'e0': routed_experts has \d+ rows"):
        collate(with_routing(segments, bad), rank.moe)
    bad = [r.copy() for r in own_selection]
    bad[1][0, 0, 0] = EXPERTS  # no such expert
    with pytest.raises(ValueError, match=r"segment 1 \('e1'\): routed_experts ids must lie in \[0, 4\)"):
        collate(with_routing(segments, bad), rank.moe)
    with pytest.raises(ValueError, match="--train.routing_replay: no segment of the batch carries routed_experts"):
        collate(segments, rank.moe)
    with pytest.raises(ValueError, match="--train.routing_replay: .* has no Qwen3-MoE router"):
        install_replay(rank, AutoModelForCausalLM.from_pretrained(tiny_chars_model))


def test_a_row_sampled_across_a_refit_routes_live(rank, segments, other_selection):
    # segment 1's action tokens carry versions 0 and 1 (a partial rollout across a refit): no recorded
    # selection reproduces both samplers, so the whole row is -1 (live); the others keep their routing
    mixed = with_routing(segments, other_selection)
    v = mixed[1].versions
    first = mixed[1].action_mask.index(True)
    mixed[1].versions = v[:first + 1] + [1 if m else -1 for m in mixed[1].action_mask[first + 1:]]
    routed = collate(mixed, rank.moe)["routed"]
    assert (routed[1] == -1).all()
    for i in (0, 2):
        T = len(segments[i].token_ids)
        assert routed[i, :T].tolist() == other_selection[i].tolist() and (routed[i, T:] == -1).all()


def test_train_step_with_replay_logs_the_replayed_share(rank, segments, other_selection):
    routing = []
    for seg, sel in zip(segments, other_selection):
        r = sel.copy()
        r[:seg.action_mask.index(True)] = -1  # prompt tokens unrecorded, every action token recorded in both layers
        routing.append(r)
    records, version = rank.train_step(with_routing(segments, routing))
    frac = [m["train/replayed_frac"] for _, m in records if "train/replayed_frac" in m]
    # share of (token, layer) positions: action tokens / all tokens (each layer counts the same)
    expected = sum(sum(s.action_mask) for s in segments) / sum(len(s.token_ids) for s in segments)
    assert frac == [pytest.approx(expected)] and version == 1
