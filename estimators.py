"""Advantage estimators: per-row rewards, prompt groups and action masks -> per-token advantages.

Shapes: B rows (segments), T tokens, P prompt groups, E unique episodes. Contract: compute_advantages(args,
rewards (B,), group_ids (B,), episode_ids (B,), mask (B, T), values=(B, T), kl=(B, T), facts=[RolloutFacts] * B) ->
(advantages (B, T), returns (B, T) for gae else None, metrics). Advantages are exactly 0 where mask is False.
Group estimators count each episode once (its segments share one reward) and broadcast its advantage to every
action token of every segment. Token-level estimators (reinforce, gae) work per row and skip non-action tokens
(prompt, tool output, template glue) in their sums. Inputs carry no gradient; bad input raises ValueError naming
it. Not here: policy or value losses and length normalisation (losses.py), the KL estimate (the caller's).

Research surface (README, "Adding an estimator, a reward shaping or a loss-side method"): a new estimator is one pure
function, its name in KINDS and one `elif` in compute_advantages, which may add its own `estimator/<name>` metrics;
a reward-shaping term from what the rollout did is one branch of shape_rewards, reading RolloutFacts (a new fact:
one line of rollout_facts). None of these edits trainer.py, launch.py or the flag matrix. Reading order:
EstimatorArgs, the group helpers, the estimators, the rollout facts and shape_rewards, compute_advantages; below the
banner: the input checks, and the packed scans of reinforce and gae.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

# Each estimator's kind: what it reads beyond its episode's reward and the action mask. The flag matrix
# (tests/test_matrix.py) runs the loop with the first estimator of each kind; the others differ in arithmetic only.
KINDS = {"group": ("grpo", "dr_grpo", "rloo"),                  # the episodes of its prompt group
         "whitened": ("reinforce_baseline", "reinforce"),       # the batch's action tokens, whitened over
         "batch": ("batch_baseline",),                          # every episode of the batch
         "critic": ("gae",)}                                    # a critic's value per token
ESTIMATORS = tuple(name for names in KINDS.values() for name in names)


@dataclass
class EstimatorArgs:
    name: str = field(default="grpo", metadata={"help": "advantage estimator (function name)", "choices": ESTIMATORS})
    gamma: float = field(default=1.0, metadata={"help": "discount per action token (reinforce, gae)"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda: 1 = return - value, 0 = one-step TD error (gae)"})
    std_eps: float = field(default=1e-6, metadata={"help": "added to every std we divide by (grpo std, whitening)"})
    whiten: bool = field(default=True, metadata={"help": "whiten over the batch (reinforce, reinforce_baseline, gae)"})
    kl_coef: float = field(default=0.0, metadata={"help": "weight of the -kl reward per action token (reinforce, gae)"})
    truncated_reward: float | None = field(default=None, metadata={
        "help": "reward of an episode cut off at max tokens or max context, in place of its own; unset: its own"})
    overlong_max: int | None = field(default=None, metadata={
        "help": "DAPO's soft overlong penalty: an episode's action tokens past overlong_max - overlong_cache lower its "
                "reward linearly, by 1 at overlong_max and beyond; None: off"})
    overlong_cache: int = field(default=0, metadata={"help": "the penalty's ramp, in action tokens (overlong_max)"})

    def __post_init__(self):
        if self.name not in ESTIMATORS:
            raise ValueError(f"--estimator.name {self.name!r}: unknown; choose one of {', '.join(ESTIMATORS)}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--estimator.{name} {getattr(self, name)}: must be in [0, 1]")
        if not self.std_eps > 0.0:
            raise ValueError(f"--estimator.std_eps {self.std_eps}: must be > 0, it keeps a zero std from dividing by 0")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"--estimator.kl_coef {self.kl_coef}: must be >= 0, it is a penalty")
        if self.kl_coef > 0.0 and self.name not in ("reinforce", "gae"):
            raise ValueError(f"--estimator.kl_coef with --estimator.name {self.name}: a per-token KL reward needs "
                             "per-token returns (reinforce, gae); set --estimator.kl_coef 0 and use --loss.kl_coef")
        if self.gamma < 1.0 and self.name not in ("reinforce", "gae"):
            raise ValueError(f"--estimator.gamma with --estimator.name {self.name}: it gives one advantage per "
                             "episode, so nothing is discounted; set --estimator.gamma 1 or use reinforce or gae")
        if self.truncated_reward is not None and not math.isfinite(self.truncated_reward):
            raise ValueError(f"--estimator.truncated_reward {self.truncated_reward}: must be a finite number")
        if self.overlong_max is not None and not 0 < self.overlong_cache <= self.overlong_max:
            raise ValueError(f"--estimator.overlong_cache {self.overlong_cache}: must be in [1, "
                             f"--estimator.overlong_max {self.overlong_max}], the tokens the penalty ramps over")
        if self.overlong_max is None and self.overlong_cache:
            raise ValueError("--estimator.overlong_cache without --estimator.overlong_max: set both, or neither")
        if self.lam < 1.0 and self.name != "gae":
            raise ValueError(f"--estimator.lam with --estimator.name {self.name}: lambda only exists in gae; "
                             "set --estimator.lam 1 or --estimator.name gae")

    @property
    def needs_values(self) -> bool:
        """compute_advantages needs a critic's values (B, T): the trainer builds a critic exactly then."""
        return self.name == "gae"

    @property
    def needs_kl(self) -> bool:
        """compute_advantages needs the per-token kl (B, T), for its -kl_coef * kl reward."""
        return self.kl_coef > 0.0


# --- helpers: rows <-> episodes, group means, whitening
def to_episodes(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Collapse rows to unique episodes: rewards (E,), group ids (E,), and each row's episode (B,)."""
    episodes, row_episode = torch.unique(episode_ids, return_inverse=True)  # (E,), (B,)
    episode_rewards = rewards.new_zeros(len(episodes)).scatter_(0, row_episode, rewards)  # (E,)
    episode_groups = group_ids.new_zeros(len(episodes)).scatter_(0, row_episode, group_ids)  # (E,)
    if not (torch.equal(episode_rewards[row_episode], rewards) and torch.equal(episode_groups[row_episode], group_ids)):
        raise ValueError("episode_ids: an episode's segments must share its reward and group id; these rows do not")
    return episode_rewards, episode_groups, row_episode


def group_mean(x: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
    """Mean of x over each element's group, and the group's size, both (E,) for x, groups (E,)."""
    _, inverse = torch.unique(groups, return_inverse=True)  # (E,)
    size = torch.bincount(inverse).to(x.dtype)  # (P,)
    # Average deviations from the group max, so an all-equal group's mean is exactly its reward
    # (advantage exactly 0, not a rounding residue that grpo's std division would blow up).
    top = x.new_zeros(len(size)).scatter_reduce_(0, inverse, x, "amax", include_self=False)  # (P,)
    mean = top + x.new_zeros(len(size)).index_add_(0, inverse, x - top[inverse]) / size  # (P,)
    return mean[inverse], size[inverse]


def to_tokens(episode_adv: Tensor, row_episode: Tensor, mask: Tensor) -> Tensor:
    """Broadcast one advantage per episode (E,) to every action token of its rows: (B, T)."""
    return torch.where(mask, episode_adv[row_episode][:, None], 0.0)  # (B, T)


def whiten_tokens(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (unbiased std + eps) over the action tokens of the whole batch; 0 elsewhere."""
    if int(mask.sum()) < 2:  # one token whitens to 0, and the unbiased std of one value is undefined
        return torch.zeros_like(x)
    kept = x[mask]  # (N,)
    return torch.where(mask, (x - kept.mean()) / (kept.std() + eps), 0.0)  # (B, T)


# --- the estimators: reinforce and reinforce_baseline, the group ones, gae, batch_baseline
def reinforce(rewards: Tensor, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
              whiten: bool = True, std_eps: float = 1e-6) -> Tensor:
    """REINFORCE++, https://arxiv.org/abs/2501.03262: A_t = whiten(G_t), G_t = r_t + gamma * G_next,
    r_t = -kl_coef * kl_t plus, on each segment's last action token, its episode's reward; "next" = next action
    token; whitened over the batch's action tokens (unbiased std + std_eps)."""
    check_inputs(rewards, mask, kl=kl)
    slot, counts = pack_slots(mask)  # (B, T), (B,)
    returns = unpack(discounted_sum(packed_rewards(rewards, kl, kl_coef, slot, counts), gamma), slot)  # (B, T)
    return whiten_tokens(returns, mask, std_eps) if whiten else returns


def reinforce_baseline(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, mask: Tensor, *,
                       whiten: bool = True, std_eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline, https://arxiv.org/abs/2501.03262: A = whiten(R - mean_group(R)).
    One value per episode, broadcast to its action tokens, whitened as in reinforce (longer rows weigh more).
    A singleton group has no baseline and gets 0 before whitening, by choice as in grpo (verl keeps its raw score);
    that 0 enters the batch mean and std, so it reaches every row, and the singleton ends at -mean/std, not 0."""
    adv = dr_grpo(rewards, group_ids, episode_ids, mask)  # (B, T): R - mean_group(R), the inputs checked there
    return whiten_tokens(adv, mask, std_eps) if whiten else adv


def grpo(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, mask: Tensor, *, std_eps: float = 1e-6) -> Tensor:
    """GRPO, https://arxiv.org/abs/2402.03300: A = (R - mean_group(R)) / (std_group(R) + std_eps).
    Unbiased std over the group's episodes; a singleton group (no baseline) and an all-equal group get exactly 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    mean, size = group_mean(r, groups)  # (E,), (E,)
    std = (group_mean((r - mean) ** 2, groups)[0] * size / (size - 1).clamp(min=1)).sqrt()  # (E,) unbiased
    return to_tokens((r - mean) / (std + std_eps), row_episode, mask)


def dr_grpo(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, mask: Tensor) -> Tensor:
    """Dr. GRPO, https://arxiv.org/abs/2503.20783: A = R - mean_group(R), no std division; a singleton group gets 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    return to_tokens(r - group_mean(r, groups)[0], row_episode, mask)


def rloo(rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, mask: Tensor) -> Tensor:
    """RLOO, https://arxiv.org/abs/2402.14740: A_i = R_i - mean_{j!=i} R_j = G/(G-1) * (R_i - mean_group(R)).
    A singleton group has no other member to compare with and gets 0."""
    check_inputs(rewards, mask, group_ids=group_ids, episode_ids=episode_ids)
    r, groups, row_episode = to_episodes(rewards, group_ids, episode_ids)  # (E,), (E,), (B,)
    mean, size = group_mean(r, groups)  # (E,), (E,)
    return to_tokens(size / (size - 1).clamp(min=1) * (r - mean), row_episode, mask)


def gae(rewards: Tensor, values: Tensor | None, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0,
        gamma: float = 1.0, lam: float = 1.0, whiten: bool = True, std_eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """GAE, https://arxiv.org/abs/1506.02438: A_t = delta_t + gamma*lam*A_next, delta_t = r_t + gamma*V_next - V_t.
    Token rewards as in reinforce; "next" = the row's next action token (V_next = A_next = 0 after the last).
    Returns (advantages, whitened if whiten; returns = A + V before whitening, the value targets), 0 off the mask."""
    if values is None:
        raise ValueError("values: gae needs the critic's value at every token, shape (B, T)")
    check_inputs(rewards, mask, values=values, kl=kl)
    slot, counts = pack_slots(mask)  # (B, T), (B,)
    r, v = packed_rewards(rewards, kl, kl_coef, slot, counts), pack(values, slot, counts)  # (B, Tc), (B, Tc)
    v_next = F.pad(v[:, 1:], (0, 1))  # (B, Tc); the zero padding is V_next = 0 after the last action token
    adv = unpack(discounted_sum(r + gamma * v_next - v, gamma * lam), slot)  # (B, T)
    returns = torch.where(mask, adv + values, 0.0)  # (B, T)
    return (whiten_tokens(adv, mask, std_eps) if whiten else adv), returns


def batch_baseline(rewards: Tensor, episode_ids: Tensor, mask: Tensor) -> Tensor:
    """Single-rollout batch-mean baseline, FlashREINFORCE style (REINFORCE: https://doi.org/10.1007/BF00992696):
    A = R - mean_batch(R), the mean over all the batch's episodes (each counted once), whatever their prompt."""
    return dr_grpo(rewards, torch.zeros_like(episode_ids), episode_ids, mask)  # one group holding every episode


# --- what the rollout did, reward shaping from it, then the dispatch: the one place that reads EstimatorArgs
@dataclass(frozen=True)
class RolloutFacts:
    """One row's (segment's) rollout, the same for Env and ChatAgent episodes: shape_rewards reads it as data."""
    turns: int                # engine calls sampled into this row
    action_tokens: int        # tokens sampled into this row
    truncated: bool           # cut at max tokens, max turns or max context
    finish_reason: str        # the row's last engine call's: "stop", "length" or "abort"
    tool_calls: int | None    # tool calls the chat server parsed from this row's replies; None for an Env (it parses)
    info: dict                # the agent's Result.info, beside the runner's own keys (see agent.py and chat_server.py)


def rollout_facts(segments: list) -> list[RolloutFacts]:
    """The facts of each segment (generator.Segment), in row order; info["turns"] is each turn's (start, end)."""
    return [RolloutFacts(turns=len(s.info.get("turns", ())), action_tokens=sum(s.action_mask), truncated=s.truncated,
                         finish_reason=s.finish_reason, tool_calls=s.info.get("tool_calls"), info=s.info)
            for s in segments]


def shape_rewards(args: EstimatorArgs, rewards: Tensor, episode_ids: Tensor, mask: Tensor,
                  facts: list[RolloutFacts] | None) -> Tensor:
    """Reward shaping from rollout facts, before any estimator reads rewards (B,); facts: one per row (None: none
    given, no shaping). The result must keep one reward per episode: a fact of one row marks its whole episode."""
    if facts is not None and len(facts) != len(rewards):
        raise ValueError(f"facts: expected one RolloutFacts per row ({len(rewards)}), got {len(facts)}")
    if args.overlong_max is not None and facts is not None:  # DAPO https://arxiv.org/abs/2503.14476, eq. 13
        _, row_episode = torch.unique(episode_ids, return_inverse=True)  # (B,)
        tokens = torch.tensor([float(f.action_tokens) for f in facts], dtype=rewards.dtype)  # (B,)
        length = tokens.new_zeros(len(tokens)).index_add_(0, row_episode, tokens)[row_episode]  # (B,) all its rows
        ramp = (args.overlong_max - args.overlong_cache - length) / args.overlong_cache  # (B,) >= 0 below the ramp
        rewards = rewards + ramp.clamp(min=-1.0, max=0.0)
    if args.truncated_reward is not None and facts is not None:  # last: a cut episode's reward is exactly this
        truncated = torch.tensor([f.truncated for f in facts], dtype=torch.bool)  # (B,)
        rewards = torch.where(torch.isin(episode_ids, episode_ids[truncated]), args.truncated_reward, rewards)  # (B,)
    return rewards


def compute_advantages(args: EstimatorArgs, rewards: Tensor, group_ids: Tensor, episode_ids: Tensor, mask: Tensor, *,
                       values: Tensor | None = None, kl: Tensor | None = None, facts: list[RolloutFacts] | None = None
                       ) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """-> (advantages (B, T), returns (B, T) for gae else None, metrics); the estimator validates the inputs.
    A branch may add its estimator's own metrics as metrics["estimator/<name>"]: the trainer logs every key."""
    returns, metrics = None, {}
    rewards = shape_rewards(args, rewards, episode_ids, mask, facts)
    if args.name == "reinforce":
        adv = reinforce(rewards, mask, kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, whiten=args.whiten,
                        std_eps=args.std_eps)
    elif args.name == "reinforce_baseline":
        adv = reinforce_baseline(rewards, group_ids, episode_ids, mask, whiten=args.whiten, std_eps=args.std_eps)
    elif args.name == "grpo":
        adv = grpo(rewards, group_ids, episode_ids, mask, std_eps=args.std_eps)
    elif args.name == "dr_grpo":
        adv = dr_grpo(rewards, group_ids, episode_ids, mask)
    elif args.name == "rloo":
        adv = rloo(rewards, group_ids, episode_ids, mask)
    elif args.name == "gae":
        adv, returns = gae(rewards, values, mask, kl=kl, kl_coef=args.kl_coef, gamma=args.gamma, lam=args.lam,
                           whiten=args.whiten, std_eps=args.std_eps)
        metrics["estimator/returns_mean"] = returns[mask].mean().item() if mask.any() else 0.0
    elif args.name == "batch_baseline":
        adv = batch_baseline(rewards, episode_ids, mask)
    else:
        raise ValueError(f"--estimator.name {args.name!r}: unknown; choose one of {', '.join(ESTIMATORS)}")

    for name, x in (("group_ids", group_ids), ("episode_ids", episode_ids)):  # reinforce, gae: only the metrics read
        if x.shape != rewards.shape:
            raise ValueError(f"{name}: expected shape {tuple(rewards.shape)}, got {tuple(x.shape)}")
    kept = adv[mask] if mask.any() else adv.new_zeros(1)  # (N,); a batch with no action token logs zeros
    groups, row_group = torch.unique(group_ids, return_inverse=True)  # (P,), (B,)
    live = adv.new_zeros(len(groups)).index_add_(0, row_group, (adv != 0).any(1).to(adv.dtype))  # (P,) rows with signal
    episodes, row_episode = torch.unique(episode_ids, return_inverse=True)  # (E,), (B,)
    episode_reward = rewards.new_zeros(len(episodes)).scatter_(0, row_episode, rewards)  # (E,): its rows share it
    metrics |= {"estimator/adv_mean": kept.mean().item(), "estimator/adv_std": kept.std(correction=0).item(),
                "estimator/adv_max": kept.max().item(), "estimator/adv_min": kept.min().item(),
                "estimator/zero_adv_groups": (live == 0).float().mean().item(),  # GRPO collapse: groups with no signal
                "estimator/reward_mean": episode_reward.mean().item() if len(rewards) else 0.0}  # after shaping
    return adv, returns, metrics


# === machinery: input checks, packed token scans; read it when you change an input or a token-level sum
def check_inputs(rewards: Tensor, mask: Tensor, *, group_ids: Tensor | None = None, episode_ids: Tensor | None = None,
                 values: Tensor | None = None, kl: Tensor | None = None) -> None:
    """Raise ValueError naming the first input that breaks the contract; None means not given."""
    if rewards.ndim != 1 or len(rewards) == 0 or not rewards.is_floating_point():
        raise ValueError(f"rewards: expected a non-empty float (B,) tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:5].tolist()
        raise ValueError(f"rewards: must be finite, rows {bad} are not; fix the reward function")
    if mask.dtype != torch.bool or mask.ndim != 2 or len(mask) != len(rewards) or mask.shape[1] == 0:
        raise ValueError(f"mask: expected a bool (B={len(rewards)}, T>0) tensor, got {mask.dtype} {tuple(mask.shape)}")
    rows, tokens = (len(rewards),), tuple(mask.shape)
    for name, x, shape in (("group_ids", group_ids, rows), ("episode_ids", episode_ids, rows),
                           ("values", values, tokens), ("kl", kl, tokens)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
        if x is not None and x.requires_grad:  # advantages are constants of the policy-gradient step
            raise ValueError(f"{name}: requires grad; pass {name}.detach()")


def pack_slots(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Plan for packing each row's action tokens to its front, in order: every token's slot (B, T),
    with all non-action tokens sent to one spare slot past the end, and each row's count (B,)."""
    rank = mask.cumsum(1)  # (B, T): 1 + the number of action tokens before this one
    counts = rank[:, -1]  # (B,)
    return torch.where(mask, rank - 1, int(counts.max())), counts


def pack(x: Tensor, slot: Tensor, counts: Tensor) -> Tensor:
    """(B, T) -> (B, Tc), Tc = the longest count: action tokens at the front of each row, zeros after."""
    width = int(counts.max())
    return x.new_zeros(len(x), width + 1).scatter_(1, slot, x)[:, :width]  # drops the spare slot


def unpack(packed: Tensor, slot: Tensor) -> Tensor:
    """(B, Tc) -> (B, T): each action token back at its position, 0 on every other token."""
    return F.pad(packed, (0, 1)).gather(1, slot)  # non-action tokens read the zero spare slot


def packed_rewards(rewards: Tensor, kl: Tensor | None, kl_coef: float, slot: Tensor, counts: Tensor) -> Tensor:
    """Packed token rewards (B, Tc): the row's reward on its last action token, -kl_coef * kl on each one."""
    last = torch.arange(int(counts.max()), device=counts.device) == counts[:, None] - 1  # (B, Tc); none in an empty row
    r = torch.where(last, rewards[:, None], 0.0)  # (B, Tc)
    if kl_coef > 0.0:
        if kl is None:
            raise ValueError("kl: --estimator.kl_coef > 0 needs the per-token kl (B, T); pass it or set the coef to 0")
        r = r - kl_coef * pack(kl, slot, counts)
    return r


def discounted_sum(x: Tensor, discount: float) -> Tensor:
    """S_t = x_t + discount * S_{t+1} along each packed row (B, Tc); zero padding keeps S = 0 past the end.
    Doubling scan: log2(Tc) whole-tensor steps instead of Tc one-column steps (Tc kernel launches on GPU)."""
    s, k = x.clone(), 1  # (B, Tc); invariant: s_t = sum of discount^j * x_{t+j} over j < k
    while k < s.shape[1]:
        s[:, :-k] += discount**k * s[:, k:]  # adds the next k terms, each discounted k steps more
        k *= 2
    return s
