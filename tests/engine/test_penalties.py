"""Penalties as clients expect them (OpenAI's presence/frequency over generated
tokens, HF's repetition over everything seen), through the real batch runner on a
model whose logits are fixed: token 65 at 1.0, 66 at 0.5, every other 0."""

from __future__ import annotations

import collections
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.batch_runner import BatchRunner
from engine.penalties import OutputPenalties, RepetitionPenalty
from scheduler.request import Request, SamplingParams
from tests.helpers.tiny_models import VOCAB_SIZE, KVSumModel, write_byte_tokenizer

A, B = 65, 66


class FixedLogits(KVSumModel):
    def __call__(self, inputs, cache=None, **_):
        b, n = inputs.shape
        cache[0].update_and_fetch(mx.zeros((b, 1, n, 1)), mx.zeros((b, 1, n, 1)))
        base = mx.zeros((VOCAB_SIZE,)).at[A].add(1.0).at[B].add(0.5)
        return mx.broadcast_to(base, (b, n, VOCAB_SIZE))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(folder)
    return load_tokenizer(folder)


def generated(tokenizer, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    runner = BatchRunner(
        FixedLogits(), tokenizer, max_batch=2, prefill_step_size=64, prefill_batch=2
    )
    runner.add(Request(prompt, max_tokens=n, sampling=params, ignore_eos=True, request_id="r"))
    tokens: list[int] = []
    while runner.active:
        for out in runner.step():
            tokens += out.token_ids
    runner.close()
    return tokens


def openai_reference(presence: float, frequency: float, n: int) -> list[int]:
    """OpenAI's formula: logit - frequency * count - presence * (count > 0), counts
    over the tokens generated so far, greedy."""
    base = np.zeros(VOCAB_SIZE)
    base[A], base[B] = 1.0, 0.5
    seen: collections.Counter[int] = collections.Counter()
    out = []
    for _ in range(n):
        counts = np.array([seen[i] for i in range(VOCAB_SIZE)])
        token = int(np.argmax(base - frequency * counts - presence * (counts > 0)))
        out.append(token)
        seen[token] += 1
    return out


def test_frequency_penalty_counts_every_generated_token_and_no_prompt_token(tokenizer):
    """mlx-lm's processor counted the last 20 tokens of prompt and reply: the reply
    came back round every 20 tokens, and a token of the prompt was penalised."""
    prompt = [1, 2, 3]  # tokens the reference reaches after 65/66 run down: not penalised
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert generated(tokenizer, prompt, params, 45) == openai_reference(0.0, 0.3, 45)


def test_presence_penalty_ignores_the_prompt(tokenizer):
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert generated(tokenizer, [A] * 4, params, 3) == openai_reference(1.0, 0.0, 3)


def test_repetition_penalty_covers_the_whole_prompt(tokenizer):
    """A token 25 positions back in the prompt is penalised as one 5 back is."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    assert generated(tokenizer, [A] + [1] * 5, params, 1) == [B]
    assert generated(tokenizer, [A] + [1] * 25, params, 1) == [B]


def test_counts_are_rebuilt_when_a_row_restarts():
    penalties = OutputPenalties(prompt_len=2, presence=0.0, frequency=1.0)
    logits = mx.zeros((1, 8))
    out = penalties(mx.array([5, 5, 3, 3, 3]), logits)  # prompt 5 5, generated 3 3 3
    assert out[0].tolist() == [0, 0, 0, -3, 0, 0, 0, 0]
    penalties.restart()  # re-run after a batch recovery
    again = penalties(mx.array([5, 5, 3]), logits)
    assert again[0].tolist() == [0, 0, 0, -1, 0, 0, 0, 0]
    repetition = RepetitionPenalty(2.0)
    out = repetition(mx.array([1, 2]), mx.array([[4.0, 4.0, -4.0, 4.0]]))
    assert out[0].tolist() == [4.0, 2.0, -8.0, 4.0]


def test_a_row_asking_for_logprobs_normalises_in_float32():
    """bf16 logits gave log-softmax values in steps of 0.125 near logit 20 (a
    logprob of -0.0486 read 0.0): such rows are cast before anything else."""
    from engine.sampling import SamplerFactory

    params = SamplingParams(temperature=0.0, logit_bias=((3, 1.0),))
    logits = mx.array([[20.0, 17.0, 0.0, 0.0]], dtype=mx.bfloat16)
    out = logits
    for processor in SamplerFactory.logits_processors(params, 0, logprobs=True):
        out = processor(mx.array([1]), out)
    assert out.dtype == mx.float32 and out[0, 3].item() == 1.0
    plain = SamplerFactory.logits_processors(params, 0)
    assert plain[0](mx.array([1]), logits).dtype == mx.bfloat16


def test_after_a_hit_whose_stale_span_is_longer_only_generated_tokens_are_counted(
    tokenizer, monkeypatch
):
    """Penalties began counting at the request's prompt length, but a hit's token
    context is the stored entry's, whose stepped-over volatile span may be longer:
    the prompt's last token was penalised as if generated."""
    import engine.batch_runner as runner_module
    from scheduler.request import CacheHints

    model = KVSumModel()
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    entry = [40, 41, 42, 90, 91, 92, 93, 47]  # its volatile span one token longer

    def hit(_cache, row, _defer_disk=False):
        row.cached, row.kv_offset = 7, 8  # 7 request tokens reused, 8 positions of KV
        kv = model.make_cache()
        model(mx.array([entry]), cache=kv)
        return kv, entry

    monkeypatch.setattr(runner_module.row_kv, "start_from_cache", hit)
    monkeypatch.setattr(runner_module.row_kv, "checkpoints", lambda *a, **k: [])
    monkeypatch.setattr(runner_module.row_kv, "store_final", lambda *a, **k: None)
    first: list[tuple[int, mx.array | None]] = []
    call = OutputPenalties.__call__

    def watched(self, tokens, logits):
        out = call(self, tokens, logits)
        if not first:
            first.append((len(tokens), self._counts.counts))  # noqa: SLF001
        return out

    monkeypatch.setattr(OutputPenalties, "__call__", watched)

    class NoStore:
        def release(self, *_):
            pass

        def poll(self):
            pass

    runner = BatchRunner(
        model, tokenizer, max_batch=2, prefill_step_size=8, prefill_batch=2, prefix_cache=NoStore()
    )
    params = SamplingParams(temperature=0.0, presence_penalty=1.5)
    hints = CacheHints(key=None, session_id="s")
    runner.add(Request(prompt, 3, params, ignore_eos=True, request_id="a", cache=hints))
    while runner.active:
        runner.step()
    context, counts = first[0]
    assert context == len(entry) + len(prompt) - 7  # the entry's tokens, then the rest
    assert counts is None  # nothing generated yet: nothing counted
