"""Per-token log probabilities from the BatchRunner, against mlx-lm's own
``generate_step`` on a tiny random-weight llama: the chosen token's value and
the likeliest alternatives match the reference distribution, rows that did not
ask get nothing, and each token is named by the bytes it adds to the text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engine.batch_runner import BatchRunner
from engine.token_logprobs import Asked, token_logprobs, token_pieces
from scheduler.request import Request, SamplingParams, TokenLogprob

GREEDY = SamplingParams(temperature=0.0)
PROMPT = list(b"Log probabilities, please: ")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load(str(tiny_llama_dir))


def reference(model, n: int) -> list[tuple[int, mx.array]]:
    return [(int(t), lp) for t, lp in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def run(loaded, asks: list[int | None]) -> list[list[TokenLogprob]]:
    model, tokenizer = loaded
    runner = BatchRunner(
        model, tokenizer, max_batch=len(asks), prefill_step_size=64, prefill_batch=len(asks)
    )
    for i, top in enumerate(asks):
        runner.add(
            Request(
                list(PROMPT),
                MAX_TOKENS,
                sampling=GREEDY,
                ignore_eos=True,
                logprobs=top,
                request_id=f"r{i}",
            )
        )
    got: dict[str, list[TokenLogprob]] = {f"r{i}": [] for i in range(len(asks))}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(asks))}
    while runner.active:
        for out in runner.step():
            got[out.request_id].extend(out.logprobs)
            tokens[out.request_id].extend(out.token_ids)
    runner.close()
    for rid, entries in got.items():
        if entries:
            assert [e.chosen.token_id for e in entries] == tokens[rid]
    return [got[f"r{i}"] for i in range(len(asks))]


def test_values_and_alternatives_match_mlx_lms_own_distribution(loaded):
    ref = reference(loaded[0], MAX_TOKENS)
    with_top, bare, chosen_only = run(loaded, [5, None, 0])
    assert bare == []  # a row that did not ask pays nothing and gets nothing
    assert [e.chosen.token_id for e in with_top] == [t for t, _ in ref]
    for entry, (token, logprobs) in zip(with_top, ref):
        assert entry.chosen.logprob == pytest.approx(logprobs[token].item(), abs=1e-4)
        order = sorted(range(logprobs.shape[0]), key=lambda i: -logprobs[i].item())
        assert [t.token_id for t in entry.top] == order[:5]
        assert [t.logprob for t in entry.top] == sorted(
            (t.logprob for t in entry.top), reverse=True
        )
        assert entry.top[0].token_id == token  # greedy: the likeliest was chosen
        assert all(t.logprob <= 0 for t in entry.top)
    assert [e.chosen.token_id for e in chosen_only] == [e.chosen.token_id for e in with_top]
    for a, b in zip(chosen_only, with_top):
        assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)
    assert all(e.top == () for e in chosen_only)


def test_tokens_are_named_by_their_bytes(loaded):
    _, tokenizer = loaded
    piece = token_pieces(tokenizer)
    for token in tokenizer.encode("plain ascii, and é"):  # é: two byte tokens
        text = tokenizer.decode([token])
        if text.isascii():
            assert piece(token) == text.encode()
    assert b"".join(piece(t) for t in tokenizer.encode("é, ü")) == "é, ü".encode()


def test_alternatives_tied_at_the_cut_are_the_lowest_ids():
    """As documented (ties: the lower id first), whichever ids the partition kept:
    a bf16 model's distribution ties often."""
    values = np.full(1000, -20.0, dtype=np.float32)
    values[[3, 10, 500, 700, 900]] = -1.0  # a five-way tie for the top
    rows = mx.array(values)
    mx.eval(rows)
    stream = mx.new_stream(mx.cpu)

    def top(*wanted: int) -> list[list[int]]:
        asked = [Asked(rows, 3, k) for k in wanted]
        return [[c.token_id for c in e.top] for e in token_logprobs(asked, lambda t: b"", stream)]

    assert top(2) == [[3, 10]]
    assert top(1, 3) == [[3], [3, 10, 500]]
    assert top(6) == [[3, 10, 500, 700, 900, 0]]
