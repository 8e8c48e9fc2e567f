"""Eviction-policy benchmark: which entries should a full prefix cache drop?

Replays synthetic agent traffic through the real index (kvcache.index,
no model: an entry's size is its token count) under a tight byte budget and
prints the share of prompt tokens each policy reuses. Traffic: several agents
whose conversations grow turn by turn on top of a few shared system prompts,
interleaved with one-off requests (a quick question, a title generation) that
are never reused and only pollute the cache.

    python bench/bench_eviction.py [--budgets 10000,20000] [--seeds 5] [--noise 0.5,2]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.index import CacheEntry, PrefixIndex  # noqa: E402
from kvcache.prompt_key import PromptKey  # noqa: E402


class LRU(PrefixIndex):
    def eviction_score(self, entry: CacheEntry, now: float) -> float:
        return now - entry.last_used


class LargestFirst(PrefixIndex):
    """Free the most bytes per eviction."""

    def eviction_score(self, entry: CacheEntry, now: float) -> float:
        return entry.length + (now - entry.last_used) * 1e-6


class SeedScore(PrefixIndex):
    """kvwarm's policy: age / (sqrt(length) * log(e + hits))."""


class AgeOverLength(PrefixIndex):
    """The seed score without the frequency term."""

    def eviction_score(self, entry: CacheEntry, now: float) -> float:
        return max(now - entry.last_used, 1e-3) / math.sqrt(max(entry.length, 1))


POLICIES = {
    "lru": LRU,
    "largest-first": LargestFirst,
    "age/len": AgeOverLength,
    "kvwarm": SeedScore,
}


def traffic(seed: int, agents: int = 8, turns: int = 10, noise: float = 0.5):
    """(prompt tokens, reply tokens) in arrival order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(1500)] for _ in range(3)]
    convs = [list(systems[a % len(systems)]) for a in range(agents)]
    for a in range(agents):
        convs[a] += [rng.randrange(1000, 30000) for _ in range(40)]  # the task
    order = [a for a in range(agents) for _ in range(turns)]
    rng.shuffle(order)
    for a in order:
        for _ in range(int(noise) + (rng.random() < noise % 1)):  # one-offs between turns
            yield [rng.randrange(1000, 30000) for _ in range(rng.randint(100, 600))], []
        reply = [rng.randrange(1000, 30000) for _ in range(rng.randint(20, 80))]
        yield list(convs[a]), reply
        convs[a] += reply + [rng.randrange(1000, 30000) for _ in range(rng.randint(100, 400))]


def simulate(policy: type[PrefixIndex], budget: int, seed: int, noise: float) -> float:
    clock = [0.0]
    index = policy(max_bytes=budget, max_entries=10_000, block_size=16, clock=lambda: clock[0])
    reused = total = 0
    for prompt, reply in traffic(seed, noise=noise):
        clock[0] += 1.0
        key = PromptKey.build(prompt)
        hit = index.lookup(key, acquire=False).hit
        reused += hit.reused if hit else 0
        total += len(prompt)
        full = PromptKey.build(prompt + reply)
        index.insert(full, len(full.model_tokens), trimmable=True)
    return reused / total


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budgets", default="10000,15000,20000,30000", help="cache sizes in tokens")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", default="0.5,2.0", help="one-off requests per agent turn")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    for noise in [float(n) for n in args.noise.split(",")]:
        print(
            f"share of prompt tokens reused (median of {args.seeds} seeds): 8 agents x 10 turns "
            f"on 3 shared 1.5k-token system prompts, {noise} one-off requests per turn"
        )
        print(f"  {'policy':<14}" + "".join(f"{f'{b // 1000}k tokens':>12}" for b in budgets))
        for name, policy in POLICIES.items():
            cells = []
            for budget in budgets:
                shares = [simulate(policy, budget, seed, noise) for seed in range(args.seeds)]
                cells.append(f"{statistics.median(shares) * 100:11.1f}%")
            print(f"  {name:<14}" + "".join(cells))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
