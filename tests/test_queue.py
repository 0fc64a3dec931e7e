"""launch.GroupQueue's bookkeeping, driven the way run_rl drives it, with stand-in agent workers: in-process
coroutines that answer at once (the engine is not under test here: what is launched, trained, filtered and logged
is). Where the version arithmetic matters, the trainer is the real one (Ray, FSDP2 on gloo, the tiny chars model).
"""
import asyncio
import itertools
import random
import types

import pytest

import launch
from estimators import EstimatorArgs
from generator import Segment
from losses import LossArgs
from trainer import CkptArgs, FsdpArgs, TrainArgs, TrainerGroup

VOCAB = 72  # tiny_chars_model


def episode(name: str, rewards: list[float], version: int = 0, rng=None) -> list[Segment]:
    """One episode of len(rewards) segments (a compaction opens the next), each a prompt and 3 sampled tokens."""
    rng = rng or random.Random(name)
    out = []
    for k, reward in enumerate(rewards):
        ids = [rng.randrange(3, VOCAB) for _ in range(7)]
        mask = [False] * 4 + [True] * 3
        out.append(Segment(token_ids=ids, action_mask=mask, logprobs=[-4.0 if m else 0.0 for m in mask],
                           versions=[version if m else -1 for m in mask], reward=reward, episode_id=name,
                           group_id=name.split("-")[0], info={"segment": k}))
    return out


def result(segments: list[Segment], **dropped: int) -> dict:
    return {"segments": segments, "dropped": {"agent_error": 0, "timeout": 0, "tainted": 0, **dropped},
            "scored": {}, "scored_ids": [], "errors": [], "seconds": 0.0}


def worker(run_group) -> types.SimpleNamespace:
    """A stand-in AgentWorker: run_group.remote(row, group_id, samples) is a coroutine of the group's result."""
    return types.SimpleNamespace(run_group=types.SimpleNamespace(remote=run_group))


def scripted(groups: list[list[list[float]]]) -> types.SimpleNamespace:
    """Answers the queue's launches in order: group k's episodes have the given segment rewards."""
    answers = iter(groups)

    async def run_group(row, group_id, samples):
        return result([s for e, rewards in enumerate(next(answers)) for s in episode(f"{group_id}-{e}", rewards)])
    return worker(run_group)


ROWS = [{"prompt": f"p{i}"} for i in range(50)]


def test_k1_trains_what_it_launches_one_refit_late_whatever_the_optimizer_steps_per_train_step(ray_local,
                                                                                             tiny_chars_model):
    # run_rl's schedule at K=1, 2 prompts x 2 samples per step, 4 steps, --train.minibatches 2 (two AdamW steps per
    # train step). A stand-in worker samples at once with the engines' version, which the refit sets.
    # By hand, capacity 2 x (1 + 1) = 4 and 4 x 2 = 8 groups to launch:
    #   step 0: 4 launched at v0, trains 2 of them at v0 (lag 0); refit v1; 2 queued + 2 launched at v1
    #   step 1: trains the 2 queued v0 groups at v1 (lag 1, min_version 0 keeps them); refit v2; 2 launched at v2
    #   step 2: trains the v1 groups at v2 (lag 1); the 8 are launched, nothing more
    #   step 3: trains the v2 groups at v3 (lag 1)
    # 8 launched, 8 trained, none stale. Were the version one per optimizer step (v2 after step 0), step 1's
    # min_version would be 1: the v0 groups would go stale and be sampled again, and every batch would lag 0.
    K, B, steps = 1, 2, 4
    trainer = TrainerGroup(tiny_chars_model, TrainArgs(lr=1e-3, minibatches=2), FsdpArgs(), CkptArgs(),
                           LossArgs(is_level="token"), EstimatorArgs(), temperature=1.0, gpus_per_rank=0)
    engine = {"version": 0}
    rng = random.Random(0)

    async def run_group(row, group_id, samples):
        v = engine["version"]
        return result([s for k in range(samples) for s in episode(f"{group_id}-{k}", [float(k)], v, rng)])

    async def schedule():
        queue = launch.GroupQueue([worker(run_group)], ROWS, 2, {"epoch": 0, "index": 0}, 0, groups=steps * B)
        capacity, lags = B * (K + 1), []
        for step in range(steps):
            groups = await queue.next_batch(B, capacity=capacity, filter_range=None, max_filtered=1,
                                            min_version=trainer.version - K)
            segments = [s for g in groups for s in g["segments"]]
            lags.append(sorted({trainer.version - v for s in segments for v, m in zip(s.versions, s.action_mask)
                                if m}))
            await asyncio.to_thread(trainer.train_step, segments)
            await queue.drain()
            engine["version"] = trainer.version  # the refit
            if step + 1 < steps:
                queue.fill(capacity)
        return queue, lags

    try:
        queue, lags = asyncio.run(schedule())
    finally:
        trainer.shutdown()
    assert lags == [[0], [1], [1], [1]]
    assert queue.launched == 8 and queue.counts["dropped_stale"] == 0 and trainer.version == steps


def test_data_that_is_always_filtered_stops_the_run_naming_the_flags_and_the_share():
    # Every episode has reward 1, so every group's mean is outside [0, 0.5]. By hand, capacity 4: the first fill
    # launches 4; each group taken (filtered) is replaced by one launch; the 7th filtered one is more than 6 and
    # stops the run: 4 + 6 replacements = 10 launched.
    queue = launch.GroupQueue([scripted([[[1.0], [1.0]]] * 20)], ROWS, 2, {"epoch": 0, "index": 0}, 0, groups=40)

    async def one_batch():
        try:
            await asyncio.wait_for(queue.next_batch(2, capacity=4, filter_range=(0.0, 0.5), max_filtered=6,
                                                    min_version=0), 60)
        finally:
            await queue.drain()
    with pytest.raises(RuntimeError) as e:
        asyncio.run(one_batch())
    assert "--data.filter_range 0 0.5" in str(e.value) and "--data.max_filtered_batches" in str(e.value)
    assert "100.0% of the 7 groups" in str(e.value)
    assert queue.launched == 10


def test_step_metrics_are_this_steps_and_the_reward_mean_counts_filtered_groups():
    # Groups in launch order, each episode's segment rewards; filter [0.25, 0.75] on a group's mean.
    groups = [[[1.0], [1.0]],       # A: mean 1, filtered
              [[0.0], [1.0]],       # B: kept
              [[1.0, 1.0], [0.0]],  # C: a 2-segment episode at 1 and one at 0: segment mean 2/3, kept
              [[0.0], [0.0]],       # D: mean 0, filtered
              [[1.0], [0.0]],       # E: kept
              [[0.0], [1.0]],       # F: kept
              [[0.0], [1.0]]]       # G: launched, not taken
    queue = launch.GroupQueue([scripted(groups)], ROWS, 2, {"epoch": 0, "index": 0}, 0, groups=8)

    async def two_steps():
        out = []
        for _ in range(2):
            batch = await queue.next_batch(2, capacity=3, filter_range=(0.25, 0.75), max_filtered=4, min_version=0)
            trained = launch.rollout_metrics([s for g in batch for s in g["segments"]], 0, 0)
            out.append((queue.step_metrics(), trained))
        await queue.drain()
        return out
    (first, trained1), (second, trained2) = asyncio.run(two_steps())
    # Capacity 3: step 0 launches A B C, takes A (filtered), launches D, takes B and C; D waits, finished.
    # Its episodes A 1 1, B 0 1, C 1 0 (C's 2-segment episode once): 4 / 6; the trained batch B, C: 2 / 4.
    assert first["rollout/reward_mean"] == pytest.approx(4 / 6) and trained1["rollout/trained_reward_mean"] == 0.5
    assert first["rollout/dropped_filtered"] == 1.0 and first["rollout/dropped_agent_error"] == 0.0
    # Step 1 takes D (filtered), E, F: 0 0, 1 0, 0 1 -> 2 / 6. One filtered this step (two in the run).
    assert second["rollout/reward_mean"] == pytest.approx(2 / 6) and trained2["rollout/trained_reward_mean"] == 0.5
    assert second["rollout/dropped_filtered"] == 1.0 and queue.counts["dropped_filtered"] == 2


def test_eval_reward_mean_counts_each_episode_once_and_a_failed_one_as_zero():
    answers = {"eval0": result(episode("eval0-0", [1.0, 1.0])),  # one episode of 2 segments at reward 1
               "eval1": result(episode("eval1-0", [0.0])),       # one at reward 0
               "eval2": result([], agent_error=1)}               # one whose agent raised

    async def run_group(row, group_id, samples):
        return answers[group_id]
    out = asyncio.run(launch.evaluate([worker(run_group)], ROWS, 3))
    # 3 episodes, rewards 1, 0 and 0 (the failure): 1 / 3. Per segment, without the failure, it was 2 / 3.
    assert out == {"eval/reward_mean": pytest.approx(1 / 3), "eval/episodes": 3.0, "eval/failed_episodes": 1.0}


def test_eval_counts_a_scored_failure_as_zero_and_an_agents_own_failed_info_at_its_reward():
    own = episode("eval0-0", [1.0])
    own[0].info["failed"] = "the agent's own word: its reward stands"   # an Env's Result.info may hold any key
    scored = episode("eval1-0", [-1.0])                                 # --agent.failed_reward -1: kept for training
    scored[0].info["failed"] = "timeout"                                # as AgentWorker.run_group marks it
    answers = {"eval0": result(own), "eval1": {**result(scored), "scored": {"timeout": 1}, "scored_ids": ["eval1-0"]}}

    async def run_group(row, group_id, samples):
        return answers[group_id]
    out = asyncio.run(launch.evaluate([worker(run_group)], ROWS, 2))
    # 2 episodes: reward 1 and the failure's 0 (not its training reward -1): 1 / 2
    assert out == {"eval/reward_mean": 0.5, "eval/episodes": 2.0, "eval/failed_episodes": 1.0}


def test_the_filter_judges_a_group_by_its_episodes_not_its_segments():
    # One group: an episode of 3 segments at reward 1 (two compactions) and one episode at 0. Its episode mean is
    # (1 + 0) / 2 = 0.5, inside [0, 0.6]: kept. Counted per segment it would be 3 / 4 = 0.75 and filtered.
    queue = launch.GroupQueue([scripted([[[1.0, 1.0, 1.0], [0.0]]])], ROWS, 2, {"epoch": 0, "index": 0}, 0, groups=1)

    async def one_batch():
        batch = await queue.next_batch(1, capacity=1, filter_range=(0.0, 0.6), max_filtered=1, min_version=0)
        await queue.drain()
        return batch
    batch = asyncio.run(one_batch())
    assert len(batch) == 1 and queue.counts["dropped_filtered"] == 0


def test_an_agent_that_fails_after_its_first_success_stops_the_run_within_a_bound():
    # The first group's episodes succeed, every later episode raises (as AgentWorker reports it: no segments, each
    # episode counted as agent_error, its message). Driven as run_rl does: batch 0 takes the success, batch 1 only
    # gets failures. By hand, capacity 2 and a bound of 3 failed groups per batch: batch 0 launches 2 and takes the
    # success (the first to finish); batch 1 tops up to 2 before each of its 4 takes (the 4th failure, > 3, stops
    # it): 2 + 4 = 6 launched, 4 failed groups = 8 episodes dropped. The old guard stopped only a run that never
    # kept a group: this one spun, 200k-320k groups launched in the test's 10 s.
    calls = itertools.count()

    async def run_group(row, group_id, samples):
        if next(calls) == 0:
            return result([s for k in range(samples) for s in episode(f"{group_id}-{k}", [float(k)])])
        return dict(result([], agent_error=samples), errors=["RuntimeError: the sandbox is gone"] * samples)
    queue = launch.GroupQueue([worker(run_group)], ROWS, 2, {"epoch": 0, "index": 0}, 0, groups=4)

    async def two_batches():
        try:
            for _ in range(2):
                await asyncio.wait_for(queue.next_batch(1, capacity=2, filter_range=None, max_filtered=3,
                                                        min_version=0), 10)
        finally:
            await queue.drain()
    with pytest.raises(RuntimeError) as e:
        asyncio.run(two_batches())
    assert "the sandbox is gone" in str(e.value) and "--data.max_filtered_batches" in str(e.value)
    assert queue.launched == 6 and queue.counts["dropped_agent_error"] == 8
