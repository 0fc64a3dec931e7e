"""Advantage estimators: per-row rewards, prompt groups and action masks -> per-token advantages.

Shapes: B rows (segments), T tokens, P prompt groups, E unique episodes in the batch.
Contract: compute_advantages(args, rewards (B,), group_ids (B,), episode_ids (B,), mask (B, T),
values=(B, T), kl=(B, T)) -> (advantages (B, T), returns (B, T) for gae else None, metrics).
Advantages are exactly 0 where mask is False. Group estimators count each episode once (its
segments share one reward) and broadcast its scalar advantage to every action token of every
segment. Token-level estimators (reinforce, gae) work per row and treat non-action tokens (prompt,
tool output, template glue) as transparent: sums skip them and carry across them.
Not here: policy or value losses (losses.py), the KL estimate itself (the caller passes it), any
reward shaping beyond the KL term, and gradients: every function is a pure forward computation.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ESTIMATORS = ("reinforce", "reinforce_baseline", "grpo", "dr_grpo", "rloo", "gae", "batch_baseline")


@dataclass
class EstimatorArgs:
    name: str = field(default="grpo", metadata={"help": "advantage estimator; each is the function of that name in estimators.py", "choices": ESTIMATORS})
    gamma: float = field(default=1.0, metadata={"help": "discount per action token (reinforce, gae)"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda: 1 = Monte Carlo return minus value, 0 = one-step TD error (gae)"})
    std_eps: float = field(default=1e-6, metadata={"help": "added to every std we divide by: the grpo group std and batch whitening"})
    whiten: bool = field(default=True, metadata={"help": "whiten advantages over all action tokens of the batch (reinforce, reinforce_baseline, gae)"})
    kl_coef: float = field(default=0.0, metadata={"help": "coefficient of the -kl reward on every action token (reinforce, gae)"})

    def __post_init__(self):
        if self.name not in ESTIMATORS:
            raise ValueError(f"--estimator.name {self.name!r}: unknown; choose one of {', '.join(ESTIMATORS)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--estimator.gamma {self.gamma}: must be in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"--estimator.lam {self.lam}: must be in [0, 1]")
        if not self.std_eps > 0.0:
            raise ValueError(f"--estimator.std_eps {self.std_eps}: must be > 0, it keeps a zero std from dividing by 0")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"--estimator.kl_coef {self.kl_coef}: must be >= 0, it is a penalty")
        if self.kl_coef > 0.0 and self.name not in ("reinforce", "gae"):
            raise ValueError(f"--estimator.kl_coef with --estimator.name {self.name}: a per-token KL reward needs per-token returns, which only reinforce and gae compute; set --estimator.kl_coef 0 and put the KL in the loss")
        if self.gamma < 1.0 and self.name not in ("reinforce", "gae"):
            raise ValueError(f"--estimator.gamma with --estimator.name {self.name}: it gives one advantage per episode, so nothing is discounted; set --estimator.gamma 1 or use reinforce or gae")
        if self.lam < 1.0 and self.name != "gae":
            raise ValueError(f"--estimator.lam with --estimator.name {self.name}: lambda only exists in gae; set --estimator.lam 1 or --estimator.name gae")


# --- helpers: input checks, rows <-> episodes, group means, packing action tokens


def check_inputs(rewards, mask, *, group_ids=None, episode_ids=None, values=None, kl=None) -> None:
    """Raise ValueError naming the first input that breaks the contract; None means not given."""
    if rewards.ndim != 1 or len(rewards) == 0:
        raise ValueError(f"rewards: expected a non-empty (B,) tensor, got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards: must be finite, got {rewards.tolist()}; fix the reward function")
    if mask.dtype != torch.bool or mask.ndim != 2 or len(mask) != len(rewards):
        raise ValueError(f"mask: expected a bool (B={len(rewards)}, T) tensor, got {mask.dtype} {tuple(mask.shape)}")
    rows, tokens = (len(rewards),), tuple(mask.shape)
    for name, x, shape in (("group_ids", group_ids, rows), ("episode_ids", episode_ids, rows), ("values", values, tokens), ("kl", kl, tokens)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")


def to_episodes(rewards, group_ids, episode_ids):
    """Collapse rows to unique episodes: rewards (E,), group ids (E,), and each row's episode (B,)."""
    episodes, row_episode = torch.unique(episode_ids, return_inverse=True)  # (E,), (B,)
    episode_rewards = rewards.new_zeros(len(episodes)).scatter_(0, row_episode, rewards)  # (E,)
    episode_groups = group_ids.new_zeros(len(episodes)).scatter_(0, row_episode, group_ids)  # (E,)
    if not (torch.equal(episode_rewards[row_episode], rewards) and torch.equal(episode_groups[row_episode], group_ids)):
        raise ValueError("episode_ids: rows of one episode disagree on reward or group id; every segment of an episode must carry its episode's reward and group")
    return episode_rewards, episode_groups, row_episode


def group_mean(x, groups):
    """Mean of x over each element's group, and the group's size, both (E,) for x, groups (E,)."""
    _, inverse = torch.unique(groups, return_inverse=True)  # (E,)
    size = torch.bincount(inverse).to(x.dtype)  # (P,)
    # Average deviations from the group max, so an all-equal group's mean is exactly its reward
    # (advantage exactly 0, not a rounding residue that grpo's std division would blow up).
    top = x.new_zeros(len(size)).scatter_reduce_(0, inverse, x, "amax", include_self=False)  # (P,)
    mean = top + x.new_zeros(len(size)).index_add_(0, inverse, x - top[inverse]) / size  # (P,)
    return mean[inverse], size[inverse]


def to_tokens(episode_adv, row_episode, mask):
    """Broadcast one advantage per episode (E,) to every action token of its rows: (B, T)."""
    return torch.where(mask, episode_adv[row_episode][:, None], 0.0)  # (B, T)


def whiten_tokens(x, mask, eps):
    """(x - mean) / (unbiased std + eps) over the action tokens of the whole batch; 0 elsewhere."""
    if int(mask.sum()) < 2:  # one token whitens to 0, and the unbiased std of one value is undefined
        return torch.zeros_like(x)
    kept = x[mask]  # (N,)
    return torch.where(mask, (x - kept.mean()) / (kept.std() + eps), 0.0)  # (B, T)


def token_rewards(rewards, mask, kl, kl_coef):
    """The row's reward on its last action token, minus kl_coef * kl on every action token: (B, T)."""
    last = mask & (mask.cumsum(1) == mask.sum(1, keepdim=True))  # (B, T) one True per non-empty row
    r = torch.where(last, rewards[:, None], 0.0)  # (B, T)
    if kl_coef > 0.0:
        if kl is None:
            raise ValueError("kl: --estimator.kl_coef > 0 needs the per-token kl (B, T); pass kl or set --estimator.kl_coef 0")
        r = r - kl_coef * torch.where(mask, kl, 0.0)
    return r


def pack(x, mask):
    """Move each row's action tokens to its front, in order, zeros after: (B, T) -> (B, Tc)."""
    counts = mask.sum(1)  # (B,)
    front = torch.arange(int(counts.max())) < counts[:, None]  # (B, Tc)
    packed = x.new_zeros(front.shape)  # (B, Tc)
    packed[front] = x[mask]  # both boolean selections run row by row, left to right
    return packed


def unpack(packed, mask):
    """Inverse of pack: put the packed action tokens back at their positions, zeros elsewhere."""
    front = torch.arange(packed.shape[1]) < mask.sum(1)[:, None]  # (B, Tc)
    out = packed.new_zeros(mask.shape)  # (B, T)
    out[mask] = packed[front]
    return out


def discounted_sum(x, discount):
    """S_t = x_t + discount * S_{t+1} along each packed row (B, Tc); zero padding keeps S = 0 past the end."""
    s = x.T.clone(memory_format=torch.contiguous_format)  # (Tc, B): one contiguous slice per step
    for t in reversed(range(len(s) - 1)):  # a loop over tokens only; each step is one op over all rows
        s[t].add_(s[t + 1], alpha=discount)
    return s.T  # (B, Tc)


# --- estimators, in the order of ESTIMATORS


def reinforce(rewards, mask, *, kl=None, kl_coef=0.0, gamma=1.0, whiten=True, std_eps=1e-6) -> torch.Tensor:
    """REINFORCE++, https://arxiv.org/abs/2501.03262: A_t = whiten(G_t), G_t = r_t + gamma * G_next,
    r_t = -kl_coef * kl_t (+ the row's reward on its last action token); "next" = next action token.
    Per row: each segment of a multi-segment episode gets the full episode reward at its own end."""
    check_inputs(rewards, mask, kl=kl)
    returns = unpack(discounted_sum(pack(token_rewards(rewards, mask, kl, kl_coef), mask), gamma), mask)  # (B, T)
    return whiten_tokens(returns, mask, std_eps) if whiten else returns


def reinforce_baseline(rewards, group_ids, episode_ids, mask, *, whiten=True, std_eps=1e-6) -> torch.Tensor:
    """REINFORCE++-baseline, https://arxiv.org/abs/2501.03262: A = whiten(R - mean_group(R)).
    One value per episode, broadcast to its action tokens, then whitened token-weighted over the batch."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    adv = to_tokens(r - group_mean(r, groups)[0], row_episode, mask)  # (B, T)
    return whiten_tokens(adv, mask, std_eps) if whiten else adv


def grpo(rewards, group_ids, episode_ids, mask, *, std_eps=1e-6) -> torch.Tensor:
    """GRPO, https://arxiv.org/abs/2402.03300: A = (R - mean_group(R)) / (std_group(R) + std_eps).
    Unbiased std over the group's episodes. A singleton group has no baseline and gets 0; an
    all-equal group gets exactly 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    mean, size = group_mean(r, groups)  # (E,), (E,)
    std = (group_mean((r - mean) ** 2, groups)[0] * size / (size - 1).clamp(min=1)).sqrt()  # (E,)
    return to_tokens((r - mean) / (std + std_eps), row_episode, mask)


def dr_grpo(rewards, group_ids, episode_ids, mask) -> torch.Tensor:
    """Dr. GRPO, https://arxiv.org/abs/2503.20783: A = R - mean_group(R), no std division.
    A singleton group is its own mean and gets 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    return to_tokens(r - group_mean(r, groups)[0], row_episode, mask)


def rloo(rewards, group_ids, episode_ids, mask) -> torch.Tensor:
    """RLOO, https://arxiv.org/abs/2402.14740: A_i = R_i - mean_{j != i} R_j = G / (G - 1) * (R_i - mean_group(R)).
    A singleton group has no other member to compare with and gets 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    mean, size = group_mean(r, groups)  # (E,), (E,)
    return to_tokens(size / (size - 1).clamp(min=1) * (r - mean), row_episode, mask)


def gae(rewards, values, mask, *, kl=None, kl_coef=0.0, gamma=1.0, lam=1.0, whiten=True, std_eps=1e-6):
    """GAE, https://arxiv.org/abs/1506.02438: A_t = delta_t + gamma * lam * A_next, delta_t = r_t + gamma * V_next - V_t.
    Token rewards as in reinforce; "next" = next action token of the row (V_next = A_next = 0 after the
    last). Returns (advantages, returns = A + V before whitening), both (B, T) and 0 off the mask."""
    if values is None:
        raise ValueError("values: gae needs the critic's value at every token, shape (B, T)")
    check_inputs(rewards, mask, values=values, kl=kl)
    r, v = pack(token_rewards(rewards, mask, kl, kl_coef), mask), pack(values, mask)  # (B, Tc), (B, Tc)
    v_next = F.pad(v[:, 1:], (0, 1))  # (B, Tc); the zero padding is V_next = 0 after the last action token
    adv = unpack(discounted_sum(r + gamma * v_next - v, gamma * lam), mask)  # (B, T)
    returns = torch.where(mask, adv + values, 0.0)  # (B, T)
    return (whiten_tokens(adv, mask, std_eps) if whiten else adv), returns


def batch_baseline(rewards, episode_ids, mask) -> torch.Tensor:
    """Single-rollout batch-mean baseline (FlashREINFORCE style; REINFORCE, https://doi.org/10.1007/BF00992696):
    A = R - mean_batch(R), the mean over the batch's episodes (each counted once) across all prompts."""
    return dr_grpo(rewards, torch.zeros_like(episode_ids), episode_ids, mask)  # one group holding every episode


# --- dispatch: the one place that reads EstimatorArgs


def compute_advantages(args: EstimatorArgs, rewards, group_ids, episode_ids, mask, *, values=None, kl=None):
    """-> (advantages (B, T), returns (B, T) for gae else None, metrics {key: float})."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids, values=values, kl=kl)
    returns = None
    if args.name == "reinforce":
        adv = reinforce(rewards, mask, kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, whiten=args.whiten, std_eps=args.std_eps)
    elif args.name == "reinforce_baseline":
        adv = reinforce_baseline(rewards, group_ids, episode_ids, mask, whiten=args.whiten, std_eps=args.std_eps)
    elif args.name == "grpo":
        adv = grpo(rewards, group_ids, episode_ids, mask, std_eps=args.std_eps)
    elif args.name == "dr_grpo":
        adv = dr_grpo(rewards, group_ids, episode_ids, mask)
    elif args.name == "rloo":
        adv = rloo(rewards, group_ids, episode_ids, mask)
    elif args.name == "gae":
        adv, returns = gae(rewards, values, mask, kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, lam=args.lam, whiten=args.whiten, std_eps=args.std_eps)
    elif args.name == "batch_baseline":
        adv = batch_baseline(rewards, episode_ids, mask)
    else:
        raise ValueError(f"--estimator.name {args.name!r}: unknown; choose one of {', '.join(ESTIMATORS)}")

    kept = adv[mask] if mask.any() else adv.new_zeros(1)  # (N,); a batch with no action token logs zeros
    _, row_group = torch.unique(group_ids, return_inverse=True)  # (B,)
    live = torch.zeros(int(row_group.max()) + 1).index_add_(0, row_group, (adv != 0).any(1).float())  # (P,)
    metrics = {
        "estimator/adv_mean": kept.mean().item(),
        "estimator/adv_std": kept.std(correction=0).item(),
        "estimator/adv_max": kept.max().item(),
        "estimator/adv_min": kept.min().item(),
        "estimator/zero_adv_groups": (live == 0).float().mean().item(),  # GRPO collapse: groups with no signal
    }
    if returns is not None:
        metrics["estimator/returns_mean"] = returns[mask].mean().item() if mask.any() else 0.0
    return adv, returns, metrics
