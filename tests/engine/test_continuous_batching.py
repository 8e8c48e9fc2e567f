"""Continuous batching must not leak anything between rows.

KVSumModel's next token is a function of the tokens in its own cache row, so a
row that sees a neighbour's KV, a padded slot or a wrong mask diverges at once.
"""

from __future__ import annotations

import random

import pytest

from engine.batch_runner import BatchRunner
from scheduler.request import FinishReason, Request, SamplingParams
from tests.helpers.tiny_models import KVSumModel

GREEDY = SamplingParams(temperature=0.0)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # very different lengths so rows carry different left padding
    return [
        [rng.randrange(1, 200) for _ in range(rng.choice([1, 3, 17, 40, 130, 300]))]
        for _ in range(n)
    ]


def _runner(tokenizer, max_batch=4, prefill_step=64, max_step_s=0.0) -> BatchRunner:
    return BatchRunner(
        KVSumModel(),
        tokenizer,
        max_batch=max_batch,
        prefill_step_size=prefill_step,
        prefill_batch=max_batch,
        max_step_s=max_step_s,
    )


def _run(tokenizer, prompts, max_batch, max_tokens, join_every=0, prefill_step=64, max_step_s=0.0):
    """Drive a BatchRunner; requests join one at a time every ``join_every`` steps."""
    runner = _runner(tokenizer, max_batch, prefill_step, max_step_s)
    reqs = [
        Request(
            list(p), max_tokens=max_tokens[i], sampling=GREEDY, ignore_eos=True, request_id=f"r{i}"
        )
        for i, p in enumerate(prompts)
    ]
    pending = list(reqs)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finish: dict[str, FinishReason] = {}
    step = 0
    while pending or runner.active:
        can_join = max_batch - runner.active
        if pending and can_join > 0 and (join_every == 0 or step % join_every == 0):
            for r in pending[: can_join if join_every == 0 else 1]:
                runner.add(r)
            pending = pending[can_join if join_every == 0 else 1 :]
        for out in runner.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
        step += 1
        assert step < 20_000
    runner.close()
    return tokens, finish


def test_eight_concurrent_rows_match_serial_runs(byte_tokenizer):
    prompts = _prompts(8)
    max_tokens = [40, 25, 60, 33, 48, 12, 70, 21]
    alone, _ = _run(byte_tokenizer, prompts, max_batch=1, max_tokens=max_tokens)
    together, finish = _run(byte_tokenizer, prompts, max_batch=8, max_tokens=max_tokens)
    assert together == alone
    assert all(len(together[f"r{i}"]) == m for i, m in enumerate(max_tokens))
    assert set(finish.values()) == {FinishReason.LENGTH}


@pytest.mark.parametrize("join_every", [1, 3, 7])
def test_rows_joining_mid_decode_and_leaving_early_match(byte_tokenizer, join_every):
    prompts = _prompts(8, seed=join_every)
    max_tokens = [5, 50, 9, 30, 2, 44, 17, 26]
    alone, _ = _run(byte_tokenizer, prompts, max_batch=1, max_tokens=max_tokens)
    staggered, _ = _run(
        byte_tokenizer, prompts, max_batch=8, max_tokens=max_tokens, join_every=join_every
    )
    assert staggered == alone


def test_chunked_prefill_gives_the_same_tokens(byte_tokenizer):
    prompts = _prompts(4, seed=9)
    max_tokens = [20] * 4
    whole, _ = _run(byte_tokenizer, prompts, max_batch=4, max_tokens=max_tokens, prefill_step=4096)
    chunked, _ = _run(byte_tokenizer, prompts, max_batch=4, max_tokens=max_tokens, prefill_step=16)
    assert chunked == whole


@pytest.mark.parametrize("max_step_s", [1e-9, 0.002])
def test_a_time_budget_gives_the_same_tokens(byte_tokenizer, max_step_s):
    """Slices sized by time (the thinnest, or whatever a 2 ms step allows here)
    change when tokens are computed, never which."""
    prompts = _prompts(8, seed=11)
    max_tokens = [30, 8, 45, 12, 60, 5, 22, 37]
    tokens, _ = _run(byte_tokenizer, prompts, max_batch=8, max_tokens=max_tokens, join_every=2)
    timed, _ = _run(
        byte_tokenizer,
        prompts,
        max_batch=8,
        max_tokens=max_tokens,
        join_every=2,
        max_step_s=max_step_s,
    )
    assert timed == tokens


def test_a_time_budget_slices_prefill_only_while_rows_decode(byte_tokenizer):
    runner = _runner(byte_tokenizer, max_step_s=1e-9)
    runner.add(Request([3] * 300, max_tokens=3, sampling=GREEDY, ignore_eos=True, request_id="a"))
    runner.step()
    assert runner.last_step_prefill == 64  # nothing decodes: the full chunk
    while not runner.row("a").generated:
        runner.step()
    runner.add(Request([4] * 300, max_tokens=3, sampling=GREEDY, ignore_eos=True, request_id="b"))
    runner.step()
    assert runner.last_step_prefill == 4  # "a" decodes: the thinnest slice
    while runner.active:
        runner.step()
    report = runner.timings.snapshot()
    assert report.budgeted_steps >= 1 and report.step_seconds.count > 0
    assert report.cost is not None and report.cost.prefill_samples > 0
    runner.close()


def test_fixture_detects_cross_talk(byte_tokenizer):
    """The fixture must be able to fail: a row fed another row's prompt diverges."""
    prompts = _prompts(2, seed=4)
    a, _ = _run(byte_tokenizer, prompts, max_batch=1, max_tokens=[20, 20])
    b, _ = _run(byte_tokenizer, [prompts[0], prompts[0] + [5]], max_batch=1, max_tokens=[20, 20])
    assert a["r1"] != b["r1"]


def test_joining_rows_share_one_prefill_budget_per_step(byte_tokenizer):
    """Four long prompts arriving together must not prefill 4 x budget tokens in
    one step: running decoders would stall for all of it."""
    runner = _runner(byte_tokenizer, max_batch=8)
    runner.add(
        Request([7] * 10, max_tokens=400, sampling=GREEDY, ignore_eos=True, request_id="decoder")
    )
    while not any(o.token_ids for o in runner.step()):
        pass
    for i in range(4):
        runner.add(
            Request(
                [i + 1] * 300, max_tokens=5, sampling=GREEDY, ignore_eos=True, request_id=f"p{i}"
            )
        )
    per_step, decoder_tokens = [], 0
    for _ in range(40):
        outs = runner.step()
        per_step.append(runner.last_step_prefill)
        decoder_tokens += sum(len(o.token_ids) for o in outs if o.request_id == "decoder")
    assert sum(per_step) >= 4 * 299  # every prompt got prefilled...
    assert max(per_step) <= 64  # ...never more than the budget in one step
    assert decoder_tokens == 40  # and the running row produced a token every step
    runner.close()


def test_rows_waiting_for_the_budget_can_leave_and_the_rest_finish(byte_tokenizer):
    """With no room in the budget, joiners wait outside the prefill batch; one that
    leaves (client gone) or is cut short (watchdog) never starts, the others finish."""
    runner = _runner(byte_tokenizer, max_step_s=1e-9)
    runner.add(Request([3] * 10, max_tokens=200, sampling=GREEDY, ignore_eos=True, request_id="d"))
    while not runner.row("d").generated:
        runner.step()
    for name in ("a", "b", "c"):
        runner.add(
            Request([5] * 200, max_tokens=4, sampling=GREEDY, ignore_eos=True, request_id=name)
        )
    runner.step()
    assert runner._waiting.keys() == {"b", "c"}  # one long prompt prefills at a time here
    runner.remove("b")
    cut = runner.cut_short("c")
    assert cut.error_code == "queue_timeout" and cut.completion_tokens == 0  # still queued
    assert runner.active == 2 and not runner._waiting
    done = set()
    while "a" not in done:
        done |= {o.request_id for o in runner.step() if o.finish_reason}
    runner.close()


class _WordHoldingDetokenizer:
    """Holds text until finalize, as SentencePiece's streaming detokeniser holds
    the last word until the next one begins."""

    def __init__(self):
        self.last_segment = ""
        self._held = ""

    def add_token(self, token: int) -> None:
        self._held += chr(token)
        self.last_segment = ""

    def finalize(self) -> None:
        self.last_segment, self._held = self._held, ""


def test_a_watchdog_cut_whose_held_text_completes_a_stop_string_says_stop(byte_tokenizer):
    """The watchdog flushes what the detokeniser held; when that completes a stop
    string the reply stopped there (finish stop, the string named), as a reply
    ending normally would say."""
    from engine.text_output import TextOutput

    runner = _runner(byte_tokenizer)
    runner.add(Request([3] * 5, max_tokens=50, sampling=GREEDY, ignore_eos=True, request_id="s"))
    while not runner.row("s").generated:
        runner.step()
    row = runner.row("s")
    row.text = TextOutput(_WordHoldingDetokenizer(), ("AB",))
    for token in b"xyAB":
        row.text.add_token(token)
    cut = runner.cut_short("s")
    assert cut.text == "xy"
    assert cut.finish_reason is FinishReason.STOP and cut.stop_sequence == "AB"
    assert cut.timed_out


def test_a_watchdog_cut_without_a_stop_string_says_length(byte_tokenizer):
    from engine.text_output import TextOutput

    runner = _runner(byte_tokenizer)
    runner.add(Request([3] * 5, max_tokens=50, sampling=GREEDY, ignore_eos=True, request_id="s"))
    while not runner.row("s").generated:
        runner.step()
    runner.row("s").text = TextOutput(_WordHoldingDetokenizer(), ("AB",))
    for token in b"xyA":
        runner.row("s").text.add_token(token)
    cut = runner.cut_short("s")
    assert cut.text == "xyA"
    assert cut.finish_reason is FinishReason.LENGTH and cut.stop_sequence is None


def test_a_row_the_step_budget_never_started_times_out_as_queued(byte_tokenizer):
    """Admitted but held back by the step budget behind another row's prefill: to
    its client it is still queued, so the watchdog's end is 503 queue_timeout, not
    an empty 200 "length"; a row whose prefill began ends as a running one."""
    runner = _runner(byte_tokenizer, max_step_s=1e-9)
    runner.add(Request([3] * 10, max_tokens=50, sampling=GREEDY, ignore_eos=True, request_id="a"))
    while not runner.row("a").generated:
        runner.step()
    runner.add(Request([4] * 300, max_tokens=3, sampling=GREEDY, ignore_eos=True, request_id="b"))
    runner.step()  # "b" prefills a thin slice per step while "a" decodes
    runner.add(Request([5] * 300, max_tokens=3, sampling=GREEDY, ignore_eos=True, request_id="c"))
    runner.step()
    queued = runner.cut_short("c")
    assert queued is not None and queued.finish_reason is FinishReason.ERROR
    assert queued.error_code == "queue_timeout" and runner.row("c") is None
    started = runner.cut_short("b")
    assert started is not None and started.finish_reason is FinishReason.LENGTH
    assert started.timed_out and started.stats is not None
    runner.close()


def test_time_to_first_token_counts_from_the_body_not_the_queue(byte_tokenizer):
    """The HTTP side stamps when a request's body arrived; parsing, rendering and
    tokenising come before it is queued, and the client waits through them."""
    import time

    runner = _runner(byte_tokenizer)
    request = Request([3] * 10, max_tokens=2, sampling=GREEDY, ignore_eos=True, request_id="a")
    request.received_at = request.arrival_time - 5.0  # five seconds of preparation
    runner.add(request)
    first = None
    while first is None:
        first = next((o.ttft for o in runner.step() if o.ttft is not None), None)
    assert 5.0 <= first < 5.0 + (time.monotonic() - request.arrival_time) + 1e-6
    runner.close()


def test_an_eos_generated_past_with_ignore_eos_adds_no_text(byte_tokenizer):
    """ignore_eos generates past an EOS, and its text ("<|im_end|>") reached the reply."""
    from tests.helpers.tiny_models import ScriptModel

    prompt = byte_tokenizer.encode("PROMPT", add_special_tokens=False)
    (eos,) = byte_tokenizer.eos_token_ids
    words = [byte_tokenizer.encode(w, add_special_tokens=False) for w in ("hi", "yo")]
    runner = BatchRunner(
        ScriptModel([0] * len(prompt) + words[0] + [eos] + words[1]),
        byte_tokenizer,
        max_batch=1,
        prefill_step_size=16,
        prefill_batch=1,
    )
    runner.add(Request(prompt, max_tokens=5, sampling=GREEDY, ignore_eos=True, request_id="a"))
    text, tokens = "", []
    while runner.active:
        for out in runner.step():
            text, tokens = text + out.text, tokens + list(out.token_ids)
    assert eos in tokens and text == "hiyo"


def test_an_eos_as_the_last_token_with_ignore_eos_finishes_by_length(byte_tokenizer):
    """ignore_eos makes an EOS just a token: one drawn as the max_tokens-th was
    reported as "stop" (benchmark clients check for "length")."""
    from tests.helpers.tiny_models import ScriptModel

    prompt = byte_tokenizer.encode("PROMPT", add_special_tokens=False)
    (eos,) = byte_tokenizer.eos_token_ids
    hi = byte_tokenizer.encode("hi", add_special_tokens=False)
    runner = BatchRunner(
        ScriptModel([0] * len(prompt) + hi + [eos, eos]),
        byte_tokenizer,
        max_batch=1,
        prefill_step_size=16,
        prefill_batch=1,
    )
    runner.add(Request(prompt, max_tokens=len(hi) + 1, sampling=GREEDY, ignore_eos=True))
    finals = []
    while runner.active:
        finals += [o for o in runner.step() if o.finish_reason is not None]
    (final,) = finals
    assert final.finish_reason is FinishReason.LENGTH and final.token_ids[-1] == eos


def test_the_cost_model_prices_each_row_at_its_batch_deepest_row(byte_tokenizer):
    """mlx-lm holds the prefilling rows in one left-padded cache and the decoding rows
    in another: every row attends over its batch's deepest row, and the step budget
    plans and learns at that depth (priced alone, a cold prompt beside a warm turn
    was under-predicted by the rows' count)."""
    runner = _runner(byte_tokenizer)  # the token budget: 64 tokens a step, shared
    planned: list[tuple[int, int, dict[str, int]]] = []
    observed = []
    plan, observe = runner.budget.plan, runner.budget.observe

    def spy_plan(rows, depth, prefills):
        made = {n: runner.row(n).generated for n in "ab" if runner.row(n) is not None}
        planned.append((rows, depth, made))
        return plan(rows, depth, prefills)

    def spy_observe(shape, seconds):
        observed.append(shape)
        observe(shape, seconds)

    runner.budget.plan, runner.budget.observe = spy_plan, spy_observe
    runner.add(Request([3] * 300, max_tokens=60, sampling=GREEDY, ignore_eos=True, request_id="a"))
    runner.step()
    runner.step()  # "a" holds 128 positions
    runner.add(Request([4] * 300, max_tokens=9, sampling=GREEDY, ignore_eos=True, request_id="b"))
    runner.step()  # 32 tokens each; "b" at 0 attends over "a"'s 128 too
    assert observed[-1].prefill_tokens == 64
    assert observed[-1].prefill_depth == 2 * (32 * 128 + 32 * 33 // 2)
    while runner.row("b") is not None and not runner.row("b").generated:
        runner.step()
    runner.step()
    rows, depth, made = planned[-1]
    assert rows == 2 and made["a"] > made["b"]  # "a" is deeper by the tokens it made
    assert depth == 2 * (300 + made["a"])
    while runner.active:
        runner.step()
    runner.close()
