"""Per-row fault capture for a shared batch step.

mlx-lm's BatchGenerator calls each row's logits processors and sampler inside
one step for the whole batch; one raising would abort the step for every row.
The runner hands BatchGenerator guarded versions instead: a fault is recorded
against the row (or against every row sharing the sampler), the call returns a
neutral value so the step completes for the others, and the runner then fails
the recorded rows alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

log = logging.getLogger("kvwarm.engine")

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class FaultLedger:
    """Faults raised by per-row callables since the runner last collected them."""

    by_row: dict[str, str] = field(default_factory=dict)  # request id -> error
    by_sampler: dict[int, str] = field(default_factory=dict)  # shared sampler id -> error

    def record_row(self, request_id: str, exc: BaseException) -> None:
        self.by_row.setdefault(request_id, f"{type(exc).__name__}: {exc}")

    def record_sampler(self, sampler_id: int, exc: BaseException) -> None:
        self.by_sampler.setdefault(sampler_id, f"{type(exc).__name__}: {exc}")

    def __bool__(self) -> bool:
        return bool(self.by_row or self.by_sampler)

    def clear(self) -> None:
        self.by_row.clear()
        self.by_sampler.clear()


class GuardedProcessor:
    """One row's logits processor; on a fault the logits pass through unchanged."""

    def __init__(self, inner: LogitsProcessor, request_id: str, ledger: FaultLedger):
        self.inner = inner
        self.request_id = request_id
        self.ledger = ledger

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return self.inner(tokens, logits)
        except Exception as exc:  # noqa: BLE001 - attributed to this row
            self.ledger.record_row(self.request_id, exc)
            return logits


class GuardedSampler:
    """A sampler, possibly shared by rows with equal settings (BatchGenerator
    samples the whole batch in one call when every row holds the same object).
    A fault is recorded against the sampler: every row holding it has the same
    settings, so every one of them would raise alike. The faulty step's tokens
    come from argmax and are discarded with the rows."""

    def __init__(self, inner: Sampler, ledger: FaultLedger):
        self.inner = inner
        self.ledger = ledger

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self.inner(logprobs)
        except Exception as exc:  # noqa: BLE001 - attributed to the rows holding it
            self.ledger.record_sampler(id(self), exc)
            return mx.argmax(logprobs, axis=-1)
