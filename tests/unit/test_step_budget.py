"""The step budget without a model: a simulated engine whose steps cost what a
known cost function says, driven by StepBudget the way BatchRunner drives it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cost_model import StepCostModel, StepShape
from scheduler.step_budget import PREFILL_FLOOR_SHARE, TOKEN_BUDGET_FLOOR, Prefill, StepBudget


@dataclass(frozen=True)
class TrueCost:
    """What a step really costs in the simulation (seconds)."""

    base: float = 0.08
    per_row: float = 0.03
    per_row_kpos: float = 0.05
    per_tok: float = 0.012
    per_tok_kpos: float = 0.006

    def __call__(self, s: StepShape) -> float:
        decode = (
            self.base + self.per_row * s.decode_rows + self.per_row_kpos * s.decode_depth / 1e3
            if s.decode_rows
            else 0.0
        )
        prefill = self.per_tok * s.prefill_tokens + self.per_tok_kpos * s.prefill_depth / 1e3
        return decode + prefill


class KnownCost(StepCostModel):
    """A fake cost model that already knows the true costs (no learning)."""

    def __init__(self, true: TrueCost):
        super().__init__()
        self.true = true

    @property
    def ready(self) -> bool:
        return True

    def decode_s(self, shape: StepShape) -> float:
        return self.true(StepShape(shape.decode_rows, shape.decode_depth))

    def prefill_s(self, shape: StepShape) -> float:
        return self.true(StepShape(0, 0, shape.prefill_tokens, shape.prefill_depth))


@dataclass
class SimRow:
    name: str
    prompt: int  # tokens to prefill
    depth: int = 0  # reused prefix
    stops: tuple[int, ...] = ()  # checkpoints (progress values)
    max_tokens: int = 40
    done: int = 0
    started: bool = False
    waited: int = 0
    generated: int = 0
    first_token_step: int | None = None

    @property
    def prefilling(self) -> bool:
        return self.done < self.prompt - 1

    def view(self) -> Prefill:
        total = self.prompt - 1 - self.done
        stop = next((s for s in (*self.stops, self.prompt - 1) if s > self.done), self.done)
        return Prefill(
            self.name, self.depth + self.done, stop - self.done, total, self.started, self.waited
        )


@dataclass
class Sim:
    """BatchRunner's use of the budget, over rows that cost ``true``."""

    budget: StepBudget
    true: TrueCost
    noise: float = 0.0
    rows: list[SimRow] = field(default_factory=list)
    step_no: int = 0
    times: list[float] = field(default_factory=list)  # true step times, decoders present
    slices: list[int] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    last_prefilled: bool = False

    def join(self, *rows: SimRow) -> None:
        self.rows.extend(rows)

    def step(self) -> None:
        decoding = [r for r in self.rows if r.started and not r.prefilling]
        prefills = [r.view() for r in self.rows if r.prefilling or not r.started]
        depth = sum(r.depth + r.prompt + r.generated for r in decoding)
        plan = self.budget.plan(len(decoding), depth, prefills)
        for name in plan.start:
            next(r for r in self.rows if r.name == name).started = True
        for r in self.rows:
            if not r.started:
                r.waited += 1
        ran = [r for r in self.rows if r.started and r.prefilling and r not in decoding]
        views = [r.view() for r in ran]
        width = min(plan.slice_tokens, max((v.segment_left for v in views), default=0))
        shape = StepShape.padded(width, [v.depth for v in views], len(decoding), depth)
        seconds = self.true(shape) * (1 + self.rng.uniform(-self.noise, self.noise))
        if shape.prefill_tokens or not self.last_prefilled:
            self.budget.observe(shape, seconds)
        self.last_prefilled = shape.prefill_tokens > 0
        if decoding:
            self.times.append(seconds)
        if views:
            self.slices.append(plan.slice_tokens)
        for r, v in zip(ran, views):
            r.done += min(plan.slice_tokens, v.segment_left)
        for r in decoding:
            r.generated += 1
            if r.first_token_step is None:
                r.first_token_step = self.step_no
        self.rows = [r for r in self.rows if r.generated < r.max_tokens]
        self.step_no += 1

    def run_until(self, done, limit: int = 20_000) -> None:
        while not done():
            assert self.step_no < limit, "the simulation did not converge"
            self.step()


def finished(sim: Sim, name: str) -> bool:
    return all(r.name != name for r in sim.rows)


def first_token(sim: Sim, name: str) -> bool:
    row = next((r for r in sim.rows if r.name == name), None)
    return row is None or row.first_token_step is not None


TARGET = 1.0
CHUNK = 512


def budget(true: TrueCost | None = None, target: float = TARGET, rows: int = 8) -> StepBudget:
    return StepBudget(target, CHUNK, rows, cost=KnownCost(true) if true else None)


# -- the policy, with a cost model that knows the costs --------------------------
@pytest.mark.parametrize("joiners", [1, 2, 3, 5, 8])
def test_every_step_stays_within_the_target_under_joins_of_every_size(joiners):
    true = TrueCost()
    sim = Sim(budget(true), true)
    sim.join(*(SimRow(f"d{i}", prompt=64, depth=1500) for i in range(3)))
    sim.run_until(lambda: all(not r.prefilling for r in sim.rows) and sim.step_no > 2)
    rng = random.Random(joiners)
    sim.join(*(SimRow(f"j{i}", prompt=rng.randint(20, 3000), depth=2000) for i in range(joiners)))
    sim.run_until(lambda: all(first_token(sim, f"j{i}") for i in range(joiners)))
    assert max(sim.times) <= TARGET
    # the budget is used, not just respected: most steps that prefilled fill it
    assert sorted(sim.times)[len(sim.times) // 2] > 0.5 * TARGET


@pytest.mark.parametrize("decode_s", [0.95, 1.6])
def test_decode_filling_the_target_still_leaves_prefill_a_quarter_of_it(decode_s):
    """Decode alone at or past the target left joiners the 4-token floor slice:
    a prompt beside deep streams prefilled for minutes (75x the token budget)."""
    true = TrueCost(base=decode_s)
    sim = Sim(budget(true), true)
    sim.join(SimRow("d", prompt=8, max_tokens=10_000))
    sim.run_until(lambda: first_token(sim, "d"))
    sim.slices.clear()
    sim.times.clear()
    sim.join(SimRow("late", prompt=2000, depth=100))
    sim.run_until(lambda: first_token(sim, "late"))
    floor_steps = 2000 // 4  # what the floor slice alone took
    assert min(sim.slices) > 4 and len(sim.slices) < floor_steps / 2
    overshoot = max(sim.times) - true(StepShape(1, 2000))
    assert overshoot <= PREFILL_FLOOR_SHARE * TARGET + 0.02


def test_a_hiccup_does_not_throttle_prefill_for_the_rest_of_a_prompt():
    """One slow decode-only step inflated the decode fit, and with prompts always
    prefilling no decode-only step came to correct it: slices shrank to the floor."""
    true = TrueCost()
    sim = Sim(budget(target=0.5), true)
    sim.join(SimRow("a", prompt=8, max_tokens=10_000), SimRow("b", prompt=8, max_tokens=10_000))
    sim.run_until(lambda: sim.step_no > 40)
    shape = StepShape(2, 100)
    sim.budget.observe(shape, 10.0)  # one 10 s hiccup
    assert sim.budget.cost.decode_s(shape) < 4 * true(shape) + 0.01
    sim.slices.clear()
    sim.join(SimRow("late", prompt=4000))
    sim.run_until(lambda: first_token(sim, "late"))
    assert sorted(sim.slices)[len(sim.slices) // 2] > 8  # not the floor


def test_a_step_never_prefills_more_than_the_token_budget_in_all():
    """A fast backend's time allowed every row a whole chunk: rows x chunk tokens in
    one forward, past the transient reserve boot sizes for one chunk."""
    cheap = TrueCost(base=0.001, per_row=0.0, per_row_kpos=0.0, per_tok=1e-6, per_tok_kpos=0.0)
    joiners = [Prefill(f"j{i}", 0, 5000, 5000, running=False) for i in range(8)]
    plan = budget(cheap).plan(2, 100, joiners)
    assert len(plan.start) == 8 and plan.slice_tokens * 8 <= CHUNK


def test_nothing_decoding_prefills_at_full_chunk():
    plan = budget(TrueCost()).plan(0, 0, [Prefill("a", 0, 5000, 5000, running=False)])
    assert plan.slice_tokens == CHUNK and plan.start == ("a",)
    two = [Prefill(n, 0, 5000, 5000, running=False) for n in "ab"]
    assert budget(TrueCost()).plan(0, 0, two).slice_tokens == CHUNK // 2


def test_zero_target_keeps_the_token_budget():
    b = StepBudget(0.0, CHUNK, 8, cost=KnownCost(TrueCost()))
    rows = [Prefill(str(i), 2000, 5000, 5000, running=False) for i in range(3)]
    plan = b.plan(4, 8000, rows)
    assert plan.slice_tokens == CHUNK // 3 and len(plan.start) == 3 and not plan.budgeted
    many = [Prefill(str(i), 0, 99, 99, running=False) for i in range(64)]
    wide = StepBudget(0.0, CHUNK, 64, cost=KnownCost(TrueCost()))
    assert wide.plan(4, 8000, many).slice_tokens == TOKEN_BUDGET_FLOOR


def test_a_short_prompt_joining_a_long_prefill_is_not_kept_waiting():
    true = TrueCost()
    sim = Sim(budget(true), true)
    sim.join(SimRow("d", prompt=32, depth=1000, max_tokens=10_000))
    sim.run_until(lambda: sim.step_no > 3)
    sim.join(SimRow("long", prompt=4000, depth=2000))
    sim.run_until(lambda: sim.step_no > 10)
    sim.join(SimRow("short", prompt=30, depth=100))
    joined = sim.step_no
    sim.run_until(lambda: first_token(sim, "short"))
    assert sim.step_no - joined <= 8
    assert not first_token(sim, "long")


def test_waiting_rows_start_shortest_first():
    true = TrueCost(base=0.6)  # room for about one row's floor slice at a time
    b = budget(true, rows=8)
    waiting = [
        Prefill("long", 3000, 4000, 4000, running=False),
        Prefill("short", 3000, 12, 12, running=False),
        Prefill("mid", 3000, 400, 400, running=False),
    ]
    plan = b.plan(4, 12_000, waiting)
    assert plan.start[0] == "short"


def test_a_long_prefill_is_not_starved_by_a_stream_of_short_ones():
    true = TrueCost(base=0.6)
    sim = Sim(budget(true, rows=8), true)
    sim.join(*(SimRow(f"d{i}", prompt=16, depth=3000, max_tokens=100_000) for i in range(4)))
    sim.run_until(lambda: sim.step_no > 5)
    sim.join(SimRow("long", prompt=600, depth=3000))
    n = 0
    while not first_token(sim, "long"):
        if sim.step_no % 2 == 0:  # a new short prompt every other step, forever
            sim.join(SimRow(f"s{n}", prompt=10, depth=100, max_tokens=1))
            n += 1
        sim.step()
        assert sim.step_no < 5000, "the long prompt never got its first token"


def test_checkpoints_stop_a_slice_and_the_budget_knows_it():
    """A slice never crosses a checkpoint: the step's shape counts what really runs."""
    b = budget(TrueCost())
    plan = b.plan(2, 4000, [Prefill("a", 1000, 30, 900, running=True)])
    assert plan.shape.prefill_tokens == 30


# -- learning -----------------------------------------------------------------------
def test_the_learned_model_keeps_steps_near_the_target():
    true = TrueCost()
    sim = Sim(StepBudget(TARGET, CHUNK, 8), true, noise=0.1)
    sim.join(SimRow("first", prompt=900))  # nothing decodes: full chunks teach prefill
    sim.run_until(lambda: first_token(sim, "first") and sim.step_no > 6)
    for wave in range(6):
        sim.join(*(SimRow(f"w{wave}-{i}", prompt=700, depth=1200) for i in range(wave % 3 + 1)))
        until = 40 * (wave + 1)
        sim.run_until(lambda: sim.step_no > until)  # noqa: B023 - read at once
    settled = sim.times[len(sim.times) // 3 :]
    assert max(settled) <= TARGET * 1.25  # 10% noise + what is still being learned
    est = sim.budget.cost.estimates()
    assert est.prefill_per_token_ms == pytest.approx(true.per_tok * 1e3, rel=0.35)


@settings(max_examples=40, deadline=None)
@given(
    base=st.floats(0.0, 0.2),
    per_row=st.floats(0.0, 0.1),
    per_kpos=st.floats(0.0, 0.1),
    per_tok=st.floats(0.0005, 0.05),
    per_tok_kpos=st.floats(0.0, 0.02),
    seed=st.integers(0, 1000),
)
def test_the_cost_model_recovers_any_non_negative_costs(
    base, per_row, per_kpos, per_tok, per_tok_kpos, seed
):
    true = TrueCost(base, per_row, per_kpos, per_tok, per_tok_kpos)
    model = StepCostModel()
    rng = random.Random(seed)
    for _ in range(60):
        rows, depth = rng.randint(1, 8), rng.randint(0, 8000)
        model.observe(StepShape(rows, depth * rows), true(StepShape(rows, depth * rows)))
    for _ in range(60):
        tok, d = rng.randint(1, 512), rng.randint(0, 8000)
        s = StepShape(2, 3000, tok, tok * d)
        model.observe(s, true(s))
    for _ in range(20):
        tok, d, rows = rng.randint(1, 512), rng.randint(0, 8000), rng.randint(1, 8)
        s = StepShape(rows, rows * d, tok, tok * d)
        assert model.step_s(s) == pytest.approx(true(s), rel=1e-3, abs=1e-6)
    est = model.estimates()
    assert (
        min(
            est.decode_base_ms,
            est.decode_per_row_ms,
            est.decode_per_row_per_1k_positions_ms,
            est.prefill_per_token_ms,
            est.prefill_per_token_per_1k_positions_ms,
        )
        >= 0
    )


def test_costs_never_fall_with_more_work_even_on_noisy_samples():
    model = StepCostModel()
    rng = random.Random(3)
    for _ in range(200):
        rows = rng.randint(1, 4)
        # a noisy machine: time barely depends on rows, sometimes less with more
        model.observe(StepShape(rows, 1000 * rows), 0.2 + rng.uniform(-0.05, 0.05))
    est = model.estimates()
    assert est.decode_per_row_ms >= 0 and est.decode_per_row_per_1k_positions_ms >= 0
    assert model.decode_s(StepShape(4, 4000)) >= model.decode_s(StepShape(1, 1000)) - 1e-9


def test_a_short_prompt_joins_beside_long_ones_that_fill_the_budget():
    true = TrueCost(base=0.1)
    b = budget(true)
    running = [Prefill(n, 2500, 3000, 3000, running=True) for n in ("long1", "long2")]
    plan = b.plan(3, 7500, [*running, Prefill("long3", 2500, 3000, 3000, running=False)])
    assert plan.start == ()  # no room for a third long prompt's useful slice
    plan = b.plan(3, 7500, [*running, Prefill("short", 100, 20, 20, running=False)])
    assert plan.start == ("short",)


@pytest.mark.parametrize(
    ("given", "engine_ms"), [("auto", None), ("AUTO", None), ("250", 250.0), (0, 0.0)]
)
def test_max_step_ms_setting(given, engine_ms):
    from app.settings import Settings

    value = Settings(_env_file=None, max_step_ms=given).max_step_ms
    assert (None if value == "auto" else float(value)) == engine_ms


def test_a_negative_step_budget_is_refused():
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="max_step_ms must be >= 0"):
        Settings(_env_file=None, max_step_ms=-1)
    with pytest.raises(ValueError):
        StepBudget(-0.5, CHUNK, 4)


def test_the_auto_budget_depends_on_the_backend():
    from engine.boot import step_budget_ms

    assert step_budget_ms(None, "Device(cpu, 0)") == 1000.0
    assert step_budget_ms(None, "Device(gpu, 0)") == 200.0
    assert step_budget_ms(0.0, "Device(gpu, 0)") == 0.0


# -- one left-padded cache per batch: every row attends over the deepest row's KV ------
# mlx-lm holds the prefilling rows in one BatchKVCache and the decoding rows in another
# (BatchKVCache.merge/extend left-pad each row to the longest), so a cold prompt beside a
# warm turn at 100k positions computes attention over 100k positions too.
GPU_LIKE = TrueCost(
    base=0.03, per_row=0.002, per_row_kpos=0.0005, per_tok=0.0002, per_tok_kpos=0.0002 / 30
)


def _padded_truth(true: TrueCost, width: int, depths: list[int]) -> float:
    """What prefilling ``width`` tokens in rows at ``depths`` really costs, priced here
    without StepShape: every row at the deepest row's depth."""
    deepest = max(depths, default=0)
    attended = sum(deepest + t for t in range(1, width + 1)) * len(depths)
    return true.per_tok * width * len(depths) + true.per_tok_kpos * attended / 1e3


def _true_step(true: TrueCost, plan, decode_rows, decode_depth, rows: list[Prefill]) -> float:
    ran = [r for r in rows if r.segment_left > 0 and (r.running or r.key in plan.start)]
    width = min(plan.slice_tokens, max((r.segment_left for r in ran), default=0))
    return true(StepShape(decode_rows, decode_depth)) + _padded_truth(
        true, width, [r.depth for r in ran]
    )


def test_a_warm_turn_prefilling_beside_cold_prompts_stays_within_the_budget():
    """Priced at each row's own depth, 7 cold prompts + 1 warm turn at 100k positions
    were planned at 0.18 s of a 0.2 s budget and ran 0.48 s."""
    b = StepBudget(0.2, CHUNK, 8, cost=KnownCost(GPU_LIKE))
    rows = [Prefill("warm", 100_000, 600, 600, running=False)]
    rows += [Prefill(f"c{i}", 0, 3000, 3000, running=False) for i in range(7)]
    plan = b.plan(1, 2000, rows)
    assert plan.start  # it prefills...
    assert _true_step(GPU_LIKE, plan, 1, 2000, rows) <= 0.2 + 1e-9  # ...within the budget


def test_a_deep_row_waits_outside_a_cold_prefill_batch_until_aging_lets_it_in():
    b = StepBudget(0.2, CHUNK, 8, cost=KnownCost(GPU_LIKE))
    cold = [Prefill(f"c{i}", 500, 3000, 3000, running=True) for i in range(7)]
    warm = Prefill("warm", 300_000, 3000, 3000, running=False)
    assert b.plan(1, 2000, [*cold, warm]).start == ()
    aged = Prefill("warm", 300_000, 3000, 3000, running=False, waited_steps=40)
    new = Prefill("new", 0, 50, 50, running=False)
    assert b.plan(1, 2000, [*cold, aged, new]).start == ()  # first in line, still no room
    assert b.plan(1, 2000, [aged, new]).start[0] == "warm"  # the cold ones done: it goes


def test_the_learner_fits_padded_batches_without_inflating_its_costs():
    """Fitted on each row's own depth, a padded batch's time read as dearer tokens."""
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        d, w = rng.randint(0, 40_000), rng.choice([32, 64, 128, 256])
        s = StepShape.padded(w, [d], 1, 2000)
        model.observe(s, GPU_LIKE(StepShape(1, 2000)) + _padded_truth(GPU_LIKE, w, [d]))
        model.observe(StepShape(1, 2000), GPU_LIKE(StepShape(1, 2000)))
    for _ in range(60):
        w, depths = rng.choice([16, 32, 64]), [0] * 7 + [rng.randint(50_000, 100_000)]
        s = StepShape.padded(w, depths, 1, 2000)
        model.observe(s, GPU_LIKE(StepShape(1, 2000)) + _padded_truth(GPU_LIKE, w, depths))
    est = model.estimates()
    assert est.prefill_per_token_ms == pytest.approx(GPU_LIKE.per_tok * 1e3, rel=0.05)
    assert est.prefill_per_token_per_1k_positions_ms == pytest.approx(
        GPU_LIKE.per_tok_kpos * 1e3, rel=0.05
    )


def test_uniform_depth_batches_are_priced_as_before():
    s = StepShape.padded(64, [3000] * 4, 2, 6000)
    assert s == StepShape(2, 6000, 256, 4 * (64 * 3000 + 64 * 65 // 2))
    assert StepShape.padded(0, []) == StepShape()


# -- a slow first step (kernels compiled, weights first touched) -------------------
class FirstPrefillSlow:
    """The true costs, the first step that prefills ``extra`` seconds slower."""

    def __init__(self, true: TrueCost, extra: float):
        self.true, self.extra, self.first = true, extra, True

    def __call__(self, s: StepShape) -> float:
        slow = self.extra if s.prefill_tokens and self.first else 0.0
        self.first = self.first and not s.prefill_tokens
        return self.true(s) + slow


@pytest.mark.parametrize("extra", [0.0, 30.0])
def test_a_slow_first_prefill_does_not_pin_later_slices_at_the_floor(extra):
    """The first prefill ran the first forward ever: learned uncapped (no sample to
    cap against yet), a +30 s one kept a later 4k prompt at 4-token slices."""
    true = TrueCost(base=0.05, per_row=0.01, per_row_kpos=0.005, per_tok=0.0015, per_tok_kpos=3e-4)
    sim = Sim(StepBudget(1.0, CHUNK, 8), FirstPrefillSlow(true, extra))  # type: ignore[arg-type]
    sim.join(SimRow("a", prompt=30, max_tokens=100_000))
    sim.run_until(lambda: first_token(sim, "a") and sim.step_no > 20)
    sim.slices.clear()
    start = sim.step_no
    sim.join(SimRow("late", prompt=4000))
    sim.run_until(lambda: first_token(sim, "late"))
    assert sorted(sim.slices)[len(sim.slices) // 2] > 100  # not the floor...
    assert sim.step_no - start <= 20  # ...and 4k tokens in a few steps, as with no hiccup


def test_honest_prefill_samples_are_learned_from_the_second():
    true = TrueCost()
    model = StepCostModel()
    shapes = [StepShape.padded(w, [d]) for w, d in ((512, 0), (300, 2000), (64, 9000))]
    for s in shapes:
        model.observe(s, true(s))
    probe = StepShape.padded(100, [5000])
    assert model.ready and model.prefill_s(probe) == pytest.approx(true(probe), rel=1e-3)
