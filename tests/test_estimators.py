"""Invariants of estimators.py; every expected number is derived by hand in the comment above it."""
import math

import pytest
import torch

from estimators import (ESTIMATORS, EstimatorArgs, RolloutFacts, compute_advantages, dr_grpo, gae, grpo, reinforce,
                        rloo, rollout_facts)
from generator import Segment


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


def rows(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def ones_mask(b, t):
    return torch.ones(b, t, dtype=torch.bool)


def run(name, rewards, group_ids, episode_ids, mask, **kw):
    """compute_advantages with every flag at its default except `name` and what kw overrides."""
    values, kl = kw.pop("values", None), kw.pop("kl", None)
    return compute_advantages(EstimatorArgs(name=name, **kw), rewards, group_ids, episode_ids, mask,
                              values=values, kl=kl)


def close(actual, expected):
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=1e-12), actual.tolist()


def first_token(adv):
    return adv[:, 0].tolist()


# --- group estimators on one group of three episodes with rewards 1, 0, 0 (one action token each)
# mean = 1/3, deviations = (2/3, -1/3, -1/3), unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3.

R3, G3, E3, M3 = rows(1, 0, 0), ids(0, 0, 0), ids(0, 1, 2), ones_mask(3, 1)


def test_grpo_three_member_group_by_hand():
    # (r - mean) / (sqrt(1/3) + eps): 2/3 / sqrt(1/3) = 2/sqrt(3) = 1.1547, -1/3 / sqrt(1/3) = -1/sqrt(3)
    s = math.sqrt(1 / 3) + 1e-6
    adv, returns, _ = run("grpo", R3, G3, E3, M3)
    assert first_token(adv) == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s], abs=1e-12)
    assert returns is None


def test_dr_grpo_three_member_group_by_hand():
    # r - mean: 1 - 1/3, 0 - 1/3, 0 - 1/3
    adv, _, _ = run("dr_grpo", R3, G3, E3, M3)
    assert first_token(adv) == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-12)


def test_rloo_subtracts_mean_of_the_other_members():
    # r_0 - mean(0, 0) = 1; r_1 - mean(1, 0) = -1/2; r_2 - mean(1, 0) = -1/2
    adv, _, _ = run("rloo", R3, G3, E3, M3)
    assert first_token(adv) == pytest.approx([1.0, -0.5, -0.5], abs=1e-12)


def test_reinforce_baseline_without_whitening_is_group_centred():
    # whiten off: r - mean, as dr_grpo: 2/3, -1/3, -1/3
    adv, _, _ = run("reinforce_baseline", R3, G3, E3, M3, whiten=False)
    assert first_token(adv) == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-12)


def test_reinforce_baseline_whitens_token_weighted_over_the_batch():
    # Episodes rewards 1, 0 in one group -> centred 0.5, -0.5. Row 0 has 2 action tokens, row 1 has 1,
    # so the tokens are (0.5, 0.5, -0.5): mean 1/6, deviations (1/3, 1/3, -2/3),
    # unbiased var = (1/9 + 1/9 + 4/9) / 2 = 1/3, std = 1/sqrt(3). Whitened: (1/3)*sqrt(3), -(2/3)*sqrt(3).
    mask = torch.tensor([[True, True], [True, False]])
    adv, _, _ = run("reinforce_baseline", rows(1, 0), ids(0, 0), ids(0, 1), mask)
    s = 1 / math.sqrt(3) + 1e-6
    close(adv, [[(1 / 3) / s, (1 / 3) / s], [(-2 / 3) / s, 0.0]])


def test_batch_baseline_subtracts_the_batch_mean_across_groups():
    # Rewards 1, 0 (group 0) and 2 (group 1): batch mean = 1 -> 0, -1, 1 (a group mean would give 0.5, -0.5, 0)
    adv, _, _ = run("batch_baseline", rows(1, 0, 2), ids(0, 0, 1), ids(0, 1, 2), ones_mask(3, 1))
    assert first_token(adv) == pytest.approx([0.0, -1.0, 1.0], abs=1e-12)


def test_grpo_constant_group_has_zero_advantage():
    # 0.9 is not exact in float32: a naive float32 sum/3 misses it by ~6e-8, which the std division
    # (std ~ 0, eps 1e-6) would turn into an advantage of ~0.05. It must be exactly 0 instead.
    r = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0], dtype=torch.float32)
    adv = grpo(r, ids(0, 0, 0, 1, 1), ids(0, 1, 2, 3, 4), ones_mask(5, 2))
    assert adv[:3].eq(0).all()
    assert adv[3:].ne(0).all()


@pytest.mark.parametrize("estimator", [grpo, rloo, dr_grpo])
def test_singleton_group_gets_zero_advantage(estimator):
    # Group 1 holds one episode: it has no baseline, so 0. Group 0 (rewards 1, 0) stays non-zero.
    adv = estimator(rows(1, 0, 1), ids(0, 0, 1), ids(0, 1, 2), ones_mask(3, 2))
    assert adv[2].eq(0).all()
    assert adv[:2].ne(0).all()


def test_multi_segment_episode_counts_once_and_broadcasts_to_all_segments():
    # Group 0: episode 7 (one row, reward 1) and episode 8 (three rows, reward 0).
    # Over episodes: mean 0.5, dr_grpo = +0.5 / -0.5; unbiased std = sqrt(2 * 0.25 / 1) = sqrt(0.5),
    # grpo = +-0.5 / sqrt(0.5). (Over rows it would be mean 0.25, dr_grpo 0.75 / -0.25.)
    r, g, e = rows(1, 0, 0, 0), ids(0, 0, 0, 0), ids(7, 8, 8, 8)
    mask = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    adv = dr_grpo(r, g, e, mask)
    assert adv.tolist() == [[0.5, 0.5], [-0.5, 0.0], [0.0, -0.5], [-0.5, -0.5]]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(grpo(r, g, e, mask), [[a, a], [-a, 0.0], [0.0, -a], [-a, -a]])


# --- token-level estimators


def test_reinforce_discounts_over_action_tokens_only():
    # Row: prompt, a0, tool token, a1, a2; reward 1 on a2; gamma 0.5, whiten off.
    # G(a2) = 1, G(a1) = 0.5 * 1 = 0.5, G(a0) = 0.5 * 0.5 = 0.25 (the tool token is skipped, not discounted).
    mask = torch.tensor([[False, True, False, True, True]])
    adv = reinforce(rows(1), mask, gamma=0.5, whiten=False)
    assert adv.tolist() == [[0.0, 0.25, 0.0, 0.5, 1.0]]


def test_reinforce_whitens_over_all_action_tokens_of_the_batch():
    # gamma 1: row 0 (reward 1, 2 tokens) -> G = (1, 1); row 1 (reward 3, 1 token) -> G = (3).
    # Tokens (1, 1, 3): mean 5/3, deviations (-2/3, -2/3, 4/3), unbiased var = (4+4+16)/9/2 = 4/3,
    # std = 2/sqrt(3). Whitened: (-2/3) / std, (4/3) / std.
    mask = torch.tensor([[True, True], [False, True]])
    s = 2 / math.sqrt(3) + 1e-6
    adv = reinforce(rows(1, 3), mask, whiten=True, std_eps=1e-6)
    close(adv, [[(-2 / 3) / s, (-2 / 3) / s], [0.0, (4 / 3) / s]])


def test_reinforce_kl_reward_on_every_action_token():
    # kl_coef 0.1, gamma 1, reward 1; mask (T, T, F, T), kl (1, 2, 50, 3): the 50 is off-mask and ignored.
    # Token rewards: -0.1, -0.2, 0, 1 - 0.3 = 0.7. Returns: 0.7; -0.2 + 0.7 = 0.5; -0.1 + 0.5 = 0.4.
    mask = torch.tensor([[True, True, False, True]])
    adv = reinforce(rows(1), mask, kl=rows(1, 2, 50, 3)[None], kl_coef=0.1, whiten=False)
    close(adv, [[0.4, 0.5, 0.0, 0.7]])


def test_reinforce_kl_coef_without_kl_is_rejected():
    with pytest.raises(ValueError, match="kl"):
        reinforce(rows(1), ones_mask(1, 2), kl_coef=0.1)


# GAE row: prompt, a0, two tool tokens, a1, a2; gamma = lam = 0.5, reward 1 on a2.
# Values on the action tokens (0.4, 0.2, 0.6); 9.0 on the others, which must never be read.
# delta(a2) = 1 + 0.5 * 0   - 0.6 = 0.4;   A(a2) = 0.4
# delta(a1) = 0 + 0.5 * 0.6 - 0.2 = 0.1;   A(a1) = 0.1  + 0.25 * 0.4 = 0.2
# delta(a0) = 0 + 0.5 * 0.2 - 0.4 = -0.3;  A(a0) = -0.3 + 0.25 * 0.2 = -0.25
# returns = A + V: 0.15, 0.4, 1.0
GAE_MASK = torch.tensor([[False, True, False, False, True, True]])
GAE_VALUES = rows(9.0, 0.4, 9.0, 9.0, 0.2, 0.6)[None]


def test_gae_by_hand_with_a_tool_output_gap():
    adv, returns = gae(rows(1), GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5, whiten=False)
    close(adv, [[0.0, -0.25, 0.0, 0.0, 0.2, 0.4]])
    close(returns, [[0.0, 0.15, 0.0, 0.0, 0.4, 1.0]])


def test_gae_non_action_tokens_are_transparent():
    # The same row with the two tool tokens removed must give the same advantages on its action tokens.
    gapless_mask = torch.tensor([[False, True, True, True]])
    gapless_values = rows(9.0, 0.4, 0.2, 0.6)[None]
    adv, _ = gae(rows(1), GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5, whiten=False)
    gapless, _ = gae(rows(1), gapless_values, gapless_mask, gamma=0.5, lam=0.5, whiten=False)
    assert torch.equal(adv[GAE_MASK], gapless[gapless_mask])


def test_gae_returns_are_unwhitened_advantages_plus_values():
    # Two rows with different lengths; returns must be A + V on action tokens, 0 elsewhere, and must not
    # change when the advantages are whitened.
    mask = torch.tensor([[True, False, True, True], [False, True, True, False]])
    values = rows(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8).reshape(2, 4)
    adv, returns = gae(rows(1, -1), values, mask, gamma=0.9, lam=0.8, whiten=False)
    whitened, returns_when_whitened = gae(rows(1, -1), values, mask, gamma=0.9, lam=0.8, whiten=True)
    assert torch.equal(returns, torch.where(mask, adv + values, 0.0))
    assert torch.equal(returns_when_whitened, returns)
    assert not torch.allclose(whitened, adv)


def test_gae_kl_reward_enters_delta():
    # kl_coef 0.5, kl (1, 1), values 0, gamma = lam = 1, reward 1: token rewards (-0.5, 1 - 0.5 = 0.5),
    # delta = r (values are 0), A = (-0.5 + 0.5, 0.5) = (0, 0.5).
    adv, _, _ = run("gae", rows(1), ids(0), ids(0), ones_mask(1, 2), values=torch.zeros(1, 2, dtype=torch.float64),
                    kl=rows(1, 1)[None], kl_coef=0.5, whiten=False)
    close(adv, [[0.0, 0.5]])


def test_gae_with_lambda_one_is_return_minus_value():
    # gamma = lam = 1: A_t = sum of later rewards - V_t = R - V_t on every action token.
    values = rows(0.25, 0.5, 0.75)[None]
    adv, _ = gae(rows(2), values, ones_mask(1, 3), whiten=False)
    assert adv.tolist() == [[1.75, 1.5, 1.25]]


# --- every estimator through the dispatch


@pytest.mark.parametrize("name", ESTIMATORS)
def test_non_action_tokens_get_zero_advantage(name):
    mask = torch.tensor([[False, True, False, True], [True, True, False, False],
                         [False, False, True, True], [False, False, False, False]])
    values = torch.full((4, 4), 0.3, dtype=torch.float64)
    kl = torch.full((4, 4), 0.2, dtype=torch.float64)
    adv, _, _ = run(name, rows(1, 0, 0.5, 1), ids(0, 0, 1, 1), ids(0, 1, 2, 3), mask, values=values, kl=kl)
    assert adv.shape == mask.shape
    assert adv[~mask].eq(0).all()
    assert adv[mask].ne(0).any()


@pytest.mark.parametrize("name", ESTIMATORS)
def test_batch_without_action_tokens_gives_zero_advantages_and_metrics(name):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    adv, _, metrics = run(name, rows(1, 0), ids(0, 0), ids(0, 1), mask, values=torch.ones(2, 3, dtype=torch.float64))
    assert adv.eq(0).all()
    assert metrics["estimator/adv_max"] == metrics["estimator/adv_std"] == 0.0
    assert metrics["estimator/zero_adv_groups"] == 1.0


def test_metrics_report_share_of_groups_with_all_zero_advantages():
    # Group 0 is constant (grpo gives exactly 0), group 1 has rewards 1, 0: 1 of 2 groups is dead -> 0.5.
    adv, _, metrics = run("grpo", rows(1, 1, 1, 0), ids(0, 0, 1, 1), ids(0, 1, 2, 3), ones_mask(4, 2))
    assert metrics["estimator/zero_adv_groups"] == 0.5
    assert metrics["estimator/adv_max"] == adv.max().item() > 0
    assert all(isinstance(v, float) for v in metrics.values())


def test_gae_metrics_include_returns_mean():
    # whiten off, gamma = lam = 1, one row with reward 2 and values 0.5, 1.5: returns = 2, 2 -> mean 2.
    values = rows(0.5, 1.5)[None]
    _, _, metrics = run("gae", rows(2), ids(0), ids(0), ones_mask(1, 2), values=values, whiten=False)
    assert metrics["estimator/returns_mean"] == pytest.approx(2.0)
    assert "estimator/returns_mean" not in run("grpo", rows(2), ids(0), ids(0), ones_mask(1, 2))[2]


def test_empty_row_is_fine_and_gets_zero_advantage():
    mask = torch.tensor([[True, True], [False, False]])
    for name in ("grpo", "reinforce"):
        adv, _, _ = run(name, rows(1, 0), ids(0, 0), ids(0, 1), mask)
        assert adv[1].eq(0).all()


# --- bad input


GOOD = dict(rewards=rows(1, 0), group_ids=ids(0, 0), episode_ids=ids(0, 1), mask=ones_mask(2, 3))


@pytest.mark.parametrize("argument, bad", [
    ("rewards", rows(1, 0)[:, None]),
    ("rewards", rows()),
    ("rewards", rows(1, float("nan"))),
    ("rewards", ids(1, 0)),
    ("mask", ones_mask(3, 3)),
    ("mask", torch.ones(2, 3)),
    ("mask", torch.ones(2, 0, dtype=torch.bool)),
    ("group_ids", ids(0, 0, 0)),
    ("episode_ids", ids(0)),
])
def test_bad_input_names_the_argument(argument, bad):
    inputs = dict(GOOD, **{argument: bad})
    with pytest.raises(ValueError, match=argument):
        compute_advantages(EstimatorArgs(), **inputs)


def test_gae_needs_values_of_the_mask_shape():
    with pytest.raises(ValueError, match="values"):
        compute_advantages(EstimatorArgs(name="gae"), **GOOD)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(EstimatorArgs(name="gae"), **GOOD, values=torch.zeros(2, 4))


def test_values_that_require_grad_are_rejected():
    values = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(EstimatorArgs(name="gae"), **GOOD, values=values)


def test_episode_whose_rows_disagree_is_rejected():
    with pytest.raises(ValueError, match="episode_ids"):  # same episode, rewards 1 and 0
        compute_advantages(EstimatorArgs(), **dict(GOOD, episode_ids=ids(5, 5)))
    with pytest.raises(ValueError, match="episode_ids"):  # same episode, groups 0 and 1
        compute_advantages(EstimatorArgs(), **dict(GOOD, rewards=rows(1, 1), group_ids=ids(0, 1),
                                                   episode_ids=ids(5, 5)))


def test_unknown_name_lists_the_choices():
    args = EstimatorArgs()
    args.name = "ppo"
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages(args, **GOOD)
    with pytest.raises(ValueError, match="--estimator.name"):
        EstimatorArgs(name="ppo")


def test_only_gae_needs_values_and_only_a_kl_coef_needs_kl():
    # gae is the one estimator with a value baseline; the others read rewards alone.
    assert [n for n in ESTIMATORS if EstimatorArgs(name=n).needs_values] == ["gae"]
    assert [EstimatorArgs(name=n, kl_coef=c).needs_kl for n, c in
            (("grpo", 0.0), ("reinforce", 0.0), ("reinforce", 0.1), ("gae", 0.1))] == [False, False, True, True]


@pytest.mark.parametrize("flags, flag", [
    (dict(gamma=1.5), "--estimator.gamma"),
    (dict(gamma=-0.1, name="gae"), "--estimator.gamma"),
    (dict(lam=2.0, name="gae"), "--estimator.lam"),
    (dict(std_eps=0.0), "--estimator.std_eps"),
    (dict(kl_coef=-1.0, name="gae"), "--estimator.kl_coef"),
    (dict(kl_coef=0.1, name="grpo"), "--estimator.kl_coef with --estimator.name"),
    (dict(gamma=0.9, name="rloo"), "--estimator.gamma with --estimator.name"),
    (dict(lam=0.9, name="reinforce"), "--estimator.lam with --estimator.name"),
    (dict(truncated_reward=float("nan")), "--estimator.truncated_reward"),
    (dict(overlong_max=10), "--estimator.overlong_cache 0"),
    (dict(overlong_max=10, overlong_cache=11), "--estimator.overlong_cache 11"),
    (dict(overlong_cache=4), "--estimator.overlong_cache without --estimator.overlong_max"),
])
def test_estimator_args_reject_bad_flags_naming_the_flag(flags, flag):
    with pytest.raises(ValueError, match=flag):
        EstimatorArgs(**flags)


def test_truncated_reward_replaces_the_reward_of_every_row_of_a_truncated_episode():
    # episodes 0 (two segments, the second cut off), 1, 2 and 3 (cut off) in one group; --estimator.truncated_reward -1
    # shaped rewards [-1, -1, 0, 1, -1]; per episode [-1, 0, 1, -1]: mean -0.25, deviations [-0.75, 0.25, 1.25, -0.75],
    # squares sum 2.75, unbiased std sqrt(2.75 / 3) = 0.957427: grpo advantages -0.78335, 0.26112, 1.30558, -0.78335
    rewards, episodes, groups = rows(1, 1, 0, 1, 0.5), ids(0, 0, 1, 2, 3), ids(0, 0, 0, 0, 0)
    facts = [RolloutFacts(turns=1, action_tokens=2, truncated=cut, finish_reason="length" if cut else "stop",
                          tool_calls=None, info={}) for cut in (False, True, False, False, True)]
    adv, _, metrics = compute_advantages(EstimatorArgs(name="grpo", truncated_reward=-1.0), rewards, groups, episodes,
                                         ones_mask(5, 2), facts=facts)
    assert torch.allclose(adv[:, 0], rows(-0.78335, -0.78335, 0.26112, 1.30558, -0.78335), atol=1e-5)
    assert torch.equal(adv[:, 0], adv[:, 1])
    assert metrics["estimator/reward_mean"] == pytest.approx(-0.25)  # per episode (-1 + 0 + 1 - 1) / 4
    # unset, the rollout's own rewards: per episode (1 + 0 + 1 + 0.5) / 4 = 0.625
    _, _, plain = compute_advantages(EstimatorArgs(name="grpo"), rewards, groups, episodes, ones_mask(5, 2),
                                     facts=facts)
    assert plain["estimator/reward_mean"] == pytest.approx(0.625)
    with pytest.raises(ValueError, match=r"facts: expected one RolloutFacts per row \(5\), got 4"):
        compute_advantages(EstimatorArgs(name="grpo"), rewards, groups, episodes, ones_mask(5, 2), facts=facts[:4])


def facts_of(tokens, truncated=()):
    """One RolloutFacts per row: its action tokens, and whether it was cut (rows listed in truncated)."""
    return [RolloutFacts(turns=1, action_tokens=n, truncated=i in truncated, finish_reason="stop", tool_calls=None,
                         info={}) for i, n in enumerate(tokens)]


def test_overlong_penalty_ramps_over_the_cache_by_each_episodes_action_tokens_of_all_its_rows():
    # DAPO's soft overlong punishment, L_max 10, L_cache 4: 0 up to 6 tokens, (6 - L) / 4 from 6 to 10, -1 beyond.
    # Episodes (rows): e0 5 tokens -> 0; e1 two segments 3 + 4 = 7 -> -0.25; e2 8 -> -0.5; e3 10 -> -1; e4 12 -> -1.
    # Rewards 1 each: shaped [1, 0.75, 0.75, 0.5, 0, 0] per row, per episode (1 + 0.75 + 0.5 + 0 + 0) / 5 = 0.45.
    rewards, episodes, groups = rows(1, 1, 1, 1, 1, 1), ids(0, 1, 1, 2, 3, 4), ids(0, 0, 0, 0, 0, 0)
    args = EstimatorArgs(name="dr_grpo", overlong_max=10, overlong_cache=4)
    adv, _, metrics = compute_advantages(args, rewards, groups, episodes, ones_mask(6, 2),
                                         facts=facts_of([5, 3, 4, 8, 10, 12]))
    assert metrics["estimator/reward_mean"] == pytest.approx(0.45)
    # dr_grpo: A = R - 0.45 per episode: 0.55, 0.3, 0.3, 0.05, -0.45, -0.45 per row
    assert torch.allclose(adv[:, 0], rows(0.55, 0.3, 0.3, 0.05, -0.45, -0.45), atol=1e-6)
    # With --estimator.truncated_reward -2, a cut episode's reward is exactly -2, not -2 plus its length penalty:
    # e3 cut -> per episode (1 + 0.75 + 0.5 - 2 + 0) / 5 = 0.05.
    args = EstimatorArgs(name="dr_grpo", overlong_max=10, overlong_cache=4, truncated_reward=-2.0)
    _, _, metrics = compute_advantages(args, rewards, groups, episodes, ones_mask(6, 2),
                                       facts=facts_of([5, 3, 4, 8, 10, 12], truncated=(4,)))
    assert metrics["estimator/reward_mean"] == pytest.approx(0.05)


def test_rollout_facts_have_one_shape_for_env_and_chat_segments():
    # An Env row (agent.run_env_episode): prompt 2, turn 1 samples 3, observation 2, turn 2 samples 2 and is cut at
    # max tokens; a chat row (chat_server): prompt 1, one turn of 4 whose reply held 2 tool calls. Both record their
    # turns as (start, end) spans of sampled tokens, so turns and action tokens read the same way for both.
    def row(mask, turns, finish, **info):
        n = len(mask)
        return Segment(token_ids=[5] * n, action_mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask],
                       versions=[0 if m else -1 for m in mask], finish_reason=finish, truncated=finish == "length",
                       info={"turns": turns, **info})
    env = row([False] * 2 + [True] * 3 + [False] * 2 + [True] * 2, [(2, 5), (7, 9)], "length", score=0.5)
    chat = row([False] + [True] * 4, [(1, 5)], "stop", tool_calls=2)
    assert rollout_facts([env, chat]) == [
        RolloutFacts(turns=2, action_tokens=5, truncated=True, finish_reason="length", tool_calls=None,
                     info=env.info),
        RolloutFacts(turns=1, action_tokens=4, truncated=False, finish_reason="stop", tool_calls=2, info=chat.info)]
    assert rollout_facts([env])[0].info["score"] == 0.5  # the agent's own Result.info reaches shape_rewards


def test_reward_mean_counts_each_episode_once_whatever_its_segments():
    # Episode A: 2 segments (a compaction) at reward 1; episode B: 1 segment at 0. Per episode (1 + 0) / 2 = 0.5, as
    # rollout/trained_reward_mean counts; per row it was (1 + 1 + 0) / 3 = 2/3. The ids need not be sorted.
    _, _, metrics = compute_advantages(EstimatorArgs(name="grpo"), rows(1, 0, 1), ids(0, 0, 0), ids(7, 3, 7),
                                       ones_mask(3, 2))
    assert metrics["estimator/reward_mean"] == pytest.approx(0.5)
