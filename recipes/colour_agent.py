"""A VLM CPU task: "Which colour is the square?" An `Env` agent whose first observation holds an image.

The image is 64 px, grey, with a 24 px (SIDE) square of one of four colours; the Env draws it from the row's label
(colour, x, y), so rows stay plain Python. The prompt text is the same for every row, so only the image tells the
colour: a policy that ignores it (one colour always, or one at random) scores ~0.25. Reward 1 when the answer is exactly
the colour word (the turn must end there: a truncated or longer answer scores 0), else 0; the reward is the accuracy.
`rows(split)`: 2,000 of the 4 x 41 x 41 (colour, x, y) labels split 1,800 train / 200 test, and an `sft` slice of
the first 40 train rows (2%) as chat examples with their image, so the SFT prompt is the RL prompt.
"""
import io
import random

from PIL import Image

from agent import Env, Result

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 40), "blue": (40, 70, 230), "yellow": (230, 210, 40)}
SIDE, QUESTION = 24, "Which colour is the square?"


def square(colour: str, x: int, y: int) -> bytes:
    """The PNG of one label: a SIDE px square of `colour` with its top-left corner at (x, y) on 64 px of grey."""
    img = Image.new("RGB", (64, 64), (128, 128, 128))
    img.paste(COLOURS[colour], (x, y, x + SIDE, y + SIDE))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def rows(split: str) -> list[dict]:
    labels = [(c, x, y) for c in COLOURS for x in range(65 - SIDE) for y in range(65 - SIDE)]
    labels = random.Random(0).sample(labels, 2000)
    if split == "train":
        return [{"prompt": QUESTION, "label": label} for label in labels[:1800]]
    if split == "test":
        return [{"prompt": QUESTION, "label": label} for label in labels[1800:]]
    if split == "sft":
        return [{"messages": [{"role": "user", "content": [{"type": "image", "image": square(*label)},
                                                           {"type": "text", "text": QUESTION}]},
                              {"role": "assistant", "content": label[0]}]} for label in labels[:40]]
    raise ValueError(f"split {split!r}: choose train, test or sft")


class ColourEnv(Env):
    async def reset(self, prompt: str, label) -> list:
        return [square(*label), prompt]   # the image first, as in the SFT examples

    async def step(self, action_text: str, state: dict) -> Result:
        colour = state["label"][0]
        return Result(reward=float(action_text == colour), info={"colour": colour})


def make_agent() -> Env:
    return ColourEnv()
