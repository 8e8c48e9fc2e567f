"""Linear-time parts of ``ChatFormatter.render_chat`` (engine/prompt_format.py).

Agents resend their whole history every turn, so preparing a prompt must cost
time linear in it, and a new turn of a known conversation time linear in what
the turn adds:

- ``locate`` places each message in the one full rendering by cheap probe
  renders, falling back to cumulative rendering within a linear budget;
- ``OffsetEncoder`` tokenises with character offsets and re-tokenises only what
  follows the last added token of an already tokenised prefix;
- ``token_range`` / ``merge_ranges`` map volatile character spans onto tokens
  by bisection;
- ``SnapshotStore`` keeps what earlier requests computed, for later turns.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from operator import le
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from kvcache.prompt_key import TokenSpan
from kvcache.value_digest import value_digest as _digest
from kvcache.volatile_rules import CharSpan, MessageSlice, stricter

log = logging.getLogger("kvwarm.prompt")

Render = Callable[[Sequence[dict[str, Any]], bool, dict[str, Any]], str]
"""(messages, add_generation_prompt, template kwargs) -> the chat template's text."""

# Cumulative renderings one request may afford, in characters: linear in its prompt.
FALLBACK_FACTOR = 8
FALLBACK_SLACK = 1 << 16


def fallback_budget(text: str) -> int:
    return FALLBACK_FACTOR * len(text) + FALLBACK_SLACK


# -- where each message sits ---------------------------------------------------


@dataclass
class Walk:
    """Messages placed so far in a rendering T: message k is ``T[bounds[k]:bounds[k + 1]]``.

    ``horizon[k]`` is how far into T placing messages < k read (a later T that
    shares that much reaches the same placements) and ``spent[k]`` the fallback
    characters rendered for them. ``stopped``: no later message gets a place.
    """

    bounds: list[int] = field(default_factory=lambda: [0])
    horizon: list[int] = field(default_factory=lambda: [0])
    spent: list[int] = field(default_factory=lambda: [0])
    stopped: bool = False

    @property
    def placed(self) -> int:
        return len(self.bounds) - 1

    def prefix(self, k: int) -> Walk:
        return Walk(self.bounds[: k + 1], self.horizon[: k + 1], self.spent[: k + 1])


@dataclass(frozen=True)
class _Probe:
    piece: str  # the message's own text
    context: list[dict[str, Any]]  # the probe's messages, the placed one last
    kwargs: dict[str, Any]
    rendered: str  # render(context, add_generation_prompt=False)


def locate(
    render: Render,
    messages: Sequence[dict[str, Any]],
    text: str,
    kwargs: dict[str, Any],
    walk: Walk,
) -> None:
    """Place ``messages[walk.placed:]`` in ``text`` (their rendering with the
    generation prompt), extending ``walk``.

    Cumulative rendering is the definition: message k ends at
    ``len(render(messages[:k + 1]))``, and placing stops at the first such
    rendering ``text`` does not start with (templates that rewrite earlier
    turns). A probe rendering of message k among its neighbours gives the same
    piece for templates that render each message by itself; a piece is taken
    where ``text`` holds it at the current position (and, for the last message,
    the generation prompt after it). A message no probe places costs one
    cumulative rendering, out of a budget linear in ``len(text)``.
    """
    budget = fallback_budget(text)
    n = len(messages)
    # each message's latest user message before it, in one pass: looked for from
    # each message, one user prompt before thousands of agent turns was quadratic
    queries: list[int | None] = []
    latest = None
    for i, m in enumerate(messages):
        queries.append(latest)
        if m.get("role") == "user":
            latest = i
    while walk.placed < n and not walk.stopped:
        k = walk.placed
        pos, horizon, spent = walk.bounds[-1], walk.horizon[-1], walk.spent[-1]
        end = None
        for probe in _probes(render, messages, k, kwargs, queries[k]):
            horizon = max(horizon, pos + len(probe.piece))
            if text.startswith(probe.piece, pos):
                end = pos + len(probe.piece)
                if k == n - 1 and not _prompt_follows(render, probe, text, end):
                    end, horizon = None, len(text)
                break
        if end is None:
            end = _cumulative_end(render, messages, k, kwargs, text, pos, spent > budget)
            if end is None:
                walk.stopped = True
                break
            spent += end  # the rendering's length
            horizon = max(horizon, end)
        walk.bounds.append(end)
        walk.horizon.append(horizon)
        walk.spent.append(spent)


def _probes(
    render: Render,
    messages: Sequence[dict[str, Any]],
    k: int,
    kwargs: dict[str, Any],
    query: int | None,
) -> Iterator[_Probe]:
    """Renderings of message k's own text, cheapest first. Message 0's is exact
    (the first cumulative rendering). A later one is its rendering after one
    message of context minus the context's; then after two (templates that
    demand alternating roles); then with the tools (templates that render them
    into some message). Tools stay out where they can: a long tools list would
    make every probe as expensive as a large prompt."""
    if k == 0:
        try:
            rendered = render(messages[:1], False, kwargs)
        except Exception:  # noqa: BLE001 - the cumulative fallback decides
            return
        yield _Probe(rendered, list(messages[:1]), kwargs, rendered)
        return
    bare = {key: v for key, v in kwargs.items() if key != "tools"}
    ladder = [(messages[k - 1 : k], bare)]
    if k >= 2:
        ladder.append((messages[k - 2 : k], bare))
    if kwargs.get("tools"):
        ladder.append((messages[max(0, k - 2) : k], kwargs))
    # templates that refuse a rendering with no user query (Qwen3.5/3.6): the
    # latest user message before k (``query``) leads the context (as in the full one)
    if query is not None and query < k - 2:
        ladder.append(([messages[query], *messages[k - 1 : k]], bare))
    for context, kw in ladder:
        probe = [*context, messages[k]]
        try:
            before = render(context, False, kw)
            rendered = render(probe, False, kw)
        except Exception:  # noqa: BLE001 - e.g. templates that demand a user turn first
            continue
        if rendered.startswith(before):
            yield _Probe(rendered[len(before) :], probe, kw, rendered)


def _prompt_follows(render: Render, probe: _Probe, text: str, end: int) -> bool:
    """Whether ``text`` ends, after the last message, with the generation prompt."""
    try:
        prompted = render(probe.context, True, probe.kwargs)
    except Exception:  # noqa: BLE001
        return False
    return prompted.startswith(probe.rendered) and text[end:] == prompted[len(probe.rendered) :]


def _end_before_next(
    render: Render, messages: Sequence[dict[str, Any]], k: int, kwargs: dict[str, Any], text: str
) -> int | None:
    """End of message k where the template refuses every rendering ending with it
    (a system message alone: "No user query found"): where message k + 1's own
    rendering begins in the rendering that ends with it. None when that does not tell."""
    if k + 1 >= len(messages):
        return None
    try:
        both = render(messages[: k + 2], False, kwargs)
        after = render(messages[k + 1 : k + 2], False, kwargs)
    except Exception:  # noqa: BLE001
        return None
    end = len(both) - len(after)
    if not after or not both.endswith(after) or not text.startswith(both):
        return None
    return end


def _cumulative_end(
    render: Render,
    messages: Sequence[dict[str, Any]],
    k: int,
    kwargs: dict[str, Any],
    text: str,
    pos: int,
    over_budget: bool,
) -> int | None:
    """End of message k by cumulative rendering, or None: placing stops here."""
    if over_budget:
        log.debug("messages %d.. of %d left unplaced: fallback budget spent", k, len(messages))
        return None
    try:
        partial = render(messages[: k + 1], False, kwargs)
    except Exception:  # noqa: BLE001 - templates that demand a user turn (Qwen3.5)
        end = _end_before_next(render, messages, k, kwargs, text)
        return end if end is not None and end >= pos else None
    if len(partial) < pos or not text.startswith(partial):
        return None
    return len(partial)


# -- tokens --------------------------------------------------------------------


@dataclass(frozen=True)
class Tokens:
    """A text's token ids and character offsets, as flat arrays."""

    ids: array
    starts: array
    ends: array
    cuts: array  # indices of the tokens a re-tokenisation may start at, ascending
    monotone: bool  # offsets never go backwards (what bisection needs)


def _nondecreasing(values: array) -> bool:
    return all(map(le, values, islice(values, 1, None)))


class OffsetEncoder:
    """Tokens with character offsets; a text that extends an already tokenised
    one is re-tokenised only after the last added token they share.

    Fast tokenizers split their input on added tokens before the model's own
    normaliser, pre-tokenizer and BPE run, so what precedes an added token
    tokenises the same whatever follows it. Cut points are the added tokens that
    match whatever surrounds them (not lstrip, single_word or normalized). A
    self-check at construction splices ``sample`` and a synthetic text at every
    cut point and turns splicing off for a tokenizer that disagrees anywhere.
    """

    def __init__(self, hf: Any, sample: str):
        self._hf = hf
        raw = getattr(hf, "_tokenizer", None)
        self._raw = raw if isinstance(raw, FastTokenizer) else None
        decoder = getattr(hf, "added_tokens_decoder", None) or {}
        self._cut_ids = frozenset(
            i for i, t in decoder.items() if not (t.lstrip or t.single_word or t.normalized)
        )
        self._added = {i: decoder[i].content for i in self._cut_ids}
        self._warned = False
        self.incremental = False
        if self._raw is not None and self._cut_ids:
            cut_texts = [decoder[i].content for i in sorted(self._cut_ids)[:16]]
            synthetic = "".join(
                f"{t}user\n hi {i}\n\n{t}{t} x  {t}" for i, t in enumerate(cut_texts)
            )
            self.incremental = all(self._splices(s) for s in (sample, synthetic) if s)
            if not self.incremental:
                log.info("tokenizer fails the splice self-check: every prompt is tokenised whole")

    @property
    def cut_ids(self) -> frozenset[int]:
        """Added tokens whose tokenisation nothing around them changes."""
        return self._cut_ids

    def added_text(self, token: int) -> str | None:
        return self._added.get(token)

    def encode(self, text: str) -> Tokens | None:
        """None for tokenizers without offsets."""
        if self._raw is not None:
            enc = self._raw_encode(text)
            return self._tokens(enc.ids, enc.offsets)
        try:
            enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception:  # noqa: BLE001 - slow tokenizers have no offsets
            if not self._warned:
                log.warning("tokenizer gives no offsets: prompt cache keys ignore volatile spans")
                self._warned = True
            return None
        return self._tokens(enc["input_ids"], enc["offset_mapping"])

    def extend(self, old: Tokens, text: str, shared: int) -> tuple[Tokens | None, int]:
        """Tokens of ``text``, whose first ``shared`` characters equal those of the
        text ``old`` holds, and the character up to which ``old``'s token
        positions still hold (0 unless both are monotone: they are found by bisection)."""
        if self.incremental and old.monotone:
            j = bisect_right(old.cuts, shared, key=lambda t: old.ends[t]) - 1
            if j >= 0 and (tokens := self._splice(old, text, j)) is not None:
                return tokens, old.starts[old.cuts[j]] if tokens.monotone else 0
        return self.encode(text), 0

    def _splice(self, old: Tokens, text: str, j: int) -> Tokens | None:
        i = old.cuts[j]
        c = old.starts[i]
        enc = self._raw_encode(text[c:])
        if not enc.ids or enc.ids[0] != old.ids[i] or enc.offsets[0] != (0, old.ends[i] - c):
            return None  # the added token did not match the same way: tokenise whole
        tail = self._tokens(enc.ids, enc.offsets, c, i)
        return Tokens(
            old.ids[:i] + tail.ids,
            old.starts[:i] + tail.starts,
            old.ends[:i] + tail.ends,
            old.cuts[:j] + tail.cuts,
            tail.monotone,  # old.monotone is required, and the seam is the checked token
        )

    def _raw_encode(self, text: str) -> Any:
        # encode_batch releases the GIL while it runs (encode does not): a long
        # prompt tokenising in a worker thread must not stall the event loop
        (enc,) = self._raw.encode_batch([text], add_special_tokens=False)
        return enc

    def _splices(self, sample: str) -> bool:
        full = self.encode(sample)
        return all(self._splice(full, sample, j) == full for j in range(len(full.cuts)))

    def _tokens(
        self, ids: Sequence[int], offsets: Iterable[Sequence[int]], shift: int = 0, first: int = 0
    ) -> Tokens:
        flat = array("q", chain.from_iterable(offsets))
        if shift:
            flat = array("q", [x + shift for x in flat])
        starts, ends = flat[0::2], flat[1::2]
        cuts = array("q", [first + t for t, x in enumerate(ids) if x in self._cut_ids])
        monotone = _nondecreasing(starts) and _nondecreasing(ends)
        return Tokens(array("q", ids), starts, ends, cuts, monotone)


def token_range(tokens: Tokens, span: CharSpan) -> tuple[int, int, int]:
    """(first, end, rule): the tokens overlapping ``span``, for monotone offsets."""
    first = bisect_right(tokens.ends, span.start)
    return first, max(first, bisect_left(tokens.starts, span.end)), span.rule


def merge_ranges(ranges: Iterable[tuple[int, int, int]]) -> list[TokenSpan]:
    """Token spans from ``token_range``s in text order: exactly what
    ``kvcache.prompt_key.token_spans`` gives for monotone offsets (empty ones
    vanish; ranges that touch or overlap merge, named by the stricter rule)."""
    out: list[TokenSpan] = []
    for start, end, rule in ranges:
        if end <= start:
            continue
        if out and start <= out[-1].end:
            last = out[-1]
            out[-1] = TokenSpan(last.start, max(last.end, end), stricter(last.rule, rule))
        else:
            out.append(TokenSpan(start, end, rule))
    return out


# -- snapshots -----------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One placed message: its text range, volatile spans, hash, and where its
    end and spans fall in the tokens."""

    slice: MessageSlice
    spans: tuple[CharSpan, ...]
    hash: str
    end_token: int
    ranges: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Conversation:
    """Digests of a request's template kwargs and of each of its messages: what a
    snapshot keeps and compares instead of the objects. Holding those let a tool
    description or a field the template never renders (30 MB each) escape the
    store's byte bound: 70 requests held 9.4 GB."""

    kwargs: bytes
    messages: tuple[bytes, ...]
    key: bytes  # where its snapshots are looked up: the kwargs and the first message

    @classmethod
    def of(cls, messages: Sequence[dict[str, Any]], kwargs: dict[str, Any]) -> Conversation | None:
        """None when there are no messages, or a value has no stable encoding (too
        deep, or marshal has no form for it and its JSON keys do not sort)."""
        if not messages:
            return None
        try:
            digests = tuple(_digest(m) for m in messages)
            kwargs_digest = _digest(kwargs)
        except (TypeError, ValueError, RecursionError):
            return None
        key = hashlib.blake2b(kwargs_digest + digests[0], digest_size=16).digest()
        return cls(kwargs_digest, digests, key)


@dataclass(frozen=True)
class Snapshot:
    """What one request computed, for later turns of its conversation."""

    conversation: Conversation
    text: str
    walk: Walk
    parts: tuple[Part, ...]
    tokens: Tokens

    @property
    def key(self) -> bytes:
        return self.conversation.key

    @property
    def messages(self) -> tuple[bytes, ...]:
        return self.conversation.messages

    @property
    def nbytes(self) -> int:
        # the text, the token arrays and per-message records (digest, part, walk)
        return sys.getsizeof(self.text) + 32 * len(self.tokens.ids) + 512 * len(self.messages)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class SnapshotStore:
    """Bounded LRU (by count and estimated bytes) of snapshots, thread-safe:
    requests are prepared concurrently, and the lock is held only to look up
    or update the dictionary."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 256 << 20):
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._entries: OrderedDict[int, Snapshot] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def candidates(self, key: bytes) -> list[Snapshot]:
        with self._lock:
            return [s for s in self._entries.values() if s.key == key]

    def put(self, snapshot: Snapshot, parent: Snapshot | None = None) -> None:
        """Keep ``snapshot``; ``parent`` (the one it was built on) goes if
        ``snapshot``'s conversation extends it (a branch keeps both)."""
        extends = parent is not None and common_prefix(parent.messages, snapshot.messages) == len(
            parent.messages
        )
        with self._lock:
            if extends and self._entries.pop(id(parent), None) is not None:
                self._bytes -= parent.nbytes
            self._entries[id(snapshot)] = snapshot
            self._bytes += snapshot.nbytes
            while len(self._entries) > self._max_entries or (
                self._bytes > self._max_bytes and len(self._entries) > 1
            ):
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
