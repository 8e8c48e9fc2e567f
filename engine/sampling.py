"""Per-request samplers and logits processors built from mlx-lm's sample_utils."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
    make_sampler,
)

from engine.penalties import OutputPenalties, RepetitionPenalty
from engine.row_faults import FaultLedger, GuardedSampler
from scheduler.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
# mlx-lm compiles its sampling steps with these values as constants: each distinct
# value is a fresh compile on the engine thread (0.6-0.9 s on the CPU backend, every
# agent's step waiting) and a compiled function kept for good. Clients' values are
# used to 0.01, so at most a few hundred of them can ever exist.
SAMPLING_STEP_DECIMALS = 2
SHARED_SAMPLERS = 64  # unseeded samplers kept for sharing, least recently used dropped


def compiled_values(params: SamplingParams) -> SamplingParams:
    """``params`` with temperature, top_p and min_p rounded to 0.01; a nonzero
    value never rounds to 0 (which would mean greedy or no filter)."""

    def rounded(value: float, floor: float) -> float:
        return max(floor, round(value, SAMPLING_STEP_DECIMALS)) if value > 0 else value

    return replace(
        params,
        temperature=rounded(params.temperature, 0.01),
        top_p=rounded(params.top_p, 0.01),
        min_p=rounded(params.min_p, 0.01),
    )


class SamplerFactory:
    """Builds one sampler per request.

    mlx-lm's GenerationBatch samples the whole batch in one call when every row
    holds the *same* sampler object, so identical unseeded settings share one
    instance. A seeded request gets its own PRNG key chain, which makes its
    tokens independent of what else is in the batch. Every sampler is guarded:
    a fault is recorded in ``ledger`` against the rows holding it.
    """

    def __init__(self, vocab_size: int, ledger: FaultLedger | None = None):
        self.vocab_size = vocab_size
        self.ledger = ledger if ledger is not None else FaultLedger()
        self._shared: OrderedDict[tuple, GuardedSampler] = OrderedDict()

    def _top_k(self, params: SamplingParams) -> int:
        return params.top_k if 0 < params.top_k < self.vocab_size else 0

    def sampler(self, params: SamplingParams) -> GuardedSampler:
        params = compiled_values(params)
        if params.seed is not None and not params.greedy:
            return GuardedSampler(SeededSampler(params, self._top_k(params)), self.ledger)
        key = (
            ("greedy",)
            if params.greedy
            else (params.temperature, params.top_p, params.min_p, self._top_k(params))
        )
        shared = self._shared.get(key)
        if shared is None:
            shared = self._shared[key] = GuardedSampler(self._make(params), self.ledger)
            if len(self._shared) > SHARED_SAMPLERS:
                self._shared.popitem(last=False)  # rows holding it keep it
        self._shared.move_to_end(key)
        return shared

    def _make(self, params: SamplingParams) -> Sampler:
        if params.greedy:
            return greedy_sampler
        return make_sampler(
            params.temperature,
            top_p=params.top_p,
            min_p=params.min_p,
            top_k=self._top_k(params),
        )

    @staticmethod
    def logits_processors(
        params: SamplingParams, prompt_len: int, logprobs: bool = False
    ) -> list[LogitsProcessor]:
        """A row's processors: ``logprobs`` rows normalise in float32 (a bf16
        model's log-softmax came in steps of 0.125 near logit 20), then
        logit_bias (mlx-lm's), then the penalties (``engine.penalties``)."""
        out: list[LogitsProcessor] = [_as_float32] if logprobs else []
        out += make_logits_processors(logit_bias=dict(params.logit_bias) or None)
        if params.repetition_penalty != 1.0:
            out.append(RepetitionPenalty(params.repetition_penalty))
        if params.presence_penalty or params.frequency_penalty:
            out.append(
                OutputPenalties(prompt_len, params.presence_penalty, params.frequency_penalty)
            )
        return out


def _as_float32(tokens: mx.array, logits: mx.array) -> mx.array:
    return logits.astype(mx.float32)


MASK64 = 2**64 - 1


def draw_seed(seed: int, index: int) -> int:
    """The PRNG seed of a seeded row's ``index``-th draw (splitmix64 of the pair):
    a function of the position, not of a key chain the draws advance."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class SeededSampler:
    """A seeded request's sampler. Each token's key comes from the seed and the
    token's index (``drawn``), so a row re-run from its tokens after a batch
    recovery draws exactly what it would have (``rewind``), whatever else the
    batch held or how often it was probed."""

    def __init__(self, params: SamplingParams, top_k: int):
        mx.random.key(params.seed)  # refuses what is not an unsigned 64-bit seed
        self.seed = params.seed
        self.drawn = 0
        self.inv_temp = 1.0 / params.temperature
        self.filters: list[Callable[[mx.array], mx.array]] = []
        if 0 < params.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            self.filters.append(lambda x: apply_min_p(x, params.min_p))
        if top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, top_k))

    def __call__(self, logprobs: mx.array) -> mx.array:
        for f in self.filters:
            logprobs = f(logprobs)
        key = mx.random.key(draw_seed(self.seed, self.drawn))
        self.drawn += 1
        return mx.random.categorical(logprobs * self.inv_temp, key=key)


def rewind(sampler: GuardedSampler, drawn: int, processors: Sequence[Any] = ()) -> None:
    """A row about to re-run after a batch recovery: a seeded sampler's next draw
    is the ``drawn``-th, and the penalties count afresh from the row's context
    (others have no state)."""
    if isinstance(sampler.inner, SeededSampler):
        sampler.inner.drawn = drawn
    for processor in processors:
        inner = getattr(processor, "inner", processor)  # GuardedProcessor
        if isinstance(inner, (OutputPenalties, RepetitionPenalty)):
            inner.restart()
