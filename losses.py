"""Losses: policy surrogates, importance correction, staleness, KL, entropy, aggregation, value, SFT.

Per-token inputs are (B rows, T tokens); mask is True on action tokens. logp: the trainer's log-prob (gradient
flows); old_logp: its recompute before this step (proximal policy); rollout_logp: the engine's (behaviour policy);
versions: the policy version that sampled each token. compute_policy_loss(args, ...) -> (loss (), records [(count,
metrics)]) is the one reader of the policy flags; other files ask LossArgs' properties. Losses divide by the step's
global Denoms and metrics are means over each record's count, so sums and count-weighted means over microbatches and
ranks give the full-batch values (each rank holds the whole batch). Masked positions pass torch.where before any exp
(-inf or NaN there give zero gradient). Not here: log-probs and entropy (trainer.py), advantages (estimators.py).

Research surface (README, "Adding an estimator, a reward shaping or a loss-side method"): a new surrogate is one
function (logp, old_logp, adv, mask) -> (per-token loss, clipped), one SURROGATES entry and one `elif` in
compute_policy_loss; an importance correction is one IS_LEVELS / IS_MODES branch; a method that picks tokens over an
optimizer step's whole batch (by entropy, advantage or their covariance with the log-probs) is one branch of
step_tokens, switched on by needs_batch_stats. None edits trainer.py. Reading order: LossArgs and Denoms,
surrogates, importance correction, versions, KL and aggregation, the other losses, step_tokens,
compute_policy_loss; below the banner: shape checks and masked means.
"""
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

SURROGATES = ("ppo", "gspo", "cispo")
IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_REFS = ("rollout", "model")
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "prompt_mean_token_mean")
LOG_CLAMP = 20.0  # |log-ratio| bound before exp: e^20 is finite in bf16/fp32, e^89 is not in fp32
K3_CAP = 10.0  # the k3 KL estimate's ceiling per token, verl's and OpenRLHF's value


@dataclass
class LossArgs:
    surrogate: str = field(default="ppo", metadata={"help": "policy surrogate (see losses.py)", "choices": SURROGATES})
    clip_low: float = field(default=0.2, metadata={"help": "floor 1-clip_low of the ppo/gspo ratio (cispo has none)"})
    clip_high: float = field(default=0.2, metadata={"help": "ceiling 1+clip_high: ppo/gspo ratio, CISPO weight"})
    dual_clip: float | None = field(default=None, metadata={"help": "c > 1 caps loss at -c*A where A < 0; None = off"})
    is_level: str = field(default="off", metadata={
        "help": "IS weight old/rollout: per token, seq (product), geo (seq geometric mean)", "choices": IS_LEVELS})
    is_mode: str = field(default="trunc", metadata={"help": "trunc=TIS, mask=IcePop, clip=clamp", "choices": IS_MODES})
    is_band: tuple[float, float] = field(default=(0.5, 5.0), metadata={"help": "IS weight band 0 < LOW < 1 < HIGH"})
    max_token_lag: int | None = field(default=None, metadata={"help": "max version lag of a kept token; None = any"})
    kl_coef: float = field(default=0.0, metadata={"help": "KL-to-reference penalty coefficient; loss/kl logged anyway"})
    kl_estimator: str = field(default="k3", metadata={"help": "KL estimator, k1 metric only", "choices": KL_ESTIMATORS})
    kl_ref: str = field(default="rollout", metadata={"help": "KL to the rollout or a frozen model", "choices": KL_REFS})
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus: loss -= coef * aggregated entropy"})
    agg: str = field(default="token_mean", metadata={"help": "how per-token losses become one number", "choices": AGGS})
    value_clip: float | None = field(default=0.2, metadata={"help": "PPO value clip around old_values; None = off"})
    top_entropy_frac: float | None = field(default=None, metadata={
        "help": "train only this share of each optimizer step's action tokens, those of highest entropy over the "
                "whole step (the 80/20 rule, arXiv 2506.01939); None = every token"})

    def __post_init__(self):
        for flag, choices in (("surrogate", SURROGATES), ("is_level", IS_LEVELS), ("is_mode", IS_MODES),
                              ("kl_estimator", KL_ESTIMATORS), ("kl_ref", KL_REFS), ("agg", AGGS)):
            if (value := getattr(self, flag)) not in choices:
                raise ValueError(f"--loss.{flag} {value!r}: unknown; choose one of {', '.join(choices)}")
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"--loss.clip_low {self.clip_low}: must be in [0, 1], the floor 1-clip_low is a ratio")
        if not self.clip_high >= 0.0:
            raise ValueError(f"--loss.clip_high {self.clip_high}: must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"--loss.dual_clip {self.dual_clip}: must be > 1, so the cap -c*A is above -A at ratio 1")
        low, high = self.is_band
        if not 0.0 < low < 1.0 < high:
            raise ValueError(f"--loss.is_band {low} {high}: need 0 < LOW < 1 < HIGH, on-policy weight 1 in the band")
        if self.max_token_lag is not None and self.max_token_lag < 0:
            raise ValueError(f"--loss.max_token_lag {self.max_token_lag}: need None or >= 0 (0: current version only)")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"--loss.kl_coef {self.kl_coef}: must be >= 0, it is a penalty")
        if self.value_clip is not None and not self.value_clip > 0.0:
            raise ValueError(f"--loss.value_clip {self.value_clip}: must be > 0, or None for no clipping")
        if self.dual_clip is not None and self.surrogate == "cispo":
            raise ValueError("--loss.dual_clip with --loss.surrogate cispo: CISPO's weight is capped already; unset it")
        if self.surrogate == "cispo" and self.clip_low != type(self).clip_low:
            raise ValueError(f"--loss.clip_low {self.clip_low} with --loss.surrogate cispo: CISPO's weight has no "
                             "floor (MiniMax-M1), its one bound is --loss.clip_high; unset --loss.clip_low")
        if self.surrogate == "gspo" and self.agg != "seq_mean_token_mean":
            raise ValueError(f"--loss.surrogate gspo with --loss.agg {self.agg}: GSPO's objective is a mean over "
                             "sequences of each one's token mean; set --loss.agg seq_mean_token_mean")
        if self.top_entropy_frac is not None and not 0.0 < self.top_entropy_frac <= 1.0:
            raise ValueError(f"--loss.top_entropy_frac {self.top_entropy_frac}: must be in (0, 1], or None for all")
        if self.is_level == "seq" and self.is_mode == "clip":
            raise ValueError("--loss.is_level seq with --loss.is_mode clip: raising tiny sequence products to LOW "
                             "up-weights sequences the trainer would not sample; set --loss.is_mode trunc or mask")
        if self.kl_estimator == "k1" and self.kl_coef > 0.0:
            raise ValueError("--loss.kl_estimator k1 with --loss.kl_coef > 0: k1 = logp - ref has gradient grad(logp), "
                             "zero in expectation, so as a loss it penalises nothing; set --loss.kl_estimator k2 or k3")

    @property
    def needs_ref_model(self) -> bool:
        """The KL reference is a frozen copy of the loaded weights, which the trainer builds and runs."""
        return self.kl_ref == "model"

    @property
    def kl_to_rollout(self) -> bool:
        """The loss penalises the KL to the engine's sampling log-probs (so those must be of the full distribution)."""
        return self.kl_coef > 0.0 and self.kl_ref == "rollout"

    @property
    def importance_correction(self) -> bool:
        """The loss reweights by old/rollout, so stale, mixed-version or constrained tokens may train."""
        return self.is_level != "off"

    @property
    def needs_batch_stats(self) -> bool:
        """The loss picks tokens over each optimizer step's whole batch: the trainer calls step_tokens once a step."""
        return self.top_entropy_frac is not None

    @property
    def needs_entropy_grad(self) -> bool:
        """The entropy enters the loss, so it needs a graph; otherwise it is only logged."""
        return self.entropy_coef != 0.0


@dataclass
class Denoms:
    """Step-wide counts (all microbatches and ranks) from the mask before any drop: dropped tokens count, at 0 loss."""
    num_tokens: float  # action tokens
    num_seqs: float  # rows with at least one action token
    num_prompts: float  # prompt groups with at least one action token


def step_denoms(mask: Tensor, group_ids: Tensor) -> tuple[Denoms, Tensor]:
    """An optimizer step's Denoms from its rows' action mask (B, T) and prompt-group index (B,), and the action tokens
    of each group index (P,), which agg prompt_mean_token_mean divides a row by (as group_tokens[group_ids])."""
    live = mask.any(1)  # (B,) rows with an action token
    denoms = Denoms(num_tokens=float(mask.sum()), num_seqs=float(live.sum()),
                    num_prompts=float(len(set(group_ids[live].tolist()))))
    return denoms, torch.zeros(int(group_ids.max()) + 1).index_add_(0, group_ids, mask.sum(1).float())  # (P,)


# --- policy surrogates: (logp, old_logp, adv, mask) -> per-token loss (B, T), clipped (B, T) bool
def clipped_surrogate(log_ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
                      dual_clip: float | None) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped loss per token; `clipped` marks tokens whose gradient a clip zeroed."""
    log_ratio, adv = torch.where(mask, log_ratio, 0.0), torch.where(mask, adv, 0.0)  # (B, T)
    ratio = log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # (B, T)
    loss_unclipped = -ratio * adv  # (B, T)
    loss_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # (B, T)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    clipped = loss_clipped > loss_unclipped  # (B, T)
    if dual_clip is not None:
        bounded = (adv < 0) & (loss > -dual_clip * adv)  # (B, T)
        loss = torch.where(bounded, -dual_clip * adv, loss)
        clipped = clipped | bounded
    return torch.where(mask, loss, 0.0), clipped & mask


def ppo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
        dual_clip: float | None) -> tuple[Tensor, Tensor]:
    """PPO, https://arxiv.org/abs/1707.06347: -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A), r = exp(logp - old_logp).
    With dual_clip c (https://arxiv.org/abs/1912.09729), for A < 0 the loss is also capped at -c*A."""
    return clipped_surrogate(logp - old_logp, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)


def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
         dual_clip: float | None) -> tuple[Tensor, Tensor]:
    """GSPO-token, https://arxiv.org/abs/2507.18071: PPO's clip on s_t = sg(s) * exp(logp_t - sg(logp_t)), with
    s = exp(mean_t(logp_t - old_logp_t)) one ratio per row: value s, gradient s * grad(logp_t) on every token.
    Each token keeps its own A_t (gae, a KL reward); with one per row and --loss.agg seq_mean_token_mean (LossArgs
    allows no other) this is GSPO's mean_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)."""
    logp = torch.where(mask, logp, 0.0)  # (B, T)
    n = mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    log_seq = torch.where(mask, logp - old_logp, 0.0).sum(-1, keepdim=True) / n  # (B, 1)
    log_ratio = log_seq.detach() + logp - logp.detach()  # (B, T)
    return clipped_surrogate(log_ratio, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)


def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_high: float) -> tuple[Tensor, Tensor]:
    """CISPO, https://arxiv.org/abs/2506.13585: -sg(min(r, 1+eps_high))*A*logp, r = exp(logp - old_logp); no floor
    (the paper's eps_low is that large). The weight is a constant: every token keeps a gradient, through logp only."""
    logp = torch.where(mask, logp, 0.0)  # (B, T)
    ratio = torch.where(mask, logp - old_logp, 0.0).detach().clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # (B, T)
    weight = ratio.clamp(max=1.0 + clip_high)  # (B, T)
    return torch.where(mask, -weight * torch.where(mask, adv, 0.0) * logp, 0.0), (weight != ratio) & mask


# --- importance correction: the trainer's proximal policy (old_logp) over the rollout's behaviour policy
def importance_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, level: str, mode: str,
                       band: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """Detached weight (B, T) that multiplies the per-token loss, and the bool (B, T) of tokens the band changed.
    level token: w_t = exp(old_t - rollout_t); seq: every token gets exp(sum_t log w_t); geo: exp(mean_t log w_t),
    GSPO's length-normalised ratio (https://arxiv.org/abs/2507.18071) on old/rollout as in verl's geometric level:
    https://github.com/volcengine/verl/blob/10350b613de7625d759a48e582573749484ef861/docs/advance/rollout_is.md
    mode trunc, TIS (https://fengyao.notion.site/off-policy-rl): min(w, HIGH); mask, IcePop
    (https://arxiv.org/abs/2510.18855): w * 1[LOW <= w <= HIGH]; clip: clamp(w, LOW, HIGH)."""
    log_w = torch.where(mask, old_logp - rollout_logp, 0.0).detach().float()  # (B, T)
    if level == "off":
        return torch.ones_like(log_w), torch.zeros_like(mask)
    if level == "seq":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)  # (B, T)
    elif level == "geo":
        log_w = (log_w.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_w)  # (B, T)
    elif level != "token":  # token: log_w is already per token
        raise ValueError(f"level {level!r}: unknown; choose one of {', '.join(IS_LEVELS)}")
    w = log_w.clamp(-LOG_CLAMP, LOG_CLAMP).exp()  # (B, T)
    above, below = log_w > math.log(band[1]), log_w < math.log(band[0])  # (B, T)
    if mode == "trunc":
        return w.clamp(max=band[1]), above & mask
    elif mode == "mask":
        return torch.where(above | below, 0.0, w), (above | below) & mask
    elif mode == "clip":
        return w.clamp(band[0], band[1]), (above | below) & mask
    else:
        raise ValueError(f"mode {mode!r}: unknown; choose one of {', '.join(IS_MODES)}")


# --- policy versions: exact staleness masking and the on-policy guard
def stale_mask(versions: Tensor, mask: Tensor, *, current_version: int, max_lag: int | None) -> Tensor:
    """mask without the action tokens whose version lags the trainer's by more than max_lag; None keeps all."""
    if max_lag is None:
        return mask
    if max_lag < 0:
        raise ValueError(f"max_lag {max_lag}: must be >= 0 or None")
    return mask & (current_version - versions <= max_lag)  # (B, T)


def check_versions(versions: Tensor, mask: Tensor, *, current_version: int, is_level: str) -> None:
    """Refuse action tokens of no or a future version and, with no importance correction, any of an older one."""
    action_versions = versions[mask]  # (N,)
    if (action_versions < 0).any():
        raise ValueError("versions: an action token has no policy version (-1); the rollout record is broken")
    if (action_versions > current_version).any():
        raise ValueError(f"versions: an action token is newer ({int(action_versions.max())}) than the trainer's "
                         f"current_version {current_version}")
    if is_level == "off" and (action_versions != current_version).any():
        raise ValueError(f"versions: stale/mixed policy versions {sorted(set(action_versions.tolist()))} (trainer: "
                         f"{current_version}) with --loss.is_level off: set it to token, or --loss.max_token_lag 0")


# --- KL to a reference, aggregation over the step
def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, *, estimator: str) -> Tensor:
    """Per-token KL(policy || ref) estimate (B, T), 0 off mask; http://joschu.net/blog/kl-approx.html with
    d = ref - logp: k1 = -d, k2 = d^2 / 2, k3 = min(exp(d) - d - 1, K3_CAP) on d clamped to +-20. As in verl only
    k3, which has an exp, is capped; k1 and k2 stay exact at any d (OpenRLHF instead caps all three at +-10)."""
    d = torch.where(mask, ref_logp - logp, 0.0)  # (B, T)
    if estimator == "k1":
        return -d
    elif estimator == "k2":
        return 0.5 * d**2
    elif estimator == "k3":
        # Capped past d ~ 2.6, one rare token cannot dominate a step; the clamp keeps its backward from 0 * inf = NaN.
        d = d.clamp(-LOG_CLAMP, LOG_CLAMP)  # (B, T)
        return (d.exp() - d - 1.0).clamp(max=K3_CAP)
    else:
        raise ValueError(f"estimator {estimator!r}: unknown; choose one of {', '.join(KL_ESTIMATORS)}")


def aggregate(per_token: Tensor, mask: Tensor, *, agg: str, denoms: Denoms,
              group_tokens: Tensor | None = None) -> Tensor:
    """This microbatch's share () of the step's loss; the shares of all microbatches sum to the full-batch value.
    group_tokens (B,): action tokens of the row's prompt group over the whole step (prompt_mean_token_mean)."""
    x = torch.where(mask, per_token, 0.0)  # (B, T)
    if agg == "token_mean":
        return x.sum() / max(denoms.num_tokens, 1.0)
    elif agg == "seq_mean_token_mean":
        return (x.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(denoms.num_seqs, 1.0)
    elif agg == "seq_mean_token_sum":
        return x.sum() / max(denoms.num_seqs, 1.0)
    elif agg == "prompt_mean_token_mean":
        if group_tokens is None or group_tokens.shape != mask.shape[:1]:
            raise ValueError(f"group_tokens: agg prompt_mean_token_mean needs a (B,) = ({mask.shape[0]},) tensor, "
                             f"got {None if group_tokens is None else tuple(group_tokens.shape)}")
        return (x.sum(-1) / group_tokens.clamp(min=1)).sum() / max(denoms.num_prompts, 1.0)
    else:
        raise ValueError(f"agg {agg!r}: unknown; choose one of {', '.join(AGGS)}")


# --- value, SFT and mismatch: the other losses and the forward-consistency measure
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None,
               denoms: Denoms) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss 1/2 max((v - R)^2, (old + clip(v - old, -c, c) - R)^2), a step-wide token mean, any --loss.agg."""
    check_shapes(mask, values=values, old_values=old_values, returns=returns)
    loss = torch.where(mask, values - returns, 0.0) ** 2  # (B, T)
    clipped = torch.zeros_like(mask)
    if clip is not None:
        moved = torch.where(mask, values - old_values, 0.0)  # (B, T)
        error_clipped = torch.where(mask, old_values - returns, 0.0) + moved.clamp(-clip, clip)  # (B, T)
        # In the band both errors are v - R up to rounding, and a rounding tie is no clip: count only moved clamps.
        clipped = (moved.abs() > clip) & (error_clipped**2 > loss) & mask
        loss = torch.maximum(loss, error_clipped**2)
    loss = 0.5 * loss  # (B, T)
    metrics = {"loss/value": masked_mean(loss, mask), "loss/value_clip_frac": masked_mean(clipped, mask)}
    return loss.sum() / max(denoms.num_tokens, 1.0), metrics


def sft_loss(logp: Tensor, mask: Tensor, *, denoms: Denoms) -> tuple[Tensor, dict[str, float]]:
    """Token NLL -logp over the step's num_tokens, for supervised fine-tuning on the action tokens."""
    check_shapes(mask, logp=logp)
    nll = torch.where(mask, -logp, 0.0)  # (B, T)
    return nll.sum() / max(denoms.num_tokens, 1.0), {"loss/sft_nll": masked_mean(nll, mask)}


def mismatch_metrics(rollout_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Engine vs trainer on the same tokens, Delta = trainer - rollout. vllm_kl = mean(-Delta) and
    mismatch_k3 = mean(exp(Delta) - 1 - Delta) both estimate KL(rollout || trainer) from the rollout's samples."""
    check_shapes(mask, rollout_logp=rollout_logp, trainer_logp=trainer_logp)
    # float64 and expm1: a k3 of 1e-12 (Delta ~ 1e-6) vanishes in float32's exp(Delta) - 1.
    delta = torch.where(mask, trainer_logp - rollout_logp, 0.0).detach().double().clamp(-LOG_CLAMP, LOG_CLAMP)  # (B, T)
    return {"loss/vllm_kl": masked_mean(-delta, mask), "loss/mismatch_k3": masked_mean(delta.expm1() - delta, mask),
            "loss/mismatch_abs": masked_mean(delta.abs(), mask),
            "loss/mismatch_max_abs": float(delta.abs().max()) if mask.any() else 0.0,
            "loss/mismatch_frac": masked_mean(delta.abs() > 1e-6, mask)}


# --- batch-wide token choice: once per optimizer step, over the step's whole batch, only when the loss asks
def step_tokens(args: LossArgs, logp: Tensor, entropy: Tensor, adv: Tensor, mask: Tensor, *, step: int) -> Tensor:
    """Which action tokens of one optimizer step train, (B, T) bool, chosen over the step's whole batch (every rank
    and microbatch), so the choice does not depend on --train.max_tokens_per_microbatch or the dp size. mask: the
    step's action tokens; logp, entropy: the current policy's before the step, no gradient; adv: the advantages;
    step: the optimizer step's index (a random choice seeds its generator with it: every rank draws the same).
    The trainer calls it when args.needs_batch_stats and hands each microbatch its rows as `selected`."""
    check_shapes(mask, logp=logp, entropy=entropy, adv=adv)
    if args.top_entropy_frac is not None:  # the highest-entropy ("forking") tokens: top ceil(frac * N) of the N
        k = math.ceil(args.top_entropy_frac * int(mask.sum()))
        top = torch.where(mask, entropy, -math.inf).flatten().topk(k).indices  # (k,); ties: torch.topk's order
        return torch.zeros_like(mask).flatten().index_fill_(0, top, True).view_as(mask) & mask
    return mask


# --- the two entry points: read the flags, dispatch, pass values down
def compute_policy_loss(args: LossArgs, logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, adv: Tensor, mask: Tensor,
                        *, versions: Tensor, current_version: int, denoms: Denoms, group_tokens: Tensor | None = None,
                        ref_logp: Tensor | None = None, entropy: Tensor | None = None,
                        selected: Tensor | None = None) -> tuple[Tensor, list[tuple[float, dict[str, float]]]]:
    """The policy loss () of one microbatch and its metric records, (count, means over count tokens). group_tokens
    (B,) only for agg prompt_mean_token_mean; ref_logp only for kl_ref model; entropy (B, T) to use or log it;
    selected (B, T): step_tokens' choice, given exactly when args.needs_batch_stats."""
    # --- inputs, then which tokens train: drop those past the lag bound, refuse uncorrected stale data
    check_shapes(mask, logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, adv=adv, versions=versions,
                 ref_logp=ref_logp, entropy=entropy, selected=selected)
    kept = stale_mask(versions, mask, current_version=current_version, max_lag=args.max_token_lag)  # (B, T)
    check_versions(versions, kept, current_version=current_version, is_level=args.is_level)
    records = [(float(mask.sum()), {"loss/stale_frac": masked_mean(mask & ~kept, mask)})]
    if (selected is None) == args.needs_batch_stats:
        raise ValueError(f"selected: {'missing' if selected is None else 'given'}; step_tokens' choice is passed "
                         "exactly when LossArgs.needs_batch_stats (--loss.top_entropy_frac)")
    if selected is not None:  # the others count in the step's denominators, at 0 loss, as stale tokens do
        records.append((float(kept.sum()), {"loss/selected_frac": masked_mean(selected, kept)}))
        kept = kept & selected
    # --- surrogate per token
    clip = dict(clip_low=args.clip_low, clip_high=args.clip_high)
    if args.surrogate == "ppo":
        per_token, clipped = ppo(logp, old_logp, adv, kept, **clip, dual_clip=args.dual_clip)
    elif args.surrogate == "gspo":
        per_token, clipped = gspo(logp, old_logp, adv, kept, **clip, dual_clip=args.dual_clip)
    elif args.surrogate == "cispo":
        per_token, clipped = cispo(logp, old_logp, adv, kept, clip_high=args.clip_high)
    else:
        raise ValueError(f"--loss.surrogate {args.surrogate!r}: unknown; choose one of {', '.join(SURROGATES)}")
    # --- importance correction (a detached factor; with cispo it multiplies CISPO's own weight), aggregation
    weight, cut = importance_weights(old_logp, rollout_logp, kept, level=args.is_level, mode=args.is_mode,
                                     band=args.is_band)
    per_token = weight * per_token  # (B, T)
    loss = aggregate(per_token, mask, agg=args.agg, denoms=denoms, group_tokens=group_tokens)
    metrics = {"loss/pg": masked_mean(per_token, kept), "loss/clip_frac": masked_mean(clipped, kept),
               "loss/is_weight_mean": masked_mean(weight, kept), "loss/is_masked_frac": masked_mean(cut, kept)}
    # --- KL to the reference: always measured when a reference exists, in the loss when kl_coef > 0
    if (reference := kl_reference(args, rollout_logp, ref_logp)) is not None:
        kl = kl_penalty(logp, reference, kept, estimator=args.kl_estimator)  # (B, T)
        metrics["loss/kl"] = masked_mean(kl, kept)
        if args.kl_coef > 0.0:
            loss = loss + args.kl_coef * aggregate(kl, mask, agg=args.agg, denoms=denoms, group_tokens=group_tokens)
    # --- entropy bonus
    if entropy is None and args.entropy_coef != 0.0:
        raise ValueError("entropy: --loss.entropy_coef != 0 needs it per token (B, T); pass it or set the coef to 0")
    if entropy is not None:
        metrics["loss/entropy"] = masked_mean(entropy, kept)
        if args.entropy_coef != 0.0:
            loss = loss - args.entropy_coef * aggregate(torch.where(kept, entropy, 0.0), mask, agg=args.agg,
                                                        denoms=denoms, group_tokens=group_tokens)
    # --- records: each mean with its count. Mismatch only on tokens the current weights sampled (lag is not
    # mismatch); a batch with none (asynchronous steps) reports no mismatch keys rather than a false zero.
    records.append((float(kept.sum()), metrics))
    same = mask & (versions == current_version)  # (B, T)
    if same.any():
        records.append((float(same.sum()), mismatch_metrics(rollout_logp, old_logp, same)))
    return loss, records


def kl_reference(args: LossArgs, rollout_logp: Tensor, ref_logp: Tensor | None) -> Tensor | None:
    """The log-probs (B, T) --loss.kl_ref names, or None when the frozen model's are not given and not needed."""
    if args.kl_ref == "rollout":
        if ref_logp is not None:
            raise ValueError("ref_logp: given, but --loss.kl_ref rollout ignores it: pass None, or --loss.kl_ref model")
        return rollout_logp
    elif args.kl_ref == "model":
        if ref_logp is None and args.kl_coef > 0.0:
            raise ValueError("ref_logp: --loss.kl_ref model with --loss.kl_coef > 0 needs the frozen model's (B, T)")
        return ref_logp
    else:
        raise ValueError(f"--loss.kl_ref {args.kl_ref!r}: unknown; choose one of {', '.join(KL_REFS)}")


def compute_value_loss(args: LossArgs, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       denoms: Denoms) -> tuple[Tensor, dict[str, float]]:
    """The critic's loss () of one microbatch; the one reader of --loss.value_clip."""
    return value_loss(values, old_values, returns, mask, clip=args.value_clip, denoms=denoms)


# === machinery: shape checks and masked means; read it when you change an input's shape or a metric
def check_shapes(mask: Tensor, **tensors: Tensor | None) -> None:
    """Raise ValueError naming the first tensor whose shape is not mask's (B, T); None means not given."""
    if mask.dtype != torch.bool or mask.ndim != 2:
        raise ValueError(f"mask: expected a bool (B, T) tensor, got {mask.dtype} {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name}: expected shape {tuple(mask.shape)} like mask, got {tuple(x.shape)}")


def masked_mean(x: Tensor, mask: Tensor) -> float:
    """Mean of x over mask's True entries as a detached float (summed in float64); 0.0 when mask is empty."""
    return float(torch.where(mask, x.detach().double(), 0.0).sum() / mask.sum().clamp(min=1))
