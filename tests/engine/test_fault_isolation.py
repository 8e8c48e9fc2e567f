"""A row that raises in the engine fails alone; the batch goes on for the others.

The HTTP boundary refuses the inputs that used to reach the engine; these tests
hand the runner bad rows directly (as a future bug would) and check that the
other rows' tokens are exactly what they would have been without the bad one.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import pytest

from engine.batch_runner import BatchRunner, EngineFault
from scheduler.request import FinishReason, Request, SamplingParams
from tests.helpers.tiny_models import KVSumModel

GREEDY = SamplingParams(temperature=0.0)
POISON = 77  # a prompt token the poisoned model cannot take


class PoisonedModel(KVSumModel):
    """Raises inside the forward pass whenever ``POISON`` is among its inputs:
    a fault BatchGenerator cannot attribute to any row."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        if self.always or POISON in inputs.tolist()[0] or any(POISON in r for r in inputs.tolist()):
            raise RuntimeError("poisoned input")
        return super().__call__(inputs, cache=cache, **kw)


def good_requests(n: int = 3) -> list[Request]:
    return [
        Request(
            [5 + i, 9, 13 + 2 * i] * (i + 1),
            max_tokens=12 + i,
            sampling=GREEDY,
            ignore_eos=True,
            request_id=f"good{i}",
        )
        for i in range(n)
    ]


def drive(runner: BatchRunner, requests: list[Request]) -> dict[str, list]:
    """Run to completion; per request (and any added before): its outputs."""
    for r in requests:
        runner.add(r)
    seen: dict[str, list] = {}
    for _ in range(500):
        if not runner.active:
            break
        for out in runner.step():
            seen.setdefault(out.request_id, []).append(out)
    assert not runner.active
    return seen


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def make_runner(tokenizer, model=None) -> BatchRunner:
    return BatchRunner(
        model or KVSumModel(), tokenizer, max_batch=4, prefill_step_size=8, prefill_batch=4
    )


@pytest.fixture
def alone(byte_tokenizer):
    return drive(make_runner(byte_tokenizer), good_requests())


def boom(*_):
    raise ValueError("this row's callable is broken")


def break_sampler(row):
    row.sampler.inner = boom


def break_processor(row):
    row.processors[0].inner = boom


def break_once(row):
    """The row's processor raises on its next call only: no probe meets it again."""
    guarded = row.processors[0]
    inner = guarded.inner

    def once(*args):
        guarded.inner = inner
        boom()

    guarded.inner = once


@pytest.mark.parametrize(
    "params, breaks",
    [
        (SamplingParams(temperature=0.7), break_sampler),  # a sampler rows may share
        (SamplingParams(temperature=0.7, seed=3), break_sampler),  # a row's own seeded one
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), break_processor),
    ],
    ids=["shared-sampler", "seeded-sampler", "logits-processor"],
)
def test_a_faulty_row_fails_alone_and_the_others_are_untouched(
    byte_tokenizer, alone, params, breaks
):
    runner = make_runner(byte_tokenizer)
    rogue = Request([3, 4, 5], max_tokens=20, sampling=params, ignore_eos=True, request_id="rogue")
    runner.add(rogue)
    breaks(runner.row("rogue"))
    seen = drive(runner, good_requests())
    seen_rogue = seen.pop("rogue", None)
    final = seen_rogue[-1] if seen_rogue else None
    assert final is not None and final.finish_reason is FinishReason.ERROR
    assert final.error_code == "engine_error" and "this row's callable is broken" in final.error
    for rid, outs in alone.items():
        assert tokens(seen[rid]) == tokens(outs)
        assert seen[rid][-1].finish_reason is FinishReason.LENGTH
    assert runner.row_faults == 1 and runner.recoveries == 0


def test_a_detokeniser_fault_fails_only_its_row(byte_tokenizer, alone):
    runner = make_runner(byte_tokenizer)
    requests = good_requests()
    for r in requests:
        runner.add(r)
    row = runner.row("good1")

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")

    row.text.add_token = broken
    seen = {r.request_id: [] for r in requests}
    while runner.active:
        for out in runner.step():
            seen[out.request_id].append(out)
    assert seen["good1"][-1].finish_reason is FinishReason.ERROR
    for rid in ("good0", "good2"):
        assert tokens(seen[rid]) == tokens(alone[rid])


def test_an_unattributed_step_fault_rebuilds_the_batch_and_fails_only_the_culprit(
    byte_tokenizer, alone
):
    runner = make_runner(byte_tokenizer, PoisonedModel())
    rogue = Request([3, POISON, 5], max_tokens=9, sampling=GREEDY, request_id="rogue")
    seen = drive(runner, [*good_requests(), rogue])
    assert seen["rogue"][-1].finish_reason is FinishReason.ERROR
    assert "poisoned input" in seen["rogue"][-1].error
    for rid, outs in alone.items():
        assert tokens(seen[rid]) == tokens(outs)  # re-admitted, same greedy tokens
    assert runner.recoveries >= 1 and runner.row_faults == 1


def test_a_fault_that_is_no_rows_kills_the_engine(byte_tokenizer):
    runner = make_runner(byte_tokenizer, PoisonedModel(always=True))
    for r in good_requests(2):
        runner.add(r)
    with pytest.raises(EngineFault):
        for _ in range(20):
            runner.step()


def test_a_model_that_breaks_under_a_stream_of_requests_ends_the_engine(byte_tokenizer):
    """A recovery that blames the newest row checks the model still runs first:
    every forward failing, each recovery blamed one newcomer and replayed the rest,
    and with requests arriving the engine never said it was dead (each new request
    failed, /health stayed ok)."""
    model = PoisonedModel()
    runner = make_runner(byte_tokenizer, model)
    for r in good_requests():
        runner.add(r)
    for _ in range(3):
        runner.step()
    model.always = True
    with pytest.raises(EngineFault, match="no longer runs"):
        for i in range(12):
            runner.add(Request([5, 9, 13], 30, sampling=GREEDY, request_id=f"new{i}"))
            runner.step()


class BatchOnlyFault(KVSumModel):
    """Fails only when two rows or more decode together (the full batch's
    allocation, say): every row's probe alone passes."""

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        if inputs.shape[0] >= 2 and inputs.shape[1] == 1:
            raise RuntimeError("[malloc] Unable to allocate (batch too big)")
        return super().__call__(inputs, cache=cache, **kw)


def test_a_fault_only_the_whole_batch_meets_is_no_endless_rebuild(byte_tokenizer):
    """The recovery count was reset by any good step, and the re-admitted rows'
    prefills are good steps: the batch was rebuilt for ever, nothing generated and
    nothing failed, /health still ok."""
    runner = make_runner(byte_tokenizer, BatchOnlyFault())
    for r in good_requests(2):
        runner.add(r)
    with pytest.raises(EngineFault, match="keeps failing"):
        for _ in range(300):
            runner.step()
    assert runner.recoveries <= 5


def test_a_client_retrying_a_poisoned_request_never_takes_the_engine_down(byte_tokenizer):
    """Each recovery that finds its culprit is over: the count of recoveries in a
    row only grows while no probe attributes the fault. It grew until the re-admitted
    rows had decoded again, so four retries of one bad request during a long replay
    raised EngineFault and failed every agent's request."""
    alone = drive(make_runner(byte_tokenizer), [_long_request()])
    runner = make_runner(byte_tokenizer, PoisonedModel())
    runner.add(_long_request())
    seen: dict[str, list] = {}
    added = 0
    for step in range(400):
        if not runner.active:
            break
        victim = runner.row("victim")
        if added < 6 and step % 3 == 0 and victim is not None and victim.generated:
            runner.add(Request([3, POISON, 5], 5, sampling=GREEDY, request_id=f"rogue{added}"))
            added += 1
        for out in runner.step():
            seen.setdefault(out.request_id, []).append(out)
    rogues = [rid for rid in seen if rid.startswith("rogue")]
    assert len(rogues) == 6 and runner.recoveries == 6
    assert all(seen[rid][-1].finish_reason is FinishReason.ERROR for rid in rogues)
    assert tokens(seen["victim"]) == tokens(alone["victim"])


def _long_request() -> Request:
    return Request(
        [5, 9, 13] * 60, max_tokens=40, sampling=GREEDY, ignore_eos=True, request_id="victim"
    )


class CountingPoisonedModel(PoisonedModel):
    def __init__(self):
        super().__init__()
        self.positions = 0  # prompt positions run through the model, every row

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        out = super().__call__(inputs, cache=cache, **kw)
        self.positions += inputs.size
        return out


def test_a_recovery_that_finds_the_newcomer_at_fault_replays_the_others_once(byte_tokenizer):
    """The request that joined last is probed first, and once a probe finds the
    culprit the others are re-admitted unprobed: each bystander's whole context was
    prefilled twice (a probe, then the replay), stalling every agent for minutes
    at 10k-token contexts."""
    clean = CountingPoisonedModel()
    drive(make_runner(byte_tokenizer, clean), [_long_request()])
    model = CountingPoisonedModel()
    runner = make_runner(byte_tokenizer, model)
    runner.add(_long_request())
    while not runner.row("victim").generated:
        runner.step()
    runner.add(Request([3, POISON, 5], 5, sampling=GREEDY, request_id="rogue"))
    seen = drive(runner, [])
    assert seen["rogue"][-1].finish_reason is FinishReason.ERROR
    assert runner.recoveries == 1
    # one replay of the victim's prompt and what it had generated, not two
    assert model.positions - clean.positions < 180 + 40


def test_a_row_a_stop_string_ends_whose_kv_copy_fails_still_ends_alone(
    byte_tokenizer, alone, monkeypatch
):
    """Taking such a row out of the batch copies its KV for the prefix cache, outside
    any row's guard: a copy that failed (out of memory) escaped the step and took
    the engine down for every request. The reply is delivered already: the KV is
    not kept, the row leaves, the others go on."""
    from mlx_lm.generate import BatchGenerator

    from engine import batch_runner

    def no_memory(self, uids):
        raise RuntimeError("[malloc] Unable to allocate")

    class NoStore:
        def release(self, *_):
            pass

        def poll(self):
            pass

    monkeypatch.setattr(BatchGenerator, "extract_cache", no_memory)
    monkeypatch.setattr(batch_runner.row_kv, "store_final", lambda *a, **k: None)
    runner = BatchRunner(
        KVSumModel(),
        byte_tokenizer,
        max_batch=4,
        prefill_step_size=8,
        prefill_batch=4,
        prefix_cache=NoStore(),
    )
    requests = good_requests()
    requests[0].stop = ["T"]  # it writes "\nT..."
    seen = drive(runner, requests)
    assert seen["good0"][-1].finish_reason is FinishReason.STOP
    for rid in ("good1", "good2"):
        assert tokens(seen[rid]) == tokens(alone[rid])


@pytest.mark.parametrize("recoverable", [True, False])
def test_a_stopped_row_the_batch_cannot_let_go_of_is_a_step_fault(
    byte_tokenizer, alone, monkeypatch, recoverable
):
    """Rebuilt where a batch may be; in a rank group (not recoverable: every rank's
    batch must stay alike) it ends the engine, as any step fault there does. A row
    that faulted in that same step fails: the rebuild re-admitted it (a fault its
    probe does not meet again, it went on as if nothing had happened)."""
    from mlx_lm.generate import BatchGenerator

    def broken(self, uids, return_prompt_caches=False):
        raise RuntimeError("filter failed")

    monkeypatch.setattr(BatchGenerator, "remove", broken)
    runner = make_runner(byte_tokenizer)
    runner.recoverable = recoverable
    requests = good_requests()
    requests[0].stop = ["T"]  # it writes "\nT...": its second token, on the fourth step
    requests[2].sampling = SamplingParams(temperature=0.0, repetition_penalty=1.01)
    if not recoverable:
        with pytest.raises(EngineFault, match="filter failed"):
            drive(runner, requests)
        return
    for r in requests:
        runner.add(r)
    seen: dict[str, list] = {}
    for step in range(30):
        if step == 3:  # the step good0 stops in: good2's processor breaks in it too
            break_once(runner.row("good2"))
        for out in runner.step():
            seen.setdefault(out.request_id, []).append(out)
        if runner.recoveries:
            break
    assert runner.recoveries == 1
    assert seen["good0"][-1].finish_reason is FinishReason.STOP  # answered, not failed
    assert seen["good2"][-1].finish_reason is FinishReason.ERROR
    assert [r.request.request_id for r in runner._rows.values()] == ["good1"]  # noqa: SLF001


class FlatPoisonedModel(PoisonedModel):
    """Nearly uniform logits: what a seeded row draws is pure chance."""

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        return super().__call__(inputs, cache=cache, **kw) * 0.001


def _through_recovery(tokenizer, params: SamplingParams, rogue_at: int | None) -> list[int]:
    """One row's 30 tokens, with a poisoned request joining at step ``rogue_at``
    (one recovery then) or never."""
    runner = make_runner(tokenizer, FlatPoisonedModel())
    runner.add(Request([5, 6, 7], 30, sampling=params, ignore_eos=True, request_id="s"))
    got: list[int] = []
    for step in range(200):
        if not runner.active:
            break
        if step == rogue_at:
            runner.add(Request([3, POISON, 5], 5, sampling=GREEDY, request_id="rogue"))
        got += [t for o in runner.step() if o.request_id == "s" for t in o.token_ids]
    assert runner.recoveries == (0 if rogue_at is None else 1)
    return got


def test_a_seeded_row_draws_the_same_tokens_through_a_recovery(byte_tokenizer):
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _through_recovery(byte_tokenizer, seeded, None)
    assert len(alone) == 30 and len(set(alone)) > 5  # really sampled
    # the probe and the lost step drew nothing of its own
    assert _through_recovery(byte_tokenizer, seeded, rogue_at=5) == alone


def test_a_penalised_row_generates_the_same_tokens_through_a_recovery(byte_tokenizer):
    """The probe and the lost step run a row's penalty processors on tokens it never
    keeps; re-admitted, its counts start again from its own context."""
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.002, presence_penalty=0.001)
    alone = _through_recovery(byte_tokenizer, penalised, None)
    assert len(alone) == 30 and len(set(alone)) > 5  # the penalties steer it
    assert _through_recovery(byte_tokenizer, penalised, rogue_at=5) == alone


def test_the_failed_batch_is_freed_before_its_rows_are_probed(byte_tokenizer):
    """The fault's traceback kept the failed generator (and every row's KV) alive
    through the probes and replays: the whole batch's memory beside the new one's."""
    import gc
    import weakref

    runner = make_runner(byte_tokenizer, PoisonedModel())
    failed: list[weakref.ref] = []  # every batch that failed (the first, then the replay)
    alive_during_probe: list[bool] = []
    probe, drop = runner._probe, runner._drop_generator  # noqa: SLF001

    def dropping(exc):
        failed.append(weakref.ref(runner._generator))  # noqa: SLF001
        drop(exc)

    def watched(row):
        gc.collect()
        alive_during_probe.append(any(ref() is not None for ref in failed))
        return probe(row)

    runner._probe, runner._drop_generator = watched, dropping  # noqa: SLF001
    rogue = Request([3, POISON, 5], max_tokens=9, sampling=GREEDY, request_id="rogue")
    drive(runner, [*good_requests(), rogue])
    assert len(failed) == 2 and alive_during_probe and not any(alive_during_probe)


def _asking(n: int = 3) -> list[Request]:
    return [
        Request(
            [5 + i, 9, 13 + 2 * i] * (3 + i),
            max_tokens=6,
            sampling=GREEDY,
            ignore_eos=True,
            logprobs=2,
            request_id=f"lp{i}",
        )
        for i in range(n)
    ]


def test_a_row_whose_logprobs_cannot_be_read_fails_alone(byte_tokenizer):
    """The rows asking for log probabilities are read together; one row's failure
    there (its token's piece cannot be named) failed every row asking in that step,
    though each of the others, alone, finishes."""
    from engine.token_logprobs import TokenPieces

    clean = drive(make_runner(byte_tokenizer), _asking())
    bad = tokens(clean["lp0"])[2]
    assert all(bad not in tokens(clean[rid]) for rid in ("lp1", "lp2"))
    runner = make_runner(byte_tokenizer)
    pieces = runner._pieces  # noqa: SLF001

    def later(token: int) -> bytes:
        if token == bad:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "no piece for this token")
        return pieces.later(token)

    runner._pieces = TokenPieces(later, later)  # noqa: SLF001
    seen = drive(runner, _asking())
    assert seen["lp0"][-1].finish_reason is FinishReason.ERROR
    assert "no piece for this token" in seen["lp0"][-1].error
    for rid in ("lp1", "lp2"):
        assert seen[rid][-1].finish_reason is FinishReason.LENGTH
        assert tokens(seen[rid]) == tokens(clean[rid])
        got = [e for o in seen[rid] for e in o.logprobs]
        assert got == [e for o in clean[rid] for e in o.logprobs]
    assert runner.row_faults == 1


class FlakyModel(KVSumModel):
    """Raises on the forward calls numbered in ``fail_at`` only (a device hiccup, a
    passing out-of-memory): no row's fault. Counts the positions it runs."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.positions = 0
        self.fail_at: set[int] = set()

    def __call__(self, inputs: mx.array, cache=None, **kw) -> mx.array:
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError("[metal::Device] command buffer failed")
        self.positions += inputs.size
        return super().__call__(inputs, cache=cache, **kw)


def _long_rows() -> list[Request]:
    return [
        Request(
            [5 + i, 9, 13] * 200,
            max_tokens=40,
            sampling=GREEDY,
            ignore_eos=True,
            request_id=f"long{i}",
        )
        for i in range(4)
    ]


def _with_faults(
    tokenizer, faults: int, progress: Callable[[], None] | None = None
) -> tuple[FlakyModel, BatchRunner, dict, int]:
    """The long rows run to the end, ``faults`` forward calls in a row failing once
    every row decodes; also the batch's context (prompts and replies) at the fault."""
    model = FlakyModel()
    runner = make_runner(tokenizer, model)
    if progress is not None:
        runner.progress = progress
    for r in _long_rows():
        runner.add(r)
    seen: dict[str, list] = {}
    context = 0
    while runner.active:
        rows = list(runner._rows.values())  # noqa: SLF001
        if not context and len(rows) == 4 and all(r.generated >= 5 for r in rows):
            context = sum(len(r.request.prompt_tokens) + r.generated for r in rows)
            model.fail_at = set(range(model.calls + 1, model.calls + 1 + faults))
        for out in runner.step():
            seen.setdefault(out.request_id, []).append(out)
    assert context
    return model, runner, seen, context


def test_a_transient_fault_costs_one_replay_of_the_batch(byte_tokenizer):
    """A fault no row owns was met by probing every row alone with its whole
    context, one after the other, then replaying them all: 1.8x the batch's context
    run again, no stream getting a token meanwhile. The rows are replayed together
    first; only a fault that comes back then is looked for row by row."""
    clean = FlakyModel()
    alone = drive(make_runner(byte_tokenizer, clean), _long_rows())
    model, runner, seen, context = _with_faults(byte_tokenizer, 1)
    assert runner.recoveries == 1 and runner.row_faults == 0
    for rid, outs in alone.items():
        assert tokens(seen[rid]) == tokens(outs)
    assert model.positions - clean.positions <= context


def test_a_recovery_notes_its_progress_for_each_row_it_probes_or_replays(byte_tokenizer):
    """Probes and replays run inside one engine step: unnoted, a recovery of a few
    long rows read as a hung step (/health 503 stalled, --request-timeout ending the
    rows it was saving). A replay notes each of the 4 rows; one that faults again
    notes each row probed and each replayed again."""
    once: list[int] = []
    _with_faults(byte_tokenizer, 1, lambda: once.append(1))
    twice: list[int] = []
    _with_faults(byte_tokenizer, 2, lambda: twice.append(1))
    assert (len(once), len(twice)) == (4, 4 + 4 + 4)


def test_a_fault_that_comes_back_in_the_replay_but_is_no_rows_fails_nobody(byte_tokenizer):
    """Faulting again during the replay, the rows are probed; none faults alone: all
    are replayed again, and the recovery (one) ends once they decode together."""
    alone = drive(make_runner(byte_tokenizer), _long_rows())
    _, runner, seen, _ = _with_faults(byte_tokenizer, 2)
    assert runner.recoveries == 1 and runner.row_faults == 0
    for rid, outs in alone.items():
        assert tokens(seen[rid]) == tokens(outs)
