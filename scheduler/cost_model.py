"""What an engine step costs, learned from the steps the engine runs.

A step decodes one token for each running row and prefills a slice of the
joining prompts. Its time is modelled as

    decode  = base + per_row * rows + per_kpos * (KV positions the rows attend to) / 1000
    prefill = per_ktok * tokens / 1000 + per_ktok_kpos * (tokens x their depth) / 10**6

A row attends over its batch's deepest row, not its own depth: mlx-lm holds the
decoding rows in one BatchKVCache and the prefilling rows in another, and
BatchKVCache.merge/extend left-pad every row to the longest (``padded_depth``).

The decode part is fitted on decode-only steps, the prefill part on the rest of
each step that prefilled (its time minus the predicted decode), each by least
squares with exponential forgetting so the model follows the machine (thermal
throttling, another process) and the KV depths of the traffic. Coefficients are
kept non-negative: a cost never falls with more work. No constants of a backend
are built in; until a part has seen a step it predicts 0 (see ``ready``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

# weight of an observation after each newer one: ~50 steps of memory
FORGETTING = 0.98
RIDGE = 1e-9  # keeps a singular system solvable (an unseen feature stays at 0)
OUTLIER_FACTOR = 4.0  # a sample counts as at most this many times its prediction...
OUTLIER_AFTER = 8  # ...once the part has seen this many samples


def padded_depth(depths: Sequence[int]) -> int:
    """KV positions rows at ``depths`` attend to in one batch, summed: each attends
    over the deepest row's (priced at its own, 7 cold prompts beside a warm turn at
    100k positions ran 2.7x their prediction, and the fit learned inflated costs)."""
    return len(depths) * max(depths, default=0)


@dataclass(frozen=True)
class StepShape:
    """The work of one step, in the cost model's terms."""

    decode_rows: int = 0
    decode_depth: int = 0  # KV positions the decoding rows attend to, summed (padded_depth)
    prefill_tokens: int = 0  # prompt tokens the step runs, batch padding included
    prefill_depth: int = 0  # sum over those tokens of the KV positions they attend to

    @classmethod
    def padded(
        cls, width: int, depths: Sequence[int], decode_rows: int = 0, decode_depth: int = 0
    ) -> StepShape:
        """A step that prefills ``width`` tokens in each of the rows at ``depths``
        (one padded batch: every row as wide as the widest and as deep as the
        deepest), besides its decode."""
        depth = padded_depth(depths) * width + len(depths) * (width * (width + 1) // 2)
        return cls(decode_rows, decode_depth, width * len(depths), depth)

    @property
    def decode_features(self) -> tuple[float, float, float]:
        return (1.0, float(self.decode_rows), self.decode_depth / 1e3)

    @property
    def prefill_features(self) -> tuple[float, float]:
        return (self.prefill_tokens / 1e3, self.prefill_depth / 1e6)


class ForgettingLeastSquares:
    """Non-negative least squares over a few features, older samples fading."""

    def __init__(self, features: int, forgetting: float = FORGETTING):
        self.n = features
        self.forgetting = forgetting
        self._xx = [[0.0] * features for _ in range(features)]
        self._xy = [0.0] * features
        self._yy = 0.0
        self.samples = 0
        self._coef: tuple[float, ...] = (0.0,) * features
        self._stale = False  # samples since the last solve
        # the engine thread observes and plans; /stats reads coef from another
        self._lock = threading.Lock()

    def observe(self, x: tuple[float, ...], y: float) -> None:
        f = self.forgetting
        with self._lock:
            for i in range(self.n):
                self._xy[i] = f * self._xy[i] + x[i] * y
                row = self._xx[i]
                for j in range(self.n):
                    row[j] = f * row[j] + x[i] * x[j]
            self._yy = f * self._yy + y * y
            self.samples += 1
            self._stale = True

    @property
    def coef(self) -> tuple[float, ...]:
        """Solved when read, not per sample: a decode-only step observes but plans
        nothing, and the solve is most of what the model costs the step loop."""
        with self._lock:
            if self._stale:
                self._coef = self._solve()
                self._stale = False
            return self._coef

    def predict(self, x: tuple[float, ...]) -> float:
        return sum(c * v for c, v in zip(self.coef, x))

    def _solve(self) -> tuple[float, ...]:
        """The non-negative fit: the best of the exact fits over feature subsets
        whose coefficients are all >= 0 (at most 7 subsets for 3 features)."""
        best: tuple[float, tuple[float, ...]] | None = None
        for size in range(self.n, 0, -1):
            for subset in combinations(range(self.n), size):
                beta = self._fit(subset)
                if beta is None or min(beta) < 0:
                    continue
                coef = [0.0] * self.n
                for i, b in zip(subset, beta):
                    coef[i] = b
                rss = self._rss(coef)
                if best is None or rss < best[0] - 1e-15:
                    best = (rss, tuple(coef))
        return best[1] if best is not None else (0.0,) * self.n

    def _fit(self, subset: tuple[int, ...]) -> list[float] | None:
        a = [[self._xx[i][j] + (RIDGE if i == j else 0.0) for j in subset] for i in subset]
        b = [self._xy[i] for i in subset]
        return _gauss(a, b)

    def _rss(self, coef: list[float]) -> float:
        fitted = sum(c * self._xy[i] for i, c in enumerate(coef))
        quad = sum(coef[i] * coef[j] * self._xx[i][j] for i in range(self.n) for j in range(self.n))
        return self._yy - 2 * fitted + quad


def _outlier_cap(predicted: float, samples: int) -> float:
    """One hiccup (swap, a compile, another process) counts as at most this much:
    learned in full it inflated the fit for as long as prompts kept prefilling."""
    if samples < OUTLIER_AFTER or predicted <= 0:
        return float("inf")
    return OUTLIER_FACTOR * predicted


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b by Gaussian elimination with partial pivoting (None: singular)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            k = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= k * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class CostEstimates:
    """The model's current coefficients, in milliseconds (for /stats)."""

    decode_base_ms: float
    decode_per_row_ms: float
    decode_per_row_per_1k_positions_ms: float
    prefill_per_token_ms: float
    prefill_per_token_per_1k_positions_ms: float
    decode_samples: int
    prefill_samples: int


class StepCostModel:
    """Predicts a step's seconds from its shape; learns from every step run."""

    def __init__(self, forgetting: float = FORGETTING):
        self._decode = ForgettingLeastSquares(3, forgetting)
        self._prefill = ForgettingLeastSquares(2, forgetting)
        self._prefilled = False  # a prefilling step was observed (the first is not learned)

    @property
    def ready(self) -> bool:
        """The prefill part has learned a step: a slice can be sized (an unseen decode
        part predicts 0 until its first decode-only step, a step later)."""
        return self._prefill.samples > 0

    def decode_s(self, shape: StepShape) -> float:
        return self._decode.predict(shape.decode_features) if shape.decode_rows else 0.0

    def prefill_s(self, shape: StepShape) -> float:
        return self._prefill.predict(shape.prefill_features) if shape.prefill_tokens else 0.0

    def step_s(self, shape: StepShape) -> float:
        return self.decode_s(shape) + self.prefill_s(shape)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.prefill_tokens == 0:
            if shape.decode_rows:
                cap = _outlier_cap(self.decode_s(shape), self._decode.samples)
                self._decode.observe(shape.decode_features, min(seconds, cap))
            return
        decode = self.decode_s(shape)
        if shape.decode_rows and seconds < decode:
            # the whole step ran faster than its decode alone is predicted to: the
            # decode part is stale (decode-only steps are rare while prompts prefill)
            self._decode.observe(shape.decode_features, seconds)
            decode = self.decode_s(shape)
        if not self._prefilled:
            # the first prefilling step runs the engine's first forward (kernels
            # compiled, weights paged in) with nothing yet to cap it against: learned,
            # a +30 s one held a later prompt at 4-token slices for 100+ steps. Not
            # the decode part's first: that step comes after the first forward, and
            # decode-only samples are too rare while prompts prefill to spare one
            self._prefilled = True
            return
        cap = _outlier_cap(self.prefill_s(shape), self._prefill.samples)
        self._prefill.observe(shape.prefill_features, min(max(seconds - decode, 0.0), cap))

    def estimates(self) -> CostEstimates:
        d, p = self._decode.coef, self._prefill.coef
        return CostEstimates(
            decode_base_ms=d[0] * 1e3,
            decode_per_row_ms=d[1] * 1e3,
            decode_per_row_per_1k_positions_ms=d[2] * 1e3,
            prefill_per_token_ms=p[0],  # seconds per 1k tokens = ms per token
            prefill_per_token_per_1k_positions_ms=p[1],
            decode_samples=self._decode.samples,
            prefill_samples=self._prefill.samples,
        )
