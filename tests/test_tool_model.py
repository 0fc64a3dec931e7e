"""tool_model's cache: a tool model is trained once per checksum of what it is trained on, and reused after."""
import copy
import inspect
import os
import subprocess

import tool_model
from recipes.tiny_model import build_tiny_model
from tool_model import build_tool_model, redrawn, tool_model_key

# build_tool_model's own defaults, as the hyper-parameters it keys its cache by (vary is keyed apart, flags as a list):
# a default added there is in the key here too
HYPER = {name: p.default for name, p in inspect.signature(build_tool_model).parameters.items()
         if p.default is not inspect.Parameter.empty and name != "vary"}
HYPER.update(temperature=0.5, min_odds=0.0, flags=[])


def capture(workdir: str, date: str, answer: str = "Done: done.txt is created.") -> dict:
    return {"messages": [{"role": "system", "content": f"cwd {workdir}, today {date}, session 7f3a9c21e0"},
                         {"role": "user", "content": "create done.txt"}, {"role": "assistant", "content": answer}],
            "tools": [{"type": "function", "function": {"name": "Bash", "parameters": {}}}]}


def test_key_ignores_what_differs_between_captures_and_not_what_trains():
    first = capture("/tmp/pytest-of-ci/pytest-12/frameworks0", "2026-12-03")
    again = capture("/tmp/pytest-of-ci/pytest-13/frameworks1", "2026-12-04")  # another run: paths and date differ
    again["messages"][0]["content"] = again["messages"][0]["content"].replace("7f3a9c21e0", "0b5de4477c")
    key = tool_model_key([first], redrawn, HYPER)
    assert tool_model_key([again], redrawn, HYPER) == key
    other_reply = capture("/tmp/pytest-of-ci/pytest-12/frameworks0", "2026-12-03", answer="Done.")
    assert tool_model_key([other_reply], redrawn, HYPER) != key
    assert tool_model_key([first], redrawn, dict(HYPER, lr=1e-2)) != key
    assert tool_model_key([first], redrawn, dict(HYPER, seed=1)) != key
    assert tool_model_key([first, first], redrawn, HYPER) != key


def test_a_second_build_with_the_same_key_reuses_the_cached_model(tmp_path, monkeypatch):
    """The cache holds a model under the example's key: build_tool_model returns it, never starting the SFT."""
    monkeypatch.setattr(tool_model, "CACHE", str(tmp_path / "cache"))
    example = capture("/w", "2026-12-03")
    key = tool_model_key([example], redrawn, HYPER)
    model = build_tiny_model(str(tmp_path / "model"), seed=0, tokenizer="bpe")
    cached = tool_model.keep(model, os.path.join(tool_model.CACHE, f"tool-model-{key[:16]}"))
    assert sorted(os.listdir(cached)) == sorted(os.listdir(model))
    assert tool_model.keep(model, cached) == cached  # a copy kept first by another run is left as it is

    def no_training(*args, **kwargs):
        raise AssertionError("the SFT ran although the model was cached")
    monkeypatch.setattr(subprocess, "run", no_training)
    later = copy.deepcopy(example)
    later["messages"][0]["content"] = later["messages"][0]["content"].replace("2026-12-03", "2027-01-09")
    assert build_tool_model(str(tmp_path / "out"), [later], **{k: v for k, v in HYPER.items() if k != "flags"}) == \
        cached
