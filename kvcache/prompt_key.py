"""The two token views of one prompt, and how two prompts line up.

*Model tokens* are exactly what the model sees. *Cache-key tokens* (canonical)
are the model tokens with every volatile span replaced by its canonical form (a
sentinel id, or nothing); they are only used to find candidate entries. Whether
and how far a candidate's KV is reused is decided by ``align`` in model-token
space, so normalisation can never blind the model.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.volatile_rules import RULES, Canonical, CharSpan, stricter

# Canonical ids of sentinels: negative, so they can never collide with a vocabulary id.
_SENTINEL_BASE = -1


@dataclass(frozen=True)
class TokenSpan:
    """Model tokens ``[start, end)`` touched by a volatile span."""

    start: int
    end: int
    rule: int

    @property
    def droppable(self) -> bool:
        return RULES[self.rule].canonical is Canonical.DROP

    @property
    def stale_ok(self) -> bool:
        return RULES[self.rule].stale_ok


def token_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]) -> list[TokenSpan]:
    """Tokens whose characters overlap a volatile character span (a token that
    straddles the span's edge belongs to the span: tokens outside are then
    tokenised the same whatever the volatile value was)."""
    out: list[TokenSpan] = []
    t = 0
    n = len(offsets)
    for span in spans:
        # a token straddling the previous span's end may reach into this one too;
        # only tokens covering that one character are stepped back over
        while t > 0 and offsets[t - 1][1] > span.start:
            t -= 1
        while t < n and offsets[t][1] <= span.start:
            t += 1
        start = t
        while t < n and offsets[t][0] < span.end:
            t += 1
        if t > start:
            if out and start <= out[-1].end:
                last = out[-1]
                out[-1] = TokenSpan(last.start, max(last.end, t), stricter(last.rule, span.rule))
            else:
                out.append(TokenSpan(start, t, span.rule))
    return out


def canonicalise(tokens: Sequence[int], spans: Sequence[TokenSpan]) -> list[int]:
    out: list[int] = []
    pos = 0
    for span in spans:
        out.extend(tokens[pos : span.start])
        if not span.droppable:
            out.append(_SENTINEL_BASE - span.rule)
        pos = span.end
    out.extend(tokens[pos:])
    return out


def chain_hashes(tokens: Sequence[int], block_size: int, namespace: str) -> list[bytes]:
    """Hash of each full block, chained with its parent's: equal hashes at depth d
    mean equal tokens over the first (d + 1) * block_size positions."""
    parent = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class PromptKey:
    """Everything the prefix cache needs about one prompt, computed once."""

    model_tokens: tuple[int, ...]
    spans: tuple[TokenSpan, ...] = ()
    # token index at the end of each message (exact, from cumulative rendering)
    message_ends: tuple[int, ...] = ()
    # end of the leading system message(s) (system prompt + tools): shared by sub-agents
    stable_prefix_end: int = 0
    canonical: tuple[int, ...] = field(default=(), compare=False)
    # where the newest user message starts (None: not known): a changed volatile
    # value from here on is read, never stepped over, as it may be the user's edit
    # of their last message before a regenerate (only the prompt's tail prefills)
    newest_user_start: int | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        model_tokens: Sequence[int],
        spans: Sequence[TokenSpan] = (),
        message_ends: Sequence[int] = (),
        stable_prefix_end: int = 0,
        newest_user_start: int | None = None,
    ) -> PromptKey:
        tokens = tuple(model_tokens)
        return cls(
            tokens,
            tuple(spans),
            tuple(message_ends),
            stable_prefix_end,
            tuple(canonicalise(tokens, spans)),
            newest_user_start,
        )

    def extended(self, tokens: Sequence[int]) -> PromptKey:
        """This prompt followed by generated tokens (never volatile)."""
        return PromptKey.build(
            self.model_tokens + tuple(tokens),
            self.spans,
            self.message_ends,
            self.stable_prefix_end,
            self.newest_user_start,
        )

    def truncated(self, length: int) -> PromptKey:
        """The first ``length`` model tokens (a checkpoint), spans clipped to them."""
        spans = [s for s in self.spans if s.end <= length]
        return PromptKey.build(
            self.model_tokens[:length],
            spans,
            [e for e in self.message_ends if e <= length],
            min(self.stable_prefix_end, length),
            self.newest_user_start,
        )

    def spliced(self, depth: int, request: PromptKey, request_depth: int) -> PromptKey:
        """What the KV of a hit stands for: this entry's first ``depth`` tokens,
        then ``request``'s tokens from ``request_depth`` on (volatile spans of
        another length shift what follows)."""
        shift = depth - request_depth
        spans = [s for s in self.spans if s.end <= depth]
        spans += [
            TokenSpan(s.start + shift, s.end + shift, s.rule)
            for s in request.spans
            if s.start >= request_depth
        ]
        ends = [e for e in self.message_ends if e <= depth]
        ends += [e + shift for e in request.message_ends if e > request_depth]
        stable = request.stable_prefix_end
        if stable > request_depth:
            stable += shift
        newest = request.newest_user_start
        if newest is not None:  # where it lies in the reused part, no position maps to it
            newest = newest + shift if newest >= request_depth else None
        return PromptKey.build(
            self.model_tokens[:depth] + request.model_tokens[request_depth:],
            spans,
            ends,
            stable,
            newest,
        )

    def canonical_position(self, model_pos: int) -> int:
        """Canonical index of model position ``model_pos`` (which is outside any span)."""
        shift = 0
        for span in self.spans:
            if span.end > model_pos:
                break
            shift += (span.end - span.start) - (0 if span.droppable else 1)
        return model_pos - shift


@dataclass(frozen=True)
class Alignment:
    entry_depth: int  # KV positions of the entry that stay valid
    request_depth: int  # the request's prefill resumes at this model token
    stale_tokens: int  # entry tokens inside volatile spans whose values differ
    # a deeper point was passed over for outgrowing ``max_growth`` (``align``)
    capped: bool = False


def _common_run(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int) -> int:
    """Length of the common run a[i:] / b[j:], at most ``limit`` (chunked: C-speed compares)."""
    n = 0
    step = 256
    while n < limit:
        k = min(step, limit - n)
        if a[i + n : i + n + k] == b[j + n : j + n + k]:
            n += k
            continue
        while n < limit and a[i + n] == b[j + n]:
            n += 1
        return n
    return n


def align(
    entry: PromptKey,
    request: PromptKey,
    skip_volatile: bool,
    entry_len: int | None = None,
    entry_only_read: bool = True,
    max_growth: int | None = None,
) -> Alignment:
    """How far ``entry``'s KV stands for ``request``.

    Tokens outside volatile spans must be equal. With ``skip_volatile`` a span
    of the same rule at the same aligned place is stepped over in both (their
    lengths may differ: a new timestamp may tokenise differently) unless its
    rule is not ``stale_ok`` and the two differ, or they differ in the request's
    newest user message (``newest_user_start``), and a droppable span only the
    entry has is stepped over (one whose rule is not ``stale_ok``, a reminder,
    only with ``entry_only_read``: the request's own conversation read it
    before); the model then keeps the entry's stale values there. A droppable
    span only the request has ends the alignment: its text must be prefilled,
    or the model would never read it.
    Without it only an exact model-token prefix counts. Never consumes the
    request's last token.

    ``max_growth``: the most KV positions the entry's part may hold beyond the
    request's (entry_depth - request_depth: stale values longer than the new
    ones, blocks only the entry holds), which the row's reserved KV must still
    cover. The alignment goes on past a point over it, but only a point within
    it is kept: a hit then ends where the growth began, not at the first changed
    value (a clock on line one, as an exact-prefix fallback did). Nor is a hit
    cut inside a changed value's span where the exact prefix ends: the KV it
    leaves would be stored under a key with the value's raw tokens, which no
    later request's cache key (a placeholder there) finds.
    """
    a, b = entry.model_tokens, request.model_tokens
    n_a = len(a) if entry_len is None else min(entry_len, len(a))
    n_b = len(b) - 1  # at least one prompt token is always recomputed
    grow = n_a if max_growth is None else max_growth
    capped = False
    if not skip_volatile:
        n = _common_run(a, 0, b, 0, min(n_a, n_b))
        return Alignment(n, n, 0)
    sa = [s for s in entry.spans if s.start < n_a]
    sb = list(request.spans)
    newest = len(b) if request.newest_user_start is None else request.newest_user_start
    i = j = 0
    ia = ib = 0  # next span index on each side
    stale = 0
    # state after the last step that gained something: a skipped span only
    # pays off if equal tokens follow it
    best = (0, 0, 0)
    while True:
        next_a = sa[ia].start if ia < len(sa) else n_a
        next_b = sb[ib].start if ib < len(sb) else len(b)
        limit = min(next_a - i, next_b - j, n_a - i, n_b - j)
        run = _common_run(a, i, b, j, limit)
        i += run
        j += run
        if run and i - j <= grow:
            best = (i, j, stale)
        elif run:
            capped = True  # deeper, but past the KV the row has reserved
        if run < limit:
            break
        at_a = ia < len(sa) and i == sa[ia].start
        at_b = ib < len(sb) and j == sb[ib].start
        if at_a and at_b and sa[ia].rule == sb[ib].rule and sa[ia].end <= n_a:
            span_a, span_b = sa[ia], sb[ib]
            if span_b.end > n_b:  # the request's span runs into its last token
                break
            same = a[span_a.start : span_a.end] == b[span_b.start : span_b.end]
            if not same and (not span_a.stale_ok or j >= newest):
                # a changed reminder, or a value the user may have just edited
                # ("Current time: 10:30" to 11:45, then regenerate): read the new one
                break
            if not same:
                stale += span_a.end - span_a.start
            i, j = span_a.end, span_b.end
            ia += 1
            ib += 1
            if same and i - j <= grow:
                best = (i, j, stale)
            elif same:
                capped = True
        elif (
            at_a and sa[ia].droppable and sa[ia].end <= n_a and (entry_only_read or sa[ia].stale_ok)
        ):
            stale += sa[ia].end - sa[ia].start
            i = sa[ia].end
            ia += 1
        else:
            # a droppable block only the request has (a new reminder) is never
            # stepped over: the model would never read it
            break
    return Alignment(*best, capped)


@dataclass(frozen=True)
class RenderedPrompt:
    """Both pipelines' output for one request: the key and per-message canonical hashes."""

    key: PromptKey
    message_hashes: tuple[str, ...] = ()
    tail: str = ""  # the rendered text's last characters (did the template open a think block?)

    @property
    def tokens(self) -> list[int]:
        return list(self.key.model_tokens)
