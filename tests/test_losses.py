"""losses.py: every expected number is derived by hand in the test (ln = natural log)."""
import math

import pytest
import torch

from losses import (IS_MODES, Denoms, LossArgs, aggregate, check_versions, cispo, compute_policy_loss,
                    compute_value_loss, gspo, importance_weights, kl_penalty, mismatch_metrics, ppo, sft_loss,
                    stale_mask, step_denoms, step_tokens, value_loss)

LN2 = math.log(2.0)


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


def leaf(x):
    return t(x, requires_grad=True)


def close(x, expected):
    return torch.allclose(x.detach().double(), t(expected))


def one_row(n):
    """Denominators for a step that is one row with n action tokens."""
    return Denoms(num_tokens=float(n), num_seqs=1.0, num_prompts=1.0)


def policy_loss(args, logp, old_logp, adv, mask, *, rollout_logp=None, versions=None, current_version=0,
                denoms=None, **kw):
    """compute_policy_loss with on-policy defaults: rollout = old, every token of version current_version;
    -> (loss, metrics of all its records in one dict: their keys are disjoint)."""
    rollout_logp = old_logp.detach() if rollout_logp is None else rollout_logp
    versions = torch.full(mask.shape, current_version) if versions is None else versions
    denoms = Denoms(float(mask.sum()), float(mask.any(-1).sum()), 1.0) if denoms is None else denoms
    loss, records = compute_policy_loss(args, logp, old_logp, rollout_logp, adv, mask, versions=versions,
                                        current_version=current_version, denoms=denoms, **kw)
    return loss, {k: v for _, metrics in records for k, v in metrics.items()}


# --- masks and robustness


@pytest.mark.parametrize("flags", [
    dict(surrogate="ppo", dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
    dict(surrogate="gspo", is_level="seq", is_mode="trunc", kl_coef=0.1, kl_estimator="k2", agg="seq_mean_token_mean"),
    dict(surrogate="cispo", is_level="geo", is_mode="mask", agg="seq_mean_token_sum", entropy_coef=0.01),
    dict(surrogate="ppo", is_level="token", is_mode="clip", agg="prompt_mean_token_mean", kl_coef=0.1),
], ids=["ppo", "gspo_seq", "cispo_geo", "ppo_token_clip"])
def test_loss_ignores_masked_tokens(flags):
    # Masked positions hold -inf, +huge and NaN. The loss and the gradients on action tokens must equal those
    # of the same batch with zeros there, and the gradient at masked positions must be exactly 0.
    args = LossArgs(**flags)
    mask = torch.tensor([[True, True, False, False], [True, False, True, False]])
    garbage = {"logp": [-math.inf, 1e30], "old": [-math.inf, -1e30], "rollout": [math.inf, -math.inf],
               "adv": [math.inf, math.nan], "ent": [math.nan, math.inf]}
    clean = {"logp": [-0.7, -1.2, -0.3, -2.0], "old": [-0.9, -1.0, -0.2, -1.5], "rollout": [-1.0, -1.1, -0.4, -1.6],
             "adv": [1.0, 1.0, -0.5, -0.5], "ent": [1.0, 2.0, 0.5, 0.1]}

    def build(name, fill):
        x = torch.zeros(2, 4, dtype=torch.float64)
        x[mask] = t(clean[name])
        x[~mask] = t([fill[name][0]] * 2 + [fill[name][1]] * 2) if fill else 0.0
        return x

    results = []
    for fill in (garbage, None):
        logp = build("logp", fill).requires_grad_()
        loss, metrics = policy_loss(args, logp, build("old", fill), build("adv", fill), mask,
                                    rollout_logp=build("rollout", fill), entropy=build("ent", fill),
                                    denoms=Denoms(num_tokens=4.0, num_seqs=2.0, num_prompts=1.0),
                                    group_tokens=t([4.0, 4.0]))
        loss.backward()
        results.append((loss.detach(), logp.grad, metrics))
    (loss, grad, metrics), (loss_clean, grad_clean, metrics_clean) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    assert loss == pytest.approx(loss_clean.item()) and torch.allclose(grad, grad_clean)
    assert metrics == pytest.approx(metrics_clean)


@pytest.mark.parametrize("surrogate", ["ppo", "gspo", "cispo"])
def test_empty_mask_gives_zero_loss_zero_metrics_and_a_backward_pass(surrogate):
    # No action tokens anywhere in the step: every denominator is 0, the loss must be 0 (not NaN) and still
    # connected to logp, so a rank with an empty microbatch can join the collective backward.
    agg = "seq_mean_token_mean" if surrogate == "gspo" else "token_mean"
    args = LossArgs(surrogate=surrogate, is_level="token", kl_coef=0.1, entropy_coef=0.1, agg=agg)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    logp = torch.full((2, 3), -math.inf, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(args, logp, torch.full((2, 3), -math.inf, dtype=torch.float64),
                                torch.full((2, 3), math.nan, dtype=torch.float64), mask,
                                entropy=torch.zeros(2, 3, dtype=torch.float64), denoms=Denoms(0.0, 0.0, 0.0))
    loss.backward()
    assert loss.item() == 0.0 and (logp.grad == 0).all()
    assert metrics and all(v == 0.0 for v in metrics.values())
    v = leaf([[1.0, 2.0, 3.0]])
    assert value_loss(v, t([[0.0, 0.0, 0.0]]), t([[9.0, 9.0, 9.0]]), mask[:1], clip=0.2,
                      denoms=Denoms(0.0, 0.0, 0.0))[0].item() == 0.0
    assert sft_loss(t([[-math.inf] * 3]), mask[:1], denoms=Denoms(0.0, 0.0, 0.0))[0].item() == 0.0
    assert all(v == 0.0 for v in mismatch_metrics(t([[0.0] * 3]), t([[-math.inf] * 3]), mask[:1]).values())


@pytest.mark.parametrize("surrogate", ["ppo", "gspo", "cispo"])
def test_extreme_ratio_stays_finite(surrogate):
    # logp - old = 1000 on an action token would overflow exp; the log-ratio is clamped to 20 first, and the
    # importance log-weight (old - rollout = -1000) likewise.
    agg = "seq_mean_token_mean" if surrogate == "gspo" else "token_mean"
    args = LossArgs(surrogate=surrogate, is_level="token", is_mode="clip", agg=agg)
    logp = leaf([[0.0, -1.0]])
    loss, _ = policy_loss(args, logp, t([[-1000.0, -1.0]]), t([[-1.0, 1.0]]), torch.tensor([[True, True]]),
                          rollout_logp=t([[0.0, -1.0]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# --- surrogates


def test_ppo_clip_by_hand():
    # Token 0: r = 1.5, A = +1, eps 0.2 -> max(-1.5, -1.2) = -1.2, clipped, gradient 0.
    # Token 1: r = 1.1 inside the band -> -1.1, gradient -r*A/N = -1.1/2 = -0.55. Loss (-1.2 - 1.1)/2 = -1.15.
    logp = leaf([[math.log(1.5), math.log(1.1)]])
    loss, metrics = policy_loss(LossArgs(surrogate="ppo"), logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]),
                                torch.tensor([[True, True]]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.15)
    assert close(logp.grad, [[0.0, -0.55]])
    assert metrics["loss/clip_frac"] == 0.5 and metrics["loss/pg"] == pytest.approx(-1.15)


def test_dual_clip_bounds_negative_advantage_loss():
    # Token 0: r = 10, A = -1: PPO gives max(-10*-1, -1.2*-1) = 10; dual clip c = 3 caps it at -c*A = 3, gradient 0.
    # Token 1: r = 2, A = -1: PPO gives 2 < 3, so the bound leaves it alone: loss 2, gradient -r*A = 2.
    logp, old, adv, mask = (leaf([[math.log(10.0), math.log(2.0)]]), t([[0.0, 0.0]]), t([[-1.0, -1.0]]),
                            torch.tensor([[True, True]]))
    plain, _ = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None)
    bounded, clipped = ppo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    bounded.sum().backward()
    assert close(plain, [[10.0, 2.0]]) and close(bounded, [[3.0, 2.0]])
    assert clipped.tolist() == [[True, False]] and close(logp.grad, [[0.0, 2.0]])


def test_gspo_uses_one_sequence_ratio_and_reaches_every_token():
    # Row 0: logp - old = [0.5, -0.5]; PPO would clip both tokens, but s = exp(mean) = e^0 = 1 is inside the band:
    # loss -1 per token, gradient -s*A/N = -1/4 on both tokens (N = 4 action tokens in the step).
    # Row 1: logp - old = [0.1, -0.3], s = e^-0.1 = 0.904837, A = [1, 3], each token keeps its own: loss -s*A_t,
    # gradient -s*A_t/4 = [-s/4, -3s/4]. Loss = (-1 - 1 - s - 3s) / 4. (Two rows of two tokens: the mean over rows
    # of each row's token mean is the sum over 4.)
    s = math.exp(-0.1)
    logp = leaf([[0.5, -0.5], [0.1, -0.3]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics = policy_loss(LossArgs(surrogate="gspo", agg="seq_mean_token_mean"), logp,
                                t([[0.0, 0.0], [0.0, 0.0]]), t([[1.0, 1.0], [1.0, 3.0]]), mask)
    loss.backward()
    assert loss.item() == pytest.approx((-2.0 - 4.0 * s) / 4.0)
    assert close(logp.grad, [[-0.25, -0.25], [-s / 4.0, -3.0 * s / 4.0]])
    assert metrics["loss/clip_frac"] == 0.0


def test_gspo_token_keeps_its_own_advantage_against_a_clipped_sequence_ratio():
    # GSPO-token: the clip compares s*A_t with clip(s)*A_t per token, so on a clipped row only the tokens whose
    # advantage pushes s further out lose their gradient. N = 4 action tokens, eps 0.2.
    # Row 0: logp - old = [0.3, 0.3], s = e^0.3 = 1.349859 > 1.2, A = [2, -1].
    #   A = 2: max(-2s, -1.2*2) = -2.4, clipped, gradient 0. A = -1: max(s, 1.2) = s, gradient -s*A/4 = s/4.
    # Row 1: logp - old = [-0.3, -0.3], s = e^-0.3 = 0.740818 < 0.8, A = [-1, 2].
    #   A = -1: max(s, 0.8) = 0.8, clipped, gradient 0. A = 2: max(-2s, -1.6) = -2s, gradient -2s/4.
    # Loss (-2.4 + s0 + 0.8 - 2*s1) / 4 = -0.432944. The row-mean advantage (0.5 on both rows) would give
    # [-0.6, -0.6] on row 0 (both clipped, no gradient) and -0.5*s1 on row 1.
    s0, s1 = math.exp(0.3), math.exp(-0.3)
    logp = leaf([[0.3, 0.3], [-0.3, -0.3]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = t([[2.0, -1.0], [-1.0, 2.0]])
    per_token, clipped = gspo(logp, torch.zeros(2, 2, dtype=torch.float64), adv, mask, clip_low=0.2, clip_high=0.2,
                              dual_clip=None)
    assert close(per_token, [[-2.4, s0], [0.8, -2.0 * s1]]) and clipped.tolist() == [[True, False], [True, False]]
    loss, metrics = policy_loss(LossArgs(surrogate="gspo", agg="seq_mean_token_mean"), logp,
                                torch.zeros(2, 2, dtype=torch.float64), adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx((-2.4 + s0 + 0.8 - 2.0 * s1) / 4.0)
    assert close(logp.grad, [[0.0, s0 / 4.0], [0.0, -s1 / 2.0]])
    assert metrics["loss/clip_frac"] == 0.5


def test_gspo_gradient_is_the_papers_sequence_objective_and_other_aggregations_are_refused():
    # GSPO: J = mean_i s_i A_i (inside the clip), s_i = exp(mean_t(logp_it - old_it)),
    # so dJ/dlogp_it = s_i A_i / (G |y_i|).
    # Rows of 1 and 3 tokens, logp = old (s = 1), A = 1, G = 2: the loss gradient is -1/2 on the short row's
    # token and -1/6 on each of the long row's. A token mean would give -1/4 everywhere: the long row 3x the weight.
    logp = leaf([[-1.0, 0.0, 0.0], [-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = policy_loss(LossArgs(surrogate="gspo", agg="seq_mean_token_mean"), logp, logp.detach(),
                          torch.ones(2, 3, dtype=torch.float64), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and close(logp.grad, [[-0.5, 0.0, 0.0], [-1 / 6, -1 / 6, -1 / 6]])
    for agg in ("token_mean", "seq_mean_token_sum", "prompt_mean_token_mean"):
        with pytest.raises(ValueError, match=f"--loss.surrogate gspo with --loss.agg {agg}.*seq_mean_token_mean"):
            LossArgs(surrogate="gspo", agg=agg)


def test_gspo_clips_the_whole_sequence():
    # logp - old = [0.5, 0.5]: s = e^0.5 = 1.65 > 1.2 with A = +1 -> every token -1.2, no gradient.
    logp = leaf([[0.5, 0.5]])
    per_token, clipped = gspo(logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.tensor([[True, True]]),
                              clip_low=0.2, clip_high=0.2, dual_clip=None)
    per_token.sum().backward()
    assert close(per_token, [[-1.2, -1.2]])
    assert clipped.all() and (logp.grad == 0).all()


def test_cispo_weight_has_no_floor_and_gradient_flows_only_through_logp():
    # MiniMax-M1's CISPO caps the weight at 1+eps_high and has no floor. r = [2, 0.5], eps_high 0.5 -> w = [1.5, 0.5]
    # (only the 2 is clipped; a floor of 1-0.2 would have raised 0.5 to 0.8). A = [1, -2], N = 2:
    # loss = -(1.5*1*ln0.5 + 0.5*(-2)*ln0.25)/2 = -(-1.5ln2 + 2ln2)/2 = -0.25ln2; d/dlogp = -w*A/N = [-0.75, 0.5].
    logp = leaf([[math.log(0.5), math.log(0.25)]])
    old = leaf([[math.log(0.25), math.log(0.5)]])
    loss, metrics = policy_loss(LossArgs(surrogate="cispo", clip_high=0.5), logp, old, t([[1.0, -2.0]]),
                                torch.tensor([[True, True]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.25 * LN2)
    assert close(logp.grad, [[-0.75, 0.5]])
    assert old.grad is None or (old.grad == 0).all()
    assert metrics["loss/clip_frac"] == 0.5
    direct, _ = cispo(logp.detach(), old.detach(), t([[1.0, -2.0]]), torch.tensor([[True, True]]), clip_high=0.5)
    assert close(direct, [[1.5 * LN2, -2.0 * LN2]])  # -w*A*logp: -1.5*1*(-ln2), -0.5*(-2)*(-2ln2)
    with pytest.raises(ValueError, match="--loss.clip_low 0.1 with --loss.surrogate cispo"):
        LossArgs(surrogate="cispo", clip_low=0.1)


# --- importance correction


def weights(w_rows, level, mode, band, mask=None):
    """importance_weights for per-token ratios old/rollout = w (rollout log-prob 0, old log-prob ln w)."""
    old = torch.log(t(w_rows))
    mask = torch.ones(old.shape, dtype=torch.bool) if mask is None else mask
    return importance_weights(old, torch.zeros_like(old), mask, level=level, mode=mode, band=band)


def test_tis_caps_high_weights_and_leaves_low_ones_alone():
    # token + trunc, HIGH 2: min(w, 2) on [0.25, 1.5, 4] -> [0.25, 1.5, 2]; only the 4 was changed.
    w, cut = weights([[0.25, 1.5, 4.0]], "token", "trunc", (0.5, 2.0))
    assert close(w, [[0.25, 1.5, 2.0]]) and cut.tolist() == [[False, False, True]]


def test_icepop_zeroes_weights_outside_the_band():
    # token + mask, band [0.5, 2]: 0.25 and 4 are outside -> 0, 1.5 stays.
    w, cut = weights([[0.25, 1.5, 4.0]], "token", "mask", (0.5, 2.0))
    assert close(w, [[0.0, 1.5, 0.0]]) and cut.tolist() == [[True, False, True]]


def test_clip_mode_clamps_weights_into_the_band():
    w, cut = weights([[0.25, 1.5, 4.0]], "token", "clip", (0.5, 2.0))
    assert close(w, [[0.5, 1.5, 2.0]]) and cut.tolist() == [[True, False, True]]


def test_seq_weight_is_the_product_over_the_action_tokens():
    # Row 0: 2 * 3 = 6 > HIGH 5 -> trunc gives 5 on every token, mask gives 0.
    # Row 1: 2 * 0.5 * (padding 100 ignored) = 1.
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rows = [[2.0, 3.0, 1.0], [2.0, 0.5, 100.0]]
    w, cut = weights(rows, "seq", "trunc", (0.5, 5.0), mask)
    assert w[mask].tolist() == pytest.approx([5.0, 5.0, 5.0, 1.0, 1.0]) and cut.tolist() == [[True] * 3, [False] * 3]
    w, _ = weights(rows, "seq", "mask", (0.5, 5.0), mask)
    assert w[mask].tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0, 1.0])


def test_geo_weight_is_the_sequence_geometric_mean_on_every_token():
    # Row 0: geometric mean sqrt(2*8) = 4 inside [0.5, 5] -> every token gets 4. Row 1: sqrt(0.1*0.2) = 0.141 < 0.5
    # -> mask zeroes the whole row. With trunc and HIGH 3: row 0 gets min(4, 3) = 3, row 1 keeps 0.141.
    w, cut = weights([[2.0, 8.0], [0.1, 0.2]], "geo", "mask", (0.5, 5.0))
    assert close(w, [[4.0, 4.0], [0.0, 0.0]]) and cut.tolist() == [[False, False], [True, True]]
    w, cut = weights([[2.0, 8.0], [0.1, 0.2]], "geo", "trunc", (0.5, 3.0))
    assert close(w, [[3.0, 3.0], [0.02**0.5, 0.02**0.5]]) and cut.tolist() == [[True, True], [False, False]]


def test_geo_bounds_every_token_weight_when_one_token_is_an_outlier():
    # issue 35's row: log w = +15 on one token, -0.15 on the other 99. Its log geometric mean is
    # (15 - 99*0.15)/100 = 0.15/100 = 0.0015, inside [ln 0.5, ln 5], so every token gets e^0.0015 = 1.0015011;
    # the outlier no longer gets e^15 = 3.3e6. On-policy PPO (r = 1), A = 1, token mean over 100 tokens: each
    # token's gradient is -w/100, so the outlier carries 1/100 of the row's gradient, not 99.997%.
    log_w = t([[15.0] + [-0.15] * 99])
    mask = torch.ones(1, 100, dtype=torch.bool)
    w, cut = importance_weights(log_w, torch.zeros_like(log_w), mask, level="geo", mode="mask", band=(0.5, 5.0))
    assert torch.allclose(w, torch.full((1, 100), math.exp(0.0015), dtype=w.dtype)) and not cut.any()
    logp = leaf([[-1.0] * 100])
    loss, metrics = policy_loss(LossArgs(is_level="geo", is_mode="mask"), logp, logp.detach(),
                                torch.ones(1, 100, dtype=torch.float64), mask, rollout_logp=-1.0 - log_w)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 100), -math.exp(0.0015) / 100, dtype=torch.float64))
    assert metrics["loss/is_weight_mean"] == pytest.approx(math.exp(0.0015))


def test_importance_weight_multiplies_the_loss_as_a_constant():
    # old = logp (r = 1), A = 1, old/rollout = 4 -> TIS with HIGH 2 gives w = 2: loss -2, d/dlogp = -w*r*A = -2.
    # The token is one version stale, which the version guard allows only because is_level is not off.
    logp = leaf([[-1.0]])
    args = LossArgs(is_level="token", is_mode="trunc", is_band=(0.5, 2.0))
    loss, metrics = policy_loss(args, logp, t([[-1.0]]), t([[1.0]]), torch.tensor([[True]]),
                                rollout_logp=t([[-1.0 - math.log(4.0)]]), versions=torch.tensor([[4]]),
                                current_version=5)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and logp.grad.item() == pytest.approx(-2.0)
    assert metrics["loss/is_weight_mean"] == pytest.approx(2.0) and metrics["loss/is_masked_frac"] == 1.0


def test_off_level_weight_is_one():
    w, cut = weights([[0.25, 4.0]], "off", "trunc", (0.5, 2.0))
    assert w.tolist() == [[1.0, 1.0]] and not cut.any()


# --- policy versions


def test_stale_mask_drops_tokens_beyond_max_lag():
    # current 5: lags are 0, 1, 2 on the action tokens; max_lag 1 keeps the first two, 0 only the first.
    versions, mask = torch.tensor([[5, 4, 3, -1]]), torch.tensor([[True, True, True, False]])
    assert stale_mask(versions, mask, current_version=5, max_lag=1).tolist() == [[True, True, False, False]]
    assert stale_mask(versions, mask, current_version=5, max_lag=0).tolist() == [[True, False, False, False]]
    assert stale_mask(versions, mask, current_version=5, max_lag=None).tolist() == mask.tolist()


def test_check_versions_refuses_mixed_versions_without_importance_correction():
    mask = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="is_level"):
        check_versions(torch.tensor([[5, 4, -1]]), mask, current_version=5, is_level="off")
    with pytest.raises(ValueError, match="is_level"):  # uniformly stale is not on-policy either
        check_versions(torch.tensor([[4, 4, -1]]), mask, current_version=5, is_level="off")
    check_versions(torch.tensor([[5, 4, -1]]), mask, current_version=5, is_level="token")
    check_versions(torch.tensor([[5, 5, -1]]), mask, current_version=5, is_level="off")
    with pytest.raises(ValueError, match="versions"):
        check_versions(torch.tensor([[5, -1, -1]]), mask, current_version=5, is_level="token")
    with pytest.raises(ValueError, match="newer"):
        check_versions(torch.tensor([[6, 5, -1]]), mask, current_version=5, is_level="token")


def test_max_token_lag_zero_trains_only_current_tokens_without_correction():
    # versions [5, 4], current 5, lag 0: the stale token is dropped, so is_level off is allowed. Token 0: r = 1, A = 1
    # -> -1, entropy bonus 0.1 * 1, KL to the rollout 0. The dropped token still counts in num_tokens = 2 but brings
    # neither its loss, nor its entropy 5, nor its k2 = (-2 - -3)^2 / 2: loss = (-1 - 0.1) / 2 = -0.55, grad 0 on it.
    logp = leaf([[-1.0, -2.0]])
    args = LossArgs(max_token_lag=0, entropy_coef=0.1, kl_coef=0.5, kl_estimator="k2")
    loss, metrics = policy_loss(args, logp, t([[-1.0, -2.0]]), t([[1.0, 1.0]]), torch.tensor([[True, True]]),
                                rollout_logp=t([[-1.0, -3.0]]), versions=torch.tensor([[5, 4]]), current_version=5,
                                entropy=t([[1.0, 5.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.55) and close(logp.grad, [[-0.5, 0.0]])
    assert metrics["loss/stale_frac"] == 0.5 and metrics["loss/entropy"] == 1.0 and metrics["loss/kl"] == 0.0
    with pytest.raises(ValueError, match="stale/mixed"):
        policy_loss(LossArgs(max_token_lag=1), logp, t([[-1.0, -2.0]]), t([[1.0, 1.0]]), torch.tensor([[True, True]]),
                    versions=torch.tensor([[5, 4]]), current_version=5)


# --- KL and entropy


def test_kl_estimators_by_hand():
    # logp = ln0.5, ref = ln0.25, so logp - ref = ln2: k1 = ln2, k2 = ln2^2/2, k3 = e^-ln2 + ln2 - 1 = ln2 - 0.5.
    logp, ref, mask = t([[math.log(0.5), 0.0]]), t([[math.log(0.25), -math.inf]]), torch.tensor([[True, False]])
    assert close(kl_penalty(logp, ref, mask, estimator="k1"), [[LN2, 0.0]])
    assert close(kl_penalty(logp, ref, mask, estimator="k2"), [[LN2**2 / 2, 0.0]])
    assert close(kl_penalty(logp, ref, mask, estimator="k3"), [[LN2 - 0.5, 0.0]])


def test_k3_is_capped_at_10_with_no_gradient_past_the_cap():
    # d = ref - logp, k3 = e^d - d - 1, d/dlogp = -(e^d - 1). verl and OpenRLHF cap k3 at 10.
    # d = 1: e - 2 = 0.718282 < 10, kept, gradient -(e - 1) = -1.718282.
    # d = 3.5: e^3.5 - 4.5 = 28.615452 > 10 -> 10, gradient 0 (uncapped it would be -(e^3.5 - 1) = -32.115452).
    # d = 25: e^20 - 21 = 4.85e8 after the +-20 clamp -> 10, gradient 0. d = -25: e^-20 + 19 = 19 -> 10, gradient 0.
    # d = 1000: e^1000 is inf even in float64; the +-20 clamp keeps the capped value 10 and its gradient 0, not NaN.
    logp = leaf([[0.0, 0.0, 0.0, 0.0, 0.0]])
    k3 = kl_penalty(logp, t([[1.0, 3.5, 25.0, -25.0, 1000.0]]), torch.ones(1, 5, dtype=torch.bool), estimator="k3")
    k3.sum().backward()
    assert close(k3, [[math.e - 2.0, 10.0, 10.0, 10.0, 10.0]])
    assert close(logp.grad, [[1.0 - math.e, 0.0, 0.0, 0.0, 0.0]])


def test_k1_and_k2_stay_exact_past_the_log_clamp():
    # verl's convention: only k3 is capped. At d = ref - logp = +-25: k1 = -d = -+25, k2 = 25^2 / 2 = 312.5 with
    # gradient d/dlogp = -d = -+25 (OpenRLHF would cap k1 at -+10 and k2 at 10; a +-20 clamp on d gives 20 and 200).
    logp, ref, mask = leaf([[0.0, 0.0]]), t([[25.0, -25.0]]), torch.ones(1, 2, dtype=torch.bool)
    assert close(kl_penalty(logp, ref, mask, estimator="k1"), [[-25.0, 25.0]])
    k2 = kl_penalty(logp, ref, mask, estimator="k2")
    k2.sum().backward()
    assert close(k2, [[312.5, 312.5]]) and close(logp.grad, [[-25.0, 25.0]])


def test_k1_is_refused_as_a_loss_and_kept_as_a_metric():
    with pytest.raises(ValueError, match="--loss.kl_estimator k1"):
        LossArgs(kl_estimator="k1", kl_coef=0.1)
    # kl_coef 0: k1 against the rollout is logged, logp - rollout = ln2; the loss is the PPO term alone (A = 0 -> 0).
    loss, metrics = policy_loss(LossArgs(kl_estimator="k1"), leaf([[math.log(0.5)]]), t([[math.log(0.5)]]),
                                t([[0.0]]), torch.tensor([[True]]), rollout_logp=t([[math.log(0.25)]]),
                                versions=torch.tensor([[0]]), current_version=0)
    assert metrics["loss/kl"] == pytest.approx(LN2) and loss.item() == 0.0


def test_kl_to_rollout_enters_loss_with_its_coefficient():
    # A = 0, so the loss is the KL term: 0.5 * k2 = 0.5 * ln2^2 / 2; d/dlogp = 0.5 * (logp - ref) = 0.5 ln2.
    logp = leaf([[math.log(0.5)]])
    loss, metrics = policy_loss(LossArgs(kl_coef=0.5, kl_estimator="k2", kl_ref="rollout"), logp, t([[math.log(0.5)]]),
                                t([[0.0]]), torch.tensor([[True]]), rollout_logp=t([[math.log(0.25)]]))
    loss.backward()
    assert loss.item() == pytest.approx(0.25 * LN2**2) and logp.grad.item() == pytest.approx(0.5 * LN2)
    assert metrics["loss/kl"] == pytest.approx(LN2**2 / 2)


def test_kl_to_reference_model_uses_ref_logp_and_requires_it():
    # rollout = logp (a rollout reference would give 0); ref model ln0.25: k3 = ln2 - 0.5, coef 1, A = 0.
    args = LossArgs(kl_coef=1.0, kl_estimator="k3", kl_ref="model")
    inputs = (leaf([[math.log(0.5)]]), t([[math.log(0.5)]]), t([[0.0]]), torch.tensor([[True]]))
    loss, _ = policy_loss(args, *inputs, ref_logp=t([[math.log(0.25)]]))
    assert loss.item() == pytest.approx(LN2 - 0.5)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(args, *inputs)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(LossArgs(), *inputs, ref_logp=t([[math.log(0.25)]]))


def test_entropy_bonus_lowers_the_loss():
    # A = 0, entropy 2, coef 0.1, one token: loss = -0.1 * 2 = -0.2.
    inputs = (leaf([[-1.0]]), t([[-1.0]]), t([[0.0]]), torch.tensor([[True]]))
    loss, metrics = policy_loss(LossArgs(entropy_coef=0.1), *inputs, entropy=t([[2.0]]))
    assert loss.item() == pytest.approx(-0.2) and metrics["loss/entropy"] == 2.0
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(LossArgs(entropy_coef=0.1), *inputs)


# --- aggregation


# Rows [1, 2], [3], [4, 5, 6]; rows 0-1 are prompt 0 (3 tokens), row 2 is prompt 1 (3 tokens).
AGG_MASK = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
AGG_VALUES = t([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0], [4.0, 5.0, 6.0]])
AGG_DENOMS = Denoms(num_tokens=6.0, num_seqs=3.0, num_prompts=2.0)
AGG_GROUP_TOKENS = t([3.0, 3.0, 3.0])


@pytest.mark.parametrize("agg, expected", [
    ("token_mean", 21.0 / 6.0),  # (1+2+3+4+5+6) / 6
    ("seq_mean_token_mean", (1.5 + 3.0 + 5.0) / 3.0),  # row means 3/2, 3/1, 15/3 over 3 rows
    ("seq_mean_token_sum", (3.0 + 3.0 + 15.0) / 3.0),  # row sums over 3 rows
    ("prompt_mean_token_mean", ((3.0 + 3.0) / 3.0 + 15.0 / 3.0) / 2.0),  # prompt token means 2 and 5 over 2 prompts
])
def test_aggregations_by_hand(agg, expected):
    assert float(aggregate(AGG_VALUES, AGG_MASK, agg=agg, denoms=AGG_DENOMS,
                           group_tokens=AGG_GROUP_TOKENS)) == pytest.approx(expected)


def test_step_denoms_count_live_rows_and_prompts_by_hand():
    """AGG_MASK's rows with a fourth, action-less row of prompt 2: it adds no token, no row and no prompt. Group
    tokens by group index: prompt 0 has 2 + 1 tokens, prompt 1 has 3, prompt 2 none."""
    mask = torch.cat([AGG_MASK, torch.zeros(1, 3, dtype=torch.bool)])
    denoms, group_tokens = step_denoms(mask, torch.tensor([0, 0, 1, 2]))
    assert denoms == AGG_DENOMS and group_tokens.tolist() == [3.0, 3.0, 0.0]


def assert_two_microbatches_equal_one_batch(agg):
    # The same step as one batch and as microbatches [row 0] + [rows 1, 2], each with the step's global denominators:
    # the losses must sum, and the gradients concatenate, to the one-batch values. Ratios e^+-0.3 exercise the clip.
    args = LossArgs(agg=agg, kl_coef=0.1, entropy_coef=0.01)
    logp = t([[-0.5, -1.0, 0.0], [-0.2, 0.0, 0.0], [-1.0, -0.1, -0.7]])
    old = logp - t([[0.3, -0.3, 0.0], [0.1, 0.0, 0.0], [0.0, 0.05, -0.2]])
    adv, entropy = (t([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.5, 0.5, 0.5]]),
                    t([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    rollout = old - 0.01

    def run(rows):
        x = logp[rows].clone().requires_grad_()
        loss, _ = policy_loss(args, x, old[rows], adv[rows], AGG_MASK[rows], rollout_logp=rollout[rows],
                              entropy=entropy[rows], denoms=AGG_DENOMS, group_tokens=AGG_GROUP_TOKENS[rows])
        loss.backward()
        return loss.detach(), x.grad

    full_loss, full_grad = run(slice(0, 3))
    (loss_a, grad_a), (loss_b, grad_b) = run(slice(0, 1)), run(slice(1, 3))
    assert (loss_a + loss_b).item() == pytest.approx(full_loss.item())
    assert torch.allclose(torch.cat([grad_a, grad_b]), full_grad)


def test_accumulated_token_mean_over_two_microbatches_equals_one_batch():
    assert_two_microbatches_equal_one_batch("token_mean")


def test_accumulated_seq_mean_token_mean_over_two_microbatches_equals_one_batch():
    assert_two_microbatches_equal_one_batch("seq_mean_token_mean")


def test_accumulated_seq_mean_token_sum_over_two_microbatches_equals_one_batch():
    assert_two_microbatches_equal_one_batch("seq_mean_token_sum")


def test_accumulated_prompt_mean_token_mean_over_two_microbatches_equals_one_batch():
    assert_two_microbatches_equal_one_batch("prompt_mean_token_mean")


# --- value, SFT, mismatch


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error():
    # Token 0: v 1.5, old 1, R 2: unclipped (1.5-2)^2 = 0.25, clipped 1.2 -> 0.64; max 0.64, half 0.32, clipped, grad 0.
    # Token 1: v 1.1 inside the clip: (1.1-2)^2 = 0.81, half 0.405, grad (v-R)/N = -0.9/2 = -0.45. Loss (0.32+0.405)/2.
    values = leaf([[1.5, 1.1]])
    loss, metrics = compute_value_loss(LossArgs(value_clip=0.2), values, t([[1.0, 1.0]]), t([[2.0, 2.0]]),
                                       torch.tensor([[True, True]]), denoms=one_row(2))
    loss.backward()
    assert loss.item() == pytest.approx(0.3625) and close(values.grad, [[0.0, -0.45]])
    assert metrics["loss/value"] == pytest.approx(0.3625) and metrics["loss/value_clip_frac"] == 0.5
    # No clip: (0.25 + 0.81) / 2 / 2 = 0.265.
    plain, _ = value_loss(values, t([[1.0, 1.0]]), t([[2.0, 2.0]]), torch.tensor([[True, True]]), clip=None,
                          denoms=one_row(2))
    assert plain.item() == pytest.approx(0.265)


def test_value_clip_frac_counts_only_tokens_the_clamp_moved():
    # clip 0.2, float64, N = 3.
    # Token 0 in the band: v - old = 0.3 - 0.1 = 0.19999999999999998 < 0.2, so the clamp leaves it and both errors are
    # v - R = -0.4; (0.1 - 0.7) + 0.19999999999999998 rounds to -0.4000000000000001, a tie that is not a clip.
    # Token 1: v 1.5, old 1, R 2: clamp to 1.2 -> (1.2 - 2)^2 = 0.64 > (1.5 - 2)^2 = 0.25, clipped.
    # Token 2: v 1.5, old 1, R 0: clamp to 1.2 -> 1.44 < 2.25, the unclipped error wins, not clipped.
    # clip_frac 1/3; loss (0.16 + 0.64 + 2.25) / 2 / 3 = 0.508333.
    loss, metrics = value_loss(t([[0.3, 1.5, 1.5]]), t([[0.1, 1.0, 1.0]]), t([[0.7, 2.0, 0.0]]),
                               torch.ones(1, 3, dtype=torch.bool), clip=0.2, denoms=one_row(3))
    assert metrics["loss/value_clip_frac"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(3.05 / 6.0)


def test_sft_loss_is_token_nll_over_global_tokens():
    # -ln0.5 - ln0.25 = 3ln2 over the step's 4 tokens (this microbatch holds 2): loss 3ln2/4, local mean nll 1.5ln2.
    logp = leaf([[math.log(0.5), math.log(0.25), -math.inf]])
    loss, metrics = sft_loss(logp, torch.tensor([[True, True, False]]),
                             denoms=Denoms(num_tokens=4.0, num_seqs=2.0, num_prompts=1.0))
    loss.backward()
    assert loss.item() == pytest.approx(0.75 * LN2) and metrics["loss/sft_nll"] == pytest.approx(1.5 * LN2)
    assert logp.grad.tolist() == [[-0.25, -0.25, 0.0]]


def test_mismatch_metrics_by_hand():
    # Delta = trainer - rollout = [1e-7, 1e-5, -0.5] (4th token masked). vllm_kl = mean(-Delta); k3 = e^D - 1 - D;
    # abs mean = (1e-7 + 1e-5 + 0.5)/3; max 0.5; frac counts |Delta| > 1e-6: 1e-5 and 0.5, not 1e-7 -> 2/3.
    rollout = t([[-1.0, -2.0, -0.5, -0.3]])
    deltas = [1e-7, 1e-5, -0.5]
    trainer = rollout + t([deltas + [5.0]])
    m = mismatch_metrics(rollout, trainer, torch.tensor([[True, True, True, False]]))
    assert m["loss/vllm_kl"] == pytest.approx(-sum(deltas) / 3)
    assert m["loss/mismatch_k3"] == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas) / 3)
    assert m["loss/mismatch_abs"] == pytest.approx((1e-7 + 1e-5 + 0.5) / 3)
    assert m["loss/mismatch_max_abs"] == pytest.approx(0.5) and m["loss/mismatch_frac"] == pytest.approx(2 / 3)


def test_policy_loss_measures_mismatch_only_on_current_version_tokens():
    # rollout - old = [0.5, 1.0], but the second token is one version stale: its gap is policy lag, not mismatch.
    _, metrics = policy_loss(LossArgs(is_level="token"), leaf([[-1.0, -1.0]]), t([[-1.0, -1.0]]), t([[1.0, 1.0]]),
                             torch.tensor([[True, True]]), rollout_logp=t([[-0.5, 0.0]]),
                             versions=torch.tensor([[3, 2]]), current_version=3)
    assert metrics["loss/mismatch_abs"] == pytest.approx(0.5) and metrics["loss/vllm_kl"] == pytest.approx(0.5)



def test_policy_loss_reports_no_mismatch_when_no_token_has_the_current_version():
    # Both tokens are one version stale: their gap to the trainer is policy lag, so no mismatch can be measured.
    _, metrics = policy_loss(LossArgs(is_level="token"), leaf([[-1.0, -1.0]]), t([[-1.0, -1.0]]), t([[1.0, 1.0]]),
                             torch.tensor([[True, True]]), rollout_logp=t([[-0.5, 0.0]]),
                             versions=torch.tensor([[2, 2]]), current_version=3)
    assert not any(k.startswith("loss/mismatch") or k == "loss/vllm_kl" for k in metrics)

@pytest.mark.parametrize("surrogate, clip_frac", [("ppo", 1 / 7), ("gspo", 0.0), ("cispo", 1 / 7)])
def test_metrics_merged_over_microbatches_equal_the_whole_batch(surrogate, clip_frac):
    # Partial rollouts with --loss.max_token_lag 1 at version 5: each metric averages over its own tokens, so
    # merging microbatches by action tokens gets them wrong; merge_metrics weights each record by its own count.
    # Rows (action tokens, versions): 0: 4 at v5; 1: 2 at v3 (stale); 2: 3 at v4, v5, v5; 3: 1 at v3 (stale).
    # stale_frac = 3/10. Kept: 7 tokens. logp - old = 0.5 on row 0 token 0 (r = 1.65, A = 1: clipped by ppo's
    # and cispo's 1.2) and -0.5 on row 2 token 2 (r = 0.61: ppo keeps the unclipped -r*A, cispo has no floor);
    # gspo's row ratios e^(0.5/4) = 1.13 and e^(-0.5/3) = 0.85 are inside [0.8, 1.2]: nothing clipped.
    # old - rollout: -0.5 on row 0 token 1 (w = 0.61), +1 on row 2 token 0 (w = e > 2: IcePop cuts it):
    # is_masked_frac 1/7, is_weight_mean (5 + e^-0.5)/7 (the cut token weighs 0).
    # Mismatch over the 6 tokens of version 5, delta = old - rollout = -0.5 on one: vllm_kl = abs = 0.5/6,
    # k3 = (e^-0.5 - 1 + 0.5)/6, max_abs 0.5, frac 1/6. Weighting by action tokens would give frac
    # (4 x 1/4 + 4 x 0)/8 = 1/8 from microbatches [0] and [2, 3].
    from trainer import merge_metrics
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    versions = torch.tensor([[5, 5, 5, 5], [3, 3, -1, -1], [4, 5, 5, -1], [3, -1, -1, -1]])
    old = torch.full((4, 4), -1.0, dtype=torch.float64)
    logp = old.clone()
    logp[0, 0], logp[2, 2] = -0.5, -1.5
    rollout = old.clone()
    rollout[0, 1], rollout[2, 0] = -0.5, -2.0
    entropy = t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.0, 0.0], [0.7, 0.8, 0.9, 0.0], [1.0, 0.0, 0.0, 0.0]])
    agg = "seq_mean_token_mean" if surrogate == "gspo" else "token_mean"
    args = LossArgs(surrogate=surrogate, agg=agg, max_token_lag=1, is_level="token", is_mode="mask",
                    is_band=(0.5, 2.0))
    denoms = Denoms(num_tokens=10.0, num_seqs=4.0, num_prompts=1.0)

    def records(rows):
        return compute_policy_loss(args, logp[rows], old[rows], rollout[rows], torch.ones(len(rows), 4), mask[rows],
                                   versions=versions[rows], current_version=5, denoms=denoms,
                                   entropy=entropy[rows])[1]

    whole = merge_metrics(records([0, 1, 2, 3]))
    merged = merge_metrics(records([0]) + records([1]) + records([2, 3]))  # 4, 0 and 3 kept tokens
    keys = {"loss/pg", "loss/clip_frac", "loss/is_weight_mean", "loss/is_masked_frac", "loss/stale_frac", "loss/kl",
            "loss/entropy", "loss/vllm_kl", "loss/mismatch_k3", "loss/mismatch_abs", "loss/mismatch_max_abs",
            "loss/mismatch_frac"}
    assert set(whole) == set(merged) == keys and merged == pytest.approx(whole)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert merged == pytest.approx({**merged, "loss/stale_frac": 0.3, "loss/clip_frac": clip_frac,
                                    "loss/is_masked_frac": 1 / 7, "loss/is_weight_mean": (5 + math.exp(-0.5)) / 7,
                                    "loss/entropy": (1.0 + 0.7 + 0.8 + 0.9) / 7, "loss/vllm_kl": 0.5 / 6,
                                    "loss/mismatch_abs": 0.5 / 6, "loss/mismatch_k3": k3 / 6,
                                    "loss/mismatch_max_abs": 0.5, "loss/mismatch_frac": 1 / 6})
    # A batch of only stale rows: every kept-token mean is over nothing, 0 on the whole batch and merged alike.
    assert merge_metrics(records([1]) + records([3])) == merge_metrics(records([1, 3])) == {
        k: 0.0 for k in ("loss/pg", "loss/clip_frac", "loss/is_weight_mean", "loss/is_masked_frac", "loss/kl",
                         "loss/entropy")} | {"loss/stale_frac": 1.0}


# --- flags and shapes


@pytest.mark.parametrize("flags, flag", [
    (dict(surrogate="trpo"), "--loss.surrogate"),
    (dict(agg="sum"), "--loss.agg"),
    (dict(clip_low=1.5), "--loss.clip_low"),
    (dict(clip_high=-0.1), "--loss.clip_high"),
    (dict(dual_clip=0.9), "--loss.dual_clip"),
    (dict(is_band=(1.5, 5.0)), "--loss.is_band"),
    (dict(is_band=(0.5, 0.9)), "--loss.is_band"),
    (dict(is_band=(0.0, 2.0)), "--loss.is_band"),
    (dict(max_token_lag=-1), "--loss.max_token_lag"),
    (dict(kl_coef=-0.1), "--loss.kl_coef"),
    (dict(value_clip=0.0), "--loss.value_clip"),
    (dict(surrogate="cispo", dual_clip=3.0), "--loss.dual_clip with --loss.surrogate cispo"),
    (dict(surrogate="gspo"), "--loss.surrogate gspo with --loss.agg token_mean"),
    (dict(surrogate="cispo", clip_low=1.0), "--loss.clip_low 1.0 with --loss.surrogate cispo"),
    (dict(is_level="seq", is_mode="clip"), "--loss.is_level seq with --loss.is_mode clip"),
    (dict(top_entropy_frac=0.0), "--loss.top_entropy_frac"),
    (dict(top_entropy_frac=1.5), "--loss.top_entropy_frac"),
])
def test_loss_args_errors_name_the_flag(flags, flag):
    with pytest.raises(ValueError, match=flag):
        LossArgs(**flags)


def test_flag_owner_predicates_answer_for_the_other_files():
    # The trainer builds a reference model iff kl_ref is model (its KL is logged even at kl_coef 0).
    assert not LossArgs().needs_ref_model and LossArgs(kl_ref="model").needs_ref_model
    # The rollout's log-probs are a KL reference in the loss only with kl_coef > 0 and kl_ref rollout.
    assert [LossArgs(kl_coef=c, kl_ref=r).kl_to_rollout for c, r in
            ((0.0, "rollout"), (0.1, "rollout"), (0.1, "model"))] == [False, True, False]
    # Every is_level but off reweights by old/rollout.
    assert [LossArgs(is_level=lv, is_mode="mask").importance_correction for lv in
            ("off", "token", "seq", "geo")] == [False, True, True, True]
    # A bonus of either sign needs the entropy's gradient; 0 only logs it.
    assert [LossArgs(entropy_coef=c).needs_entropy_grad for c in (0.0, 0.01, -0.01)] == [False, True, True]
    # The trainer runs step_tokens once per optimizer step only for a loss that picks tokens over the whole step.
    assert [LossArgs(top_entropy_frac=f).needs_batch_stats for f in (None, 0.2, 1.0)] == [False, True, True]


# --- batch-wide token choice (step_tokens), then its use in the loss

def test_top_entropy_frac_picks_the_highest_entropy_tokens_of_the_whole_step():
    # Two rows; row 0's last token is not an action (its entropy 9.0 must never be picked), so N = 5 action tokens
    # with entropies 0.1 0.9 | 0.7 0.2 0.5. frac 0.4: ceil(0.4 * 5) = 2 tokens, the two highest: 0.9 and 0.7 (a
    # per-row choice would take ceil(0.4 * 2) = 1 of row 0 and ceil(0.4 * 3) = 2 of row 1: 0.9, 0.7 and 0.5).
    # frac 0.6: ceil(3.0) = 3 tokens, 0.9, 0.7 and 0.5. frac 1.0: every action token.
    mask = torch.tensor([[True, True, False], [True, True, True]])
    entropy = t([[0.1, 0.9, 9.0], [0.7, 0.2, 0.5]])
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    pick = lambda frac: step_tokens(LossArgs(top_entropy_frac=frac), zeros, entropy, zeros, mask, step=0).tolist()
    assert pick(0.4) == [[False, True, False], [True, False, False]]
    assert pick(0.6) == [[False, True, False], [True, False, True]]
    assert pick(1.0) == mask.tolist()


def test_selected_tokens_alone_train_while_every_action_token_stays_in_the_denominator():
    # On policy, ppo's per-token loss is -A. A = (4, 2, 1, 3) on one row, token_mean over all N = 4 action tokens;
    # the step chose tokens 1 and 3: loss = -(2 + 3) / 4 = -1.25, the gradient reaches those two alone, and
    # loss/selected_frac = 2 / 4. Without the choice the same loss is -(4 + 2 + 1 + 3) / 4 = -2.5.
    logp, adv, mask = leaf([[-1.0, -1.0, -1.0, -1.0]]), t([[4.0, 2.0, 1.0, 3.0]]), torch.ones(1, 4, dtype=torch.bool)
    selected = torch.tensor([[False, True, False, True]])
    loss, metrics = policy_loss(LossArgs(top_entropy_frac=0.5), logp, logp.detach(), adv, mask, selected=selected)
    loss.backward()
    assert close(loss, -1.25) and metrics["loss/selected_frac"] == 0.5
    assert close(logp.grad, [[0.0, -0.5, 0.0, -0.75]])  # d(-A_t * ratio_t / 4) / d logp_t = -A_t / 4 at ratio 1
    assert close(policy_loss(LossArgs(), logp, logp.detach(), adv, mask)[0], -2.5)
    with pytest.raises(ValueError, match="selected: missing.*--loss.top_entropy_frac"):
        policy_loss(LossArgs(top_entropy_frac=0.5), logp, logp.detach(), adv, mask)
    with pytest.raises(ValueError, match="selected: given"):
        policy_loss(LossArgs(), logp, logp.detach(), adv, mask, selected=selected)


@pytest.mark.parametrize("flags, expected", [
    (dict(), -1.5),
    (dict(surrogate="cispo", is_level="token", is_mode="trunc", clip_high=5.0), 2 * LN2),
    (dict(surrogate="gspo", agg="seq_mean_token_mean"), -1.5),
    (dict(is_level="seq", is_mode="mask"), -1.5),
    *[(dict(is_level="geo", is_mode=mode), -1.5) for mode in IS_MODES],  # geo's weight is one number per row
])
def test_allowed_combinations_construct_and_give_the_on_policy_loss(flags, expected):
    # On policy (logp = old = rollout) every ratio and IS weight is 1, in every level and mode. One row, A = (2, 1):
    # ppo and gspo lose -A = (-2, -1), token mean and row mean both -1.5; cispo loses -1 * A * logp with
    # logp = (ln 1/2, ln 1/4) = (-ln2, -2 ln2), so (2 ln2, 2 ln2), mean 2 ln2.
    logp = leaf([[-LN2, -2 * LN2]])
    loss, _ = policy_loss(LossArgs(**flags), logp, logp.detach(), t([[2.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert close(loss, expected)


def test_bad_shapes_raise_naming_the_argument():
    mask, x = torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(LossArgs(), x, torch.zeros(2, 2), x, mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(LossArgs(), x, x, x, mask.float())
    with pytest.raises(ValueError, match="group_tokens"):
        aggregate(x, mask, agg="prompt_mean_token_mean", denoms=Denoms(6.0, 2.0, 1.0), group_tokens=torch.ones(3))
    with pytest.raises(ValueError, match="returns"):
        value_loss(x, x, torch.zeros(3), mask, clip=0.2, denoms=Denoms(6.0, 2.0, 1.0))
    with pytest.raises(ValueError, match="trainer_logp"):
        mismatch_metrics(x, torch.zeros(1, 3), mask)
