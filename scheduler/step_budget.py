"""How many prompt tokens each engine step may prefill: a time budget per step.

A step decodes one token for every running row, then runs a slice of every
joining prompt (one padded batch: every row the same slice, each attending over
the deepest row's KV, so a warm turn beside cold prompts prices them all at its
depth and waits outside their batch while that does not fit). A fixed token
slice at deep context takes seconds on a slow backend and every running stream
stalls for it; here the slice is sized so that the whole step (decode + slice)
stays within ``--max-step-ms``, from a cost model the engine learns as it runs.

- Nothing decoding: nobody is stalled, prefill runs at the full chunk.
- Joining rows share the slice equally (processor sharing), so a short prompt
  finishes in a few steps beside a long one instead of waiting for it.
- Joiners beyond what the budget can give a minimal slice wait outside the
  prefill batch (a row in it advances every step: it cannot be paused); the
  shortest starts first, and one passed over for ``AGING_STEPS`` steps goes
  before any newer one, so a long prompt is never starved.
- ``max_step_s == 0`` keeps the token budget: ``chunk`` tokens a step, shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.cost_model import StepCostModel, StepShape

TOKEN_BUDGET_FLOOR = 16  # per row, the token budget's floor (as before time budgets)
MIN_ROW_SLICE = 4  # per row and step under a time budget: progress for every joiner
PROBE_SLICE = 32  # per step, before the cost model has seen a prefill
# a waiting row joins the prefill batch only if every row could then still take
# this slice within the budget: headroom for the decoders' KV growing meanwhile
# (a row in the batch cannot be paused again)
ADMIT_SLICE = 4 * MIN_ROW_SLICE
SHORT_STEPS = 8  # a prompt done in this many thinnest slices joins as long as those fit
# prefill's share of a step when decode alone leaves less: deep streams past the
# budget left joiners 4 tokens a step (a 10k prompt beside 7 rows at 16k: 75x slower)
PREFILL_FLOOR_SHARE = 0.25
AGING_STEPS = 32  # steps a waiting prompt may be passed over by shorter ones


@dataclass(frozen=True)
class Prefill:
    """A prompt still to prefill, as the budget sees it."""

    key: int  # the runner's id for the row
    depth: int  # KV positions it already holds (reused prefix + prefilled so far)
    segment_left: int  # tokens before its next stop (a checkpoint or the prompt's end)
    total_left: int  # prompt tokens still to run
    running: bool  # in the prefill batch already: it advances every step
    waited_steps: int = 0  # steps it has waited outside the prefill batch


@dataclass(frozen=True)
class SlicePlan:
    """This step's prefill: each prefilling row runs up to ``slice_tokens``."""

    slice_tokens: int
    start: tuple[int, ...] = ()  # waiting rows to start prefilling now, in order
    shape: StepShape = StepShape()  # the step's work as planned (decode + prefill)
    budgeted: bool = False  # sized by the time budget (not the token budget)


def step_shape(
    decode_rows: int, decode_depth: int, rows: Sequence[Prefill], slice_tokens: int
) -> StepShape:
    """The work of a step that decodes ``decode_rows`` and prefills ``rows`` by
    ``slice_tokens`` each (padded to the longest slice any row takes and the
    deepest row); ``decode_depth`` is the decoding rows' ``padded_depth``."""
    ran = [r for r in rows if r.segment_left > 0]  # a row left with its last token decodes it
    width = min(slice_tokens, max((r.segment_left for r in ran), default=0))
    return StepShape.padded(width, [r.depth for r in ran], decode_rows, decode_depth)


class StepBudget:
    """Plans each step's prefill slice; learns step costs from what ran."""

    def __init__(
        self,
        max_step_s: float,
        chunk: int,
        max_rows: int,
        cost: StepCostModel | None = None,
        min_row_slice: int = MIN_ROW_SLICE,
    ):
        if max_step_s < 0:
            raise ValueError("max_step_s must be >= 0")
        self.max_step_s = max_step_s
        self.chunk = chunk
        self.max_rows = max(1, max_rows)
        self.cost = cost or StepCostModel()
        self.min_row_slice = max(1, min(min_row_slice, chunk))
        self._admit_slice = min(chunk, ADMIT_SLICE * self.min_row_slice // MIN_ROW_SLICE)

    def plan(self, decode_rows: int, decode_depth: int, prefills: Sequence[Prefill]) -> SlicePlan:
        if not prefills:  # decode alone: nothing to size (and no solve to pay for)
            return self._done(decode_rows, decode_depth, [], 0, self.chunk, False)
        running = [p for p in prefills if p.running]
        waiting = self._by_priority([p for p in prefills if not p.running])
        free = max(0, self.max_rows - len(running))
        if decode_rows == 0 or self.max_step_s == 0:
            # nobody to keep smooth (or no time budget): the token budget, shared
            rows = running + waiting[:free]
            per_row = self._token_share(len(rows))
            return self._done(decode_rows, decode_depth, rows, len(running), per_row, False)
        if not self.cost.ready:
            rows = running or waiting[: min(free, 1)]  # one prompt teaches the model
            per_row = max(1, PROBE_SLICE // max(1, len(rows)))
            return self._done(decode_rows, decode_depth, rows, len(running), per_row, False)
        room = max(
            self.max_step_s - self.cost.decode_s(StepShape(decode_rows, decode_depth)),
            PREFILL_FLOOR_SHARE * self.max_step_s,
        )
        rows = list(running)
        for candidate in waiting[:free]:
            trial = [*rows, candidate]
            # a short prompt needs only the thinnest slices to finish within a few
            # steps: it joins beside long ones rather than wait for them to finish
            short = candidate.total_left <= SHORT_STEPS * self.min_row_slice
            need = self.min_row_slice if short else self._admit_slice
            if rows and not self._fits(trial, need, room):
                break  # keep the order: the next in line goes first once there is room
            rows = trial
        return self._done(
            decode_rows, decode_depth, rows, len(running), self._widest(rows, room), True
        )

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of ``shape`` took ``seconds``: the cost model learns from it."""
        self.cost.observe(shape, seconds)

    # -- helpers -------------------------------------------------------------
    def _done(
        self,
        decode_rows: int,
        decode_depth: int,
        rows: list[Prefill],
        running: int,
        per_row: int,
        budgeted: bool,
    ) -> SlicePlan:
        per_row = max(1, min(per_row, self.chunk))
        shape = step_shape(decode_rows, decode_depth, rows, per_row)
        return SlicePlan(
            slice_tokens=per_row,
            start=tuple(r.key for r in rows[running:]),
            shape=shape,
            budgeted=budgeted,
        )

    def _token_share(self, rows: int) -> int:
        """Each row's share of the token budget's ``chunk`` (at least its floor)."""
        return max(TOKEN_BUDGET_FLOOR, self.chunk // max(1, rows))

    def _fits(self, rows: list[Prefill], per_row: int, room: float) -> bool:
        """Whether ``rows`` can each prefill ``per_row`` tokens within ``room`` seconds."""
        return self.cost.prefill_s(step_shape(0, 0, rows, per_row)) <= room

    def _widest(self, rows: list[Prefill], room: float) -> int:
        """The largest equal slice whose prefill fits ``room`` (the floor if none does),
        all rows together no more than the token budget's (what boot sizes the
        transient reserve for: a fast backend's time allowed rows x chunk)."""
        lo = self.min_row_slice
        hi = max(lo, self._token_share(len(rows)))
        if not rows or not self._fits(rows, lo, room):
            return lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(rows, mid, room):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _by_priority(waiting: list[Prefill]) -> list[Prefill]:
        """Shortest prompt first; one that has waited ``AGING_STEPS`` steps goes
        before any that has not (oldest first), so a long one is never starved."""
        order = {id(p): i for i, p in enumerate(waiting)}  # arrival order

        def key(p: Prefill) -> tuple[int, int, int]:
            aged = p.waited_steps >= AGING_STEPS
            return (0, -p.waited_steps, order[id(p)]) if aged else (1, p.total_left, order[id(p)])

        return sorted(waiting, key=key)
