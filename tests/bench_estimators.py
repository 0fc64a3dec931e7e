"""Benchmark: estimators.gae against a textbook per-row, per-token Python loop.

Run: python tests/bench_estimators.py  (under 15 s on 2 cores). Not a pytest module: no test_ functions.
Batch B=256 rows, T=8192 tokens, ~30% non-action tokens in runs (tool output) scattered through each row.
First checks that both give the same advantages on a small case (with an empty row), then times both on
the big one, each on one CPU thread.
The loop runs on plain Python floats (the fastest pure-Python form, so the speedup is conservative), on a
few rows only; its time is extrapolated linearly to B rows, and the printed line says so.
Exits non-zero when the two disagree or when ours is not faster.
"""
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from estimators import gae  # noqa: E402

B, T, LOOP_ROWS, GAMMA, LAM = 256, 8192, 32, 0.99, 0.95


def make_batch(b, t, seed, dtype):
    """Rewards (B,), values (B, T), and a mask (B, T) with ~30% of tokens in non-action runs of 1-32."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t, dtype=torch.bool)  # (B, T)
    mask[:, :16] = False  # a prompt
    run_lengths = torch.randint(1, 33, (b, t // 50), generator=g)  # ~0.3 * t gap tokens per row
    starts = torch.randint(16, t, (b, t // 50), generator=g)
    for row in range(b):
        for start, length in zip(starts[row].tolist(), run_lengths[row].tolist()):
            mask[row, start:start + length] = False
    rewards = torch.randn(b, generator=g, dtype=dtype)  # (B,)
    values = torch.randn(b, t, generator=g, dtype=dtype)  # (B, T)
    return rewards, values, mask


def gae_python_loop(rewards, values, mask, gamma, lam):
    """Textbook GAE: for each row, walk the tokens backwards, skipping non-action tokens."""
    out = []
    for reward, row_values, row_mask in zip(rewards, values, mask):
        adv_row = [0.0] * len(row_mask)
        last = max((t for t, m in enumerate(row_mask) if m), default=-1)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(len(row_mask))):
            if not row_mask[t]:
                continue
            r = reward if t == last else 0.0
            delta = r + gamma * next_value - row_values[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = row_values[t]
            adv_row[t] = next_adv
        out.append(adv_row)
    return out


def check_same_result():
    rewards, values, mask = make_batch(8, 300, seed=1, dtype=torch.float64)
    mask[3] = False  # a row without action tokens
    ours, _ = gae(rewards, values, mask, gamma=GAMMA, lam=LAM, whiten=False)
    loop = torch.tensor(gae_python_loop(rewards.tolist(), values.tolist(), mask.tolist(), GAMMA, LAM), dtype=ours.dtype)
    if not torch.allclose(ours, loop, rtol=1e-9, atol=1e-9):
        sys.exit(f"bench_estimators: gae disagrees with the Python loop, "
                 f"max abs diff {(ours - loop).abs().max().item():.3g}")


def best_of(repeats, fn, *args):
    """Fastest of a few runs, in seconds: the least disturbed by other work on a shared machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def time_ours(rewards, values, mask):
    gae(rewards, values, mask, gamma=GAMMA, lam=LAM, whiten=False)  # warm-up: first-call allocations
    return best_of(5, lambda: gae(rewards, values, mask, gamma=GAMMA, lam=LAM, whiten=False))


def time_loop(rewards, values, mask):
    """Seconds for LOOP_ROWS rows (lists prepared outside the timer), scaled linearly to all rows."""
    r, v, m = rewards[:LOOP_ROWS].tolist(), values[:LOOP_ROWS].tolist(), mask[:LOOP_ROWS].tolist()
    return best_of(3, gae_python_loop, r, v, m, GAMMA, LAM) * len(rewards) / LOOP_ROWS


def main():
    torch.set_num_threads(1)  # the Python loop runs on one core, so ours does too; it also avoids thread contention
    check_same_result()
    rewards, values, mask = make_batch(B, T, seed=0, dtype=torch.float32)
    gap_share = 1 - mask.float().mean().item()
    ours, loop = time_ours(rewards, values, mask), time_loop(rewards, values, mask)
    print(f"bench_estimators: gae B={B} T={T} ({gap_share:.0%} non-action tokens) ours {ours:.3f} s, "
          f"python loop {loop:.2f} s (est.: {LOOP_ROWS} rows timed, scaled x{B // LOOP_ROWS}), "
          f"speedup {loop / ours:.0f}x")
    if ours >= loop:
        sys.exit("bench_estimators: ours is not faster than the Python loop")


if __name__ == "__main__":
    main()
