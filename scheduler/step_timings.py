"""What the engine's steps took: plain bucket counts the engine thread fills and
/metrics and /stats read (no prometheus here: observability turns them into
histograms at scrape time)."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

from scheduler.cost_model import CostEstimates
from scheduler.step_budget import StepBudget

# a small model's decode step takes a few milliseconds; a slice of prefill for
# several rows at once can pass 8192 tokens
STEP_SECONDS_BOUNDS = (
    *(0.001, 0.0025, 0.005),
    *(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30, 60),
)
PREFILL_TOKENS_BOUNDS = (
    *(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    *(16384, 32768, 65536),
)


@dataclass(frozen=True)
class Histogram:
    """Counts per bucket: ``counts[i]`` values <= ``bounds[i]`` (and above the
    previous bound); the last count is above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float  # sum of the values observed

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the ``q`` quantile (None: empty;
        inf: above the last bound), as Prometheus' histogram_quantile bounds it."""
        n = self.count
        if n == 0:
            return None
        rank, seen = q * n, 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts):
            seen += c
            if seen >= rank:
                return float(bound)
        return float("inf")


class BucketCounter:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self._counts), self._total)


@dataclass(frozen=True)
class StepReport:
    """The engine's steps for /metrics and /stats."""

    step_seconds: Histogram
    prefill_tokens: Histogram  # prompt tokens per step, steps that prefilled
    max_step_ms: float  # the time budget (0: the token budget, --max-step-ms 0)
    chunk: int  # prompt tokens per row and step when nothing decodes
    last_slice: int  # the slice the last prefilling step chose, per row
    budgeted_steps: int  # steps whose slice the time budget sized
    cost: CostEstimates | None  # the cost model's coefficients (None: no budget)

    def as_dict(self) -> dict[str, object]:
        """The /stats view: quantiles are bucket upper bounds (as Prometheus bounds them)."""

        def quantiles(h: Histogram) -> dict[str, float | None]:
            return {f"p{q}": h.quantile(q / 100) for q in (50, 90, 95, 99)}

        steps = self.step_seconds
        return {
            "max_step_ms": self.max_step_ms,
            "budget": "time" if self.max_step_ms else "tokens",
            "chunk_tokens": self.chunk,
            "steps": steps.count,
            "step_seconds_mean": steps.total / steps.count if steps.count else None,
            "step_seconds_quantiles": quantiles(steps),
            "prefill_steps": self.prefill_tokens.count,
            "prefill_tokens_quantiles": quantiles(self.prefill_tokens),
            "last_slice_tokens": self.last_slice,
            "budgeted_steps": self.budgeted_steps,
            "cost_model": asdict(self.cost) if self.cost else None,
        }


class StepTimings:
    """Filled by the engine thread after every step; read by any thread."""

    def __init__(self, budget: StepBudget | None = None):
        self.budget = budget
        self._seconds = BucketCounter(STEP_SECONDS_BOUNDS)
        self._prefill = BucketCounter(PREFILL_TOKENS_BOUNDS)
        self.last_slice = 0
        self.budgeted_steps = 0

    def record(
        self, seconds: float, prefill_tokens: int, slice_tokens: int, budgeted: bool
    ) -> None:
        self._seconds.observe(seconds)
        if prefill_tokens:
            self._prefill.observe(prefill_tokens)
            self.last_slice = slice_tokens
            self.budgeted_steps += budgeted

    def snapshot(self) -> StepReport:
        budget = self.budget
        return StepReport(
            step_seconds=self._seconds.snapshot(),
            prefill_tokens=self._prefill.snapshot(),
            max_step_ms=budget.max_step_s * 1e3 if budget else 0.0,
            chunk=budget.chunk if budget else 0,
            last_slice=self.last_slice,
            budgeted_steps=self.budgeted_steps,
            cost=budget.cost.estimates() if budget else None,
        )
