"""Repetition, presence and frequency penalties with the semantics clients expect.

mlx-lm's processors look at the last 20 tokens of prompt and reply alike. OpenAI's
presence and frequency penalties (and vLLM's) count the tokens the request
*generated*, all of them: a token of the prompt is not penalised, and one the
reply repeated 30 tokens ago still is. The repetition penalty (HF, vLLM) covers
every token of prompt and reply. Each processor keeps its counts and adds only
the tokens new since its last call: one scatter per step, not a pass over the
history.

A processor is called with the row's token context, which mlx-lm's
BatchGenerator keeps as the whole prompt (reused tokens included) followed by
every token generated. A row re-run after a batch recovery (``restart``, from
``engine.sampling.rewind``) counts afresh from its new context of prompt + what
it had generated: the probe and the lost step ran its processors on tokens it
never kept.
"""

from __future__ import annotations

import mlx.core as mx


class _Counts:
    """Occurrences of each token in ``tokens[start:]``, kept up to date."""

    def __init__(self, start: int):
        self.start = start
        self.restart()

    def restart(self) -> None:
        self._seen = self.start
        self.counts: mx.array | None = None

    def update(self, tokens: mx.array, vocab: int) -> mx.array | None:
        n = len(tokens)
        if n > self._seen:
            if self.counts is None:
                self.counts = mx.zeros((vocab,), dtype=mx.float32)
            self.counts = self.counts.at[tokens[self._seen : n]].add(1.0)
            self._seen = n
        return self.counts


class OutputPenalties:
    """OpenAI's ``presence_penalty`` (once per distinct generated token) and
    ``frequency_penalty`` (per occurrence), over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.presence = presence
        self.frequency = frequency
        self._counts = _Counts(prompt_len)

    def restart(self) -> None:
        self._counts.restart()

    def rebase(self, start: int) -> None:
        """Generated tokens begin at ``start`` of the tokens the generator hands
        over: a prefix hit's context is the stored entry's tokens, whose stepped-over
        volatile span may be longer or shorter than the request's own."""
        self._counts.start = start
        self._counts.restart()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        counts = self._counts.update(tokens, logits.shape[-1])
        if counts is None:
            return logits
        penalty = self.frequency * counts + self.presence * (counts > 0)
        return logits - penalty.astype(logits.dtype)


class RepetitionPenalty:
    """HF's multiplicative penalty on every token seen in prompt or reply
    (logits above 0 divided, below 0 multiplied)."""

    def __init__(self, penalty: float):
        self.penalty = penalty
        self._counts = _Counts(0)

    def restart(self) -> None:
        self._counts.restart()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        counts = self._counts.update(tokens, logits.shape[-1])
        if counts is None:
            return logits
        penalised = mx.where(logits < 0, logits * self.penalty, logits / self.penalty)
        return mx.where(counts > 0, penalised, logits)
