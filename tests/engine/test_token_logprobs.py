"""Per-token log probabilities from the BatchRunner, against mlx-lm's own
``generate_step`` on a tiny random-weight llama: the chosen token's value and
the likeliest alternatives match the reference distribution, rows that did not
ask get nothing, and each token is named by the bytes it adds to the text."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import _byte_decoder

from app.logprobs_format import CompletionLogprobs, chat_logprobs
from engine.batch_runner import BatchRunner
from engine.fast_detok import detokenizer_factory
from engine.text_output import TextOutput
from engine.token_logprobs import Asked, TokenPieces, token_logprobs, token_pieces
from scheduler.request import Request, SamplingParams, TokenChoice, TokenLogprob
from tests.helpers.tiny_models import METASPACE_WORDS, ScriptModel

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
    piece = token_pieces(tokenizer).later
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
        empty = TokenPieces(lambda t: b"", lambda t: b"")
        return [[c.token_id for c in e.top] for e in token_logprobs(asked, empty, stream)]

    assert top(2) == [[3, 10]]
    assert top(1, 3) == [[3], [3, 10, 500]]
    assert top(6) == [[3, 10, 500, 700, 900, 0]]


# Tokenizers mlx-lm reads by decoding (neither byte-level BPE nor SentencePiece):
# each token is named by the bytes it adds to the text engine.window_detok streams,
# so the pieces rebuild the reply and legacy completions' offsets point into it.


def pieces_of(tokenizer, tokens: list[int], trim: bool = True) -> list[bytes]:
    """The chosen tokens' pieces as the runner names them, a reply's first marked
    (where its text drops the space before it)."""
    zeros = mx.zeros(len(tokenizer))
    asked = [Asked(zeros, t, 0, first=trim and i == 0) for i, t in enumerate(tokens)]
    stream = mx.new_stream(mx.cpu)
    return [e.chosen.piece for e in token_logprobs(asked, token_pieces(tokenizer), stream)]


def streamed(tokenizer, tokens: list[int], trim: bool = False) -> str:
    out = TextOutput(detokenizer_factory(tokenizer)(), (), trim_leading_space=trim)
    return "".join(out.add_token(t) for t in tokens) + out.finish()


def assert_offsets_point_at_the_tokens(tokens: list[int], pieces: list[bytes], text: str):
    entries = [TokenLogprob(TokenChoice(t, -0.1, p)) for t, p in zip(tokens, pieces)]
    arrays = CompletionLogprobs().take(entries)
    for key, offset in zip(arrays["tokens"], arrays["text_offset"]):
        if not key.startswith("bytes:"):
            assert text[offset : offset + len(key)] == key


def test_a_character_split_over_byte_tokens_is_named_by_its_bytes(naive_bytes):
    """Each byte token decoded alone was U+FFFD: "日本" gave six EF BF BD pieces."""
    tokens = naive_bytes.encode("日本", add_special_tokens=False)
    assert b"".join(pieces_of(naive_bytes, tokens)) == "日本".encode()


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list(" \nab,.é€😀\ufffd日")), max_size=40))
def test_byte_token_pieces_rebuild_the_text(naive_bytes, text):
    tokens = naive_bytes.encode(text, add_special_tokens=False)
    pieces, whole = pieces_of(naive_bytes, tokens), streamed(naive_bytes, tokens)
    assert b"".join(pieces) == whole.encode()
    assert_offsets_point_at_the_tokens(tokens, pieces, whole)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=30))
def test_invalid_utf8_pieces_decode_to_the_text(naive_bytes, data):
    """Bytes that are no character: the text has U+FFFD where the pieces have the
    bytes themselves (all a token adds), and decoding those gives the text (but a
    character the reply ends inside, which the text drops: engine.utf8_tail)."""
    from engine.utf8_tail import complete_text

    names = {b: c for c, b in _byte_decoder().items()}  # the vocabulary names bytes so
    tokens = naive_bytes.convert_tokens_to_ids([names[b] for b in data])
    joined = b"".join(pieces_of(naive_bytes, tokens))
    assert joined == data
    assert complete_text(joined) == streamed(naive_bytes, tokens)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(1, len(METASPACE_WORDS) + 1), max_size=30), trim=st.booleans())
def test_metaspace_pieces_rebuild_the_text(metaspace, tokens, trim):
    """Decoded alone a Metaspace token lost its space ("hello world hello" named
    hello, world, hello): the offsets drifted and chat tokens did not join to the
    content. Only a reply's first token drops it, as decoding the reply does, and
    not a completion's, which keeps it."""
    pieces, whole = pieces_of(metaspace, tokens, trim), streamed(metaspace, tokens, trim)
    assert b"".join(pieces) == whole.encode()
    assert_offsets_point_at_the_tokens(tokens, pieces, whole)
    chat = chat_logprobs([TokenLogprob(TokenChoice(t, -0.1, p)) for t, p in zip(tokens, pieces)])
    assert "".join(c["token"] for c in chat["content"]) == whole


@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize("lead_eos", [False, True])
def test_the_runner_names_a_replys_first_token_as_decoding_the_reply_does(
    metaspace, lead_eos, trim
):
    """The runner marks the first token the text has (an EOS generated past with
    ignore_eos adds none): "hello world" named " hello", " world" had a space
    the reply has not. A completion keeps that space, in its text and its piece."""
    prompt = metaspace.encode("hello world", add_special_tokens=False)
    words = metaspace.encode("hello world hello", add_special_tokens=False)
    (eos,) = metaspace.eos_token_ids
    script = [0] * len(prompt) + [eos] * lead_eos + words
    runner = BatchRunner(
        ScriptModel(script), metaspace, max_batch=1, prefill_step_size=16, prefill_batch=1
    )
    request = Request(
        prompt,
        len(words) + lead_eos,
        sampling=GREEDY,
        ignore_eos=lead_eos,
        logprobs=1,
        trim_leading_space=trim,
    )
    runner.add(request)
    text, pieces = "", []
    while runner.active:
        for out in runner.step():
            text += out.text
            pieces += [e.chosen.piece for e in out.logprobs]
    runner.close()
    space = "" if trim else " "
    assert text == space + "hello world hello"
    assert pieces == [space.encode() + b"hello", b" world", b" hello"]
