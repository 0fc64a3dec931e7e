"""--fsdp.tp_size on CPU gloo: two tensor-parallel ranks export, score and step as one rank does.

Each group is TrainerRank itself in processes spawned by torch.multiprocessing (one process group each, as the Ray
actors form it): one rank, and two ranks with --fsdp.tp_size 2, where NeMo AutoModel's plan splits every layer's
heads (q/k/v columns, o_proj rows), MLP columns and the vocabulary of the embedding and the logits. Both run the
same on-policy train step on the same rows; an optimizer step pre-hook records every gradient as AdamW sees it
(after the trainer's own reductions, no clipping). Models: tiny_chars_model (Qwen3: its q_norm/k_norm stay whole
while each rank normalizes only its own heads) and a Llama of the same size (no q/k norm, untied lm_head).
Measured on 2 cores: log-probs before and after the step within 1.4e-6, gradients within 1.5e-7, gradient norms
within 1.2e-7 relative. With NeMo 0.7.0's plan alone (no sum of q_norm/k_norm's partial gradients) each rank keeps
its own heads' share and the log-probs after the step differ by 2.1e-4. One model: 30-45 s, 60-95 s under load.
"""
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_trainer import VOCAB, make_segments
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from estimators import EstimatorArgs
from losses import LossArgs
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, TrainerRank, check_args, full_params


def run_rank(rank: int, world_size: int, model_path: str, port: int, out: str) -> None:
    """One rank of a group of world_size tensor-parallel ranks: its export, log-probs, one train step, log-probs;
    each rank writes what it saw (its gradients gathered whole, their norm; log-probs come back on rank 0) to
    out.<rank>."""
    r = TrainerRank(rank, world_size, model_path, TrainArgs(lr=1e-3, world_size=world_size, grad_clip=None),
                    FsdpArgs(tp_size=world_size), CkptArgs(), LossArgs(), EstimatorArgs(), 1.0)
    import ray
    # outside Ray, setup neither asks Ray for a node nor starts a Ray instance by asking (each rank started one)
    assert r.setup("127.0.0.1", port) is None and not ray.is_initialized()
    grads = {}
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    r.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: full(p.grad) for n, p in r.model.named_parameters()}))
    segments = make_segments()
    # what a refit sends, copied before the step (an unsplit weight's full tensor is the parameter itself)
    weights = {name: full.clone() for name, full in full_params(r, list(r.model.named_parameters()))}
    before = r.logprobs(segments, None)
    records, _ = r.train_step(segments)
    after = r.logprobs(segments, None)
    norm = next(m["train/grad_norm"] for _, m in records if "train/grad_norm" in m)
    torch.save({"weights": weights, "before": before, "after": after, "grads": grads, "grad_norm": norm},
               f"{out}.{rank}")
    r.shutdown()


def run_group(model_path: str, world_size: int, out: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(world_size, model_path, port, out), nprocs=world_size)
    return [torch.load(f"{out}.{rank}") for rank in range(world_size)]


@pytest.fixture(scope="module")
def tiny_llama_model(tmp_path_factory) -> str:
    """A Llama of tiny_chars_model's size and vocabulary: 4 query heads over 2 key-value heads, untied lm_head."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_tensor_parallelism_is_refused_where_it_cannot_run(tiny_moe_model):
    with pytest.raises(ValueError, match="--fsdp.tp_size 2 with --train.world_size 3: .* divides world_size"):
        check_args(TrainArgs(world_size=3), FsdpArgs(tp_size=2), LossArgs(), EstimatorArgs(), cuda=False)
    with pytest.raises(ValueError, match="--fsdp.tp_size 2 with a Qwen3-MoE policy .* set --fsdp.tp_size 1"):
        TrainerGroup(tiny_moe_model, TrainArgs(world_size=2), FsdpArgs(tp_size=2), CkptArgs(), LossArgs(),
                     EstimatorArgs(), temperature=1.0, gpus_per_rank=0)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_chars_model", "tiny_llama_model"])
def test_two_tensor_parallel_ranks_give_one_ranks_logprobs_and_gradients(model, request, tmp_path):
    path = request.getfixturevalue(model)
    (one,), two = run_group(path, 1, str(tmp_path / "one")), run_group(path, 2, str(tmp_path / "tp"))
    # Tolerance: tensor parallelism changes only the order of fp32 additions (o_proj's and down_proj's sums over
    # 256 inputs in two halves, then across ranks; the vocabulary's log-softmax likewise). Each sum rounds at
    # ~6e-8 of its magnitude per addition, so a few hundred terms stay well under 1e-5 of the tensor's largest entry.
    # rank 0's log-probs: the forward after the step runs both ranks' heads, each normalized with its rank's q_norm
    for a, b in zip(one["before"] + one["after"], two[0]["before"] + two[0]["after"]):
        assert float((a - b).abs().max()) <= 1e-5
    on_disk = load_file(f"{path}/model.safetensors")
    for tp in two:  # every rank: a replicated weight whose gradient differed between ranks would differ here
        assert tp["weights"].keys() == on_disk.keys()  # the export gathers each split weight whole, once
        assert all(torch.equal(tp["weights"][name], tensor) for name, tensor in on_disk.items())
        assert tp["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)  # what --train.grad_clip clips by
        assert one["grads"].keys() == tp["grads"].keys()
        for name, g in one["grads"].items():
            assert float((g - tp["grads"][name]).abs().max()) <= 1e-5 * max(1.0, float(g.abs().max())), name
    norms = [g for n, g in one["grads"].items() if "_norm." in n and "layernorm" not in n]
    assert (len(norms) == 4) == (model == "tiny_chars_model")  # Qwen3: q_norm, k_norm in each of 2 layers
    sizes = [float(g.abs().max()) for g in norms]
    assert all(size > 1e-3 for size in sizes), sizes  # 100x the tolerance: a half sum cannot pass for the whole
