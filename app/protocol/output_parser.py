"""Streaming classifier of generated text: reasoning, content, tool calls.

Text arrives in arbitrary pieces (one engine step's detokenised delta). Every
piece is routed to reasoning (inside ``<think>...</think>``, or from the start
when the prompt already opened the block), to content, or to a withheld buffer
once tool-call markup starts. Only a suffix that could still become a tag is
held back, so content streams live, no tag fragment ever leaks, and the events
for any chunking are the events for the whole text (merged) — which is what
makes streamed and non-streamed responses agree byte for byte.

``<think>`` opens reasoning only before any content (leading whitespace aside):
a model explaining think tags in its answer is not reasoning.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from app.protocol.bare_function import BareFunction
from app.protocol.open_values import OpenValue
from app.protocol.tool_formats import BARE_JSON, QWEN_FUNCTION, Markup, ToolCall, ToolCallDecoder


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


Event = Reasoning | Content | ToolCall


@dataclass(frozen=True)
class Syntax:
    """How one model marks reasoning; derived once per request."""

    think_start: str | None = "<think>"
    think_end: str | None = "</think>"
    # the prompt ends inside an opened think block (Qwen3/DeepSeek/GLM templates
    # put the opening tag in the generation prompt): the output starts as reasoning
    starts_in_reasoning: bool = False


# the most text one drain reads at once (see OutputParser._feed)
PIECE = 1024


class _Mode(enum.Enum):
    BOUNDARY = "boundary"  # nothing classified since the start / a closed block
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL = "tool"


def _held_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a tag."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if tag.startswith(text[-k:]):
                longest = k
                break
    return longest


@dataclass
class OutputParser:
    syntax: Syntax = field(default_factory=Syntax)
    tools: ToolCallDecoder | None = None  # None: tool calls are not parsed
    # parallel tool calls off (parallel_tool_calls: false, disable_parallel_tool_use):
    # calls past this many are dropped, as decoded markup leaving no text behind
    max_calls: int | None = None

    def __post_init__(self) -> None:
        reasoning = bool(self.syntax.think_start and self.syntax.think_end)
        self._mode = (
            _Mode.REASONING if reasoning and self.syntax.starts_in_reasoning else _Mode.BOUNDARY
        )
        self._think = reasoning and self._mode is _Mode.BOUNDARY  # may <think> still open?
        self._keep_ws = True  # leading whitespace is content unless a block/call follows
        # whitespace held at a block boundary, in pieces: one string grown per delta
        # was copied whole each time (a model looping on blank lines: quadratic)
        self._ws: list[str] = []
        self._ws_len = 0
        self._buf = ""
        # characters put in _buf so far, text read again included: where _buf starts
        # in what was read, and up to where a bare <function= opens nothing (_quiet:
        # the call shape a bare span that failed had read, see _release_bare)
        self._fed = 0
        self._quiet = 0
        self._shape: BareFunction | None = None
        self._markups: tuple[Markup, ...] = self.tools.markups if self.tools else ()
        self._tool: Markup | None = None
        self._orphan = ""  # a closing to drop if it comes next (``Markup.orphan``)
        # a call's markup so far, in pieces (joined once, at its end: += would copy
        # it on every token), and the text an end tag split across tokens may start in
        self._tool_parts: list[str] = []
        self._tool_len = 0
        self._tail = ""
        # whether the call is inside an argument value (an end tag there is text),
        # the call's characters it has read, and where the first such tag was
        self._values = OpenValue()
        self._valued = 0
        self._skipped: int | None = None
        # set once a value never closed: from then on an end tag always ends its call
        # (read again, the rest could skip tags anew: a reply re-read per call)
        self._track_values = True
        self._replay = ""
        self._out: list[Event] = []
        self._truncated = False
        self._stopped_at: str | None = None
        self._calls = 0
        # the raw text minus tool-call markup that decoded: what the model wrote
        # besides its calls, for healing the echoed turn
        self._kept: list[str] = []
        # built once: feed runs for every token of every stream, on the event loop
        self._steps = {
            _Mode.BOUNDARY: self._boundary,
            _Mode.CONTENT: self._content,
            _Mode.REASONING: self._reasoning,
            _Mode.TOOL: self._tool_markup,
        }

    # -- public ----------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._feed(text)
        return self._flush()

    def _feed(self, text: str) -> None:
        # a long text in bounded pieces (any chunking reads alike): each call or tag
        # found slices what is buffered, and one buffer of thousands of calls was
        # sliced once per call (quadratic). Text a call gave back to be read again
        # (see _give_back) is read before what follows it.
        texts = [text]
        while texts:
            t, at = texts.pop(), 0
            while at < len(t):
                piece = t[at : at + PIECE]
                self._buf += piece
                self._fed += len(piece)
                at += PIECE
                self._drain(final=False)
                if self._replay:
                    texts += [t[at:], self._replay]
                    self._replay = ""
                    break

    def finish(self, truncated: bool = False, stopped_at: str | None = None) -> list[Event]:
        """The end of the reply. ``truncated``: max_tokens cut it, so a call whose
        markup is still open is incomplete and goes out as the text it is (the same
        for every markup: an agent must never run a call with cut-off arguments).
        ``stopped_at``: the client's stop string that ended it, which cuts an open
        call the same unless it is the call's closing tag (``stop: ["</tool_call>"]``)."""
        self._truncated = truncated
        self._stopped_at = stopped_at
        self._drain(final=True)
        while self._replay:  # what followed a call's end tag first read as a value's text
            rest, self._replay = self._replay, ""
            self._feed(rest)
            self._drain(final=True)
        return self._flush()

    def open_tool(self, markup: Markup, seed: str) -> None:
        """Start inside a call whose opening the prompt already wrote (forced tool choice)."""
        self._start_tool(markup)
        self._tool_parts, self._tool_len, self._tail = [seed], len(seed), seed
        self._values.feed(seed)
        self._valued = len(seed)

    def parse(self, text: str) -> list[Event]:
        """The whole text at once (non-streaming)."""
        return merge(self.feed(text) + self.finish())

    @property
    def kept_text(self) -> str:
        return "".join(self._kept)

    @property
    def in_reasoning(self) -> bool:
        return self._mode is _Mode.REASONING

    @property
    def held(self) -> int:
        """Characters received but not yet classified (tool buffers excluded)."""
        return len(self._buf) + self._ws_len

    # -- state machine ---------------------------------------------------------
    def _drain(self, final: bool) -> None:
        steps = self._steps
        while steps[self._mode](final):
            pass

    def _emit(self, kind: type[Reasoning] | type[Content], text: str) -> None:
        if text:
            self._out.append(kind(text))
            self._kept.append(text)

    def _flush(self) -> list[Event]:
        out, self._out = self._out, []
        return out if len(out) < 2 else merge(out)

    def _boundary(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        blank = len(self._buf) - len(stripped)
        if blank:
            self._ws.append(self._buf[:blank])
            self._ws_len += blank
        self._buf = stripped
        if not stripped:
            if final:
                self._release_ws()
            return False
        if self._orphan:
            if stripped.startswith(self._orphan):  # the closing of an opening left out
                self._drop_ws()
                self._buf, self._orphan = stripped[len(self._orphan) :], ""
                return True
            if not final and self._orphan.startswith(stripped):
                return False  # could still be that closing
            self._orphan = ""
        think = self.syntax.think_start if self._think else None
        if think and stripped.startswith(think):
            self._drop_ws()
            self._kept.append(think)
            self._buf = stripped[len(think) :]
            self._mode = _Mode.REASONING
            return True
        for markup in self._markups:
            if stripped.startswith(markup.start) and not self._from(markup):
                self._drop_ws()
                self._buf = stripped[len(markup.start) :]
                self._start_tool(markup)
                return True
        if self.tools and self.tools.bare_json and stripped[0] == "{":
            self._drop_ws()
            self._start_tool(BARE_JSON)
            return True
        tags = [t for t in (think, *(m.start for m in self._markups)) if t]
        if not final and any(t.startswith(stripped) for t in tags):
            return False  # could still become a tag
        self._release_ws()
        self._mode = _Mode.CONTENT
        return True

    def _release_ws(self) -> None:
        """Held whitespace before content: content at the very start, dropped after a block."""
        if self._keep_ws:
            self._emit(Content, self._take_ws())
        else:
            self._drop_ws()

    def _drop_ws(self) -> None:
        self._kept.append(self._take_ws())

    def _take_ws(self) -> str:
        held = "".join(self._ws)
        self._ws.clear()
        self._ws_len = 0
        return held

    def _content(self, final: bool) -> bool:
        found = [
            (i, m) for m in self._markups if (i := self._buf.find(m.start, self._from(m))) >= 0
        ]
        if found:
            i, markup = min(found, key=lambda f: f[0])
            self._emit(Content, self._buf[:i])
            self._buf = self._buf[i + len(markup.start) :]
            self._start_tool(markup)
            return True
        hold = 0 if final else _held_suffix(self._buf, (m.start for m in self._markups))
        self._emit(Content, self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold :]
        return False

    def _from(self, markup: Markup) -> int:
        """Where in _buf ``markup`` may open: past a failed bare span's shape."""
        if markup is not QWEN_FUNCTION:
            return 0
        return max(0, self._quiet - (self._fed - len(self._buf)))

    def _reasoning(self, final: bool) -> bool:
        end = self.syntax.think_end or ""
        i = self._buf.find(end)
        if i >= 0:
            self._emit(Reasoning, self._buf[:i])
            self._kept.append(end)
            self._buf = self._buf[i + len(end) :]
            self._to_boundary()
            return True
        hold = 0 if final else _held_suffix(self._buf, (end,))
        self._emit(Reasoning, self._buf[: len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold :]
        return False

    def _to_boundary(self) -> None:
        self._mode = _Mode.BOUNDARY
        self._think = False
        self._keep_ws = False

    def _cut_by_stop(self, markup: Markup) -> bool:
        """Whether a stop string ended the reply inside ``markup``'s call: not at
        its closing tag, and a closing tag it has (a JSON call without one is
        whole or fails to parse; markup of named arguments can lose the last)."""
        stop = self._stopped_at
        return stop is not None and bool(markup.end) and not stop.lstrip().startswith(markup.end)

    def _start_tool(self, markup: Markup) -> None:
        self._mode = _Mode.TOOL
        self._tool = markup
        self._tool_parts, self._tool_len, self._tail = [], 0, ""
        self._values, self._valued, self._skipped = OpenValue(), 0, None
        if markup is QWEN_FUNCTION:
            assert self.tools is not None
            self._shape = BareFunction(self.tools.bare_names)

    def _tool_markup(self, final: bool) -> bool:
        markup = self._tool
        assert markup is not None
        if markup is QWEN_FUNCTION:
            return self._bare(final)
        new, self._buf = self._buf, ""
        if markup.end:
            # search only what is new, plus the tail an end tag split across tokens
            # may begin in: linear time however long the call
            window = self._tail + new
            base = self._tool_len - len(self._tail)  # where the window starts in the call
            search = 0
            while (i := window.find(markup.end, search)) >= 0:
                self._read_values(window, base, i)
                if not self._track_values or not self._values.open:
                    return self._end_tool(markup, new, base + i)
                if self._skipped is None:
                    self._skipped = base + i
                search = i + len(markup.end)
            self._read_values(window, base, len(window))
            self._tail = window[max(search, len(window) - len(markup.end) + 1) :]
        self._tool_parts.append(new)
        self._tool_len += len(new)
        if final and self._skipped is not None:
            self._give_back(markup, "".join(self._tool_parts))  # a value never closed
        elif final and (self._truncated or self._cut_by_stop(markup)):
            self._tool = None
            self._emit(Content, markup.start + "".join(self._tool_parts))
            self._mode = _Mode.CONTENT
        elif final:
            self._close_tool(markup, "".join(self._tool_parts), "")
        return False

    def _read_values(self, window: str, base: int, upto: int) -> None:
        """Feed the value scanner the call's text up to ``base + upto``."""
        if self._track_values:
            self._values.feed(window[self._valued - base : upto])
        self._valued = max(self._valued, base + upto)

    def _end_tool(self, markup: Markup, new: str, cut: int) -> bool:
        """The call ends at ``cut``, unless it was read through end tags it took for
        a value's text and then does not decode (a broken string closed only by a
        later quote): then the first of those was its end (``_give_back``)."""
        assert self.tools is not None
        text = "".join(self._tool_parts) + new
        calls = None
        if self._skipped is not None:
            calls = self.tools.decode(markup, text[:cut])
            if not calls:
                return self._give_back(markup, text)
        self._buf = text[cut + len(markup.end) :]
        self._close_tool(markup, text[:cut], markup.end, calls)
        return True

    def _give_back(self, markup: Markup, text: str) -> bool:
        """The first end tag read as a value's text was the call's end after all
        (the value never closed, or what closed it broke the call): the call, whose
        markup so far is ``text``, ends there and what followed is read again, end
        tags as ends from then on (read again with values, a reply could be re-read
        per call). A broken call took the valid one after it down with it."""
        assert self._skipped is not None
        cut = self._skipped
        self._read_again(text[cut + len(markup.end) :])
        self._track_values = False
        self._close_tool(markup, text[:cut], markup.end)
        return False

    def _bare(self, final: bool) -> bool:
        """A function written without its <tool_call>: a call only while what
        follows ``<function=`` keeps a call's shape (``BareFunction``) and only
        if it decodes at its ``</function>``."""
        shape = self._shape
        assert shape is not None and self.tools is not None
        new, self._buf = self._buf, ""
        at = shape.feed(new)
        if at is None:
            self._tool_parts.append(new)
            if final:  # the reply ended before its </function>
                text = "".join(self._tool_parts)
                return self._release_bare(text, len(text), "")
            return False
        self._tool_parts.append(new[:at])
        text = "".join(self._tool_parts)
        if shape.failed:
            return self._release_bare(text, shape.quiet, new[at:])
        inner = text[: -len(QWEN_FUNCTION.end)]
        calls = self.tools.decode(QWEN_FUNCTION, inner)
        if not calls:
            return self._release_bare(text, len(inner), new[at:])
        self._buf = new[at:]
        self._close_tool(QWEN_FUNCTION, inner, QWEN_FUNCTION.end, calls)
        return True

    def _release_bare(self, text: str, quiet: int, unread: str) -> bool:
        """Not a call: ``<function=`` is text and ``text``, what followed it, is
        read again (a real call after a mention of the markup is a call), then
        ``unread``. A bare ``<function=`` in the first ``quiet`` characters of
        ``text``, the call shape it had (its parameters' values), opens nothing
        then: a character is read by one bare span at most, however many
        mentions a reply holds."""
        self._tool, self._shape = None, None
        self._emit(Content, QWEN_FUNCTION.start)
        self._mode = _Mode.CONTENT
        self._read_again(text, unread)
        self._quiet = self._fed + quiet  # where text will start in what is read
        return False

    def _read_again(self, text: str, unread: str = "") -> None:
        """``text``, the last of what was read, is read again next, then ``unread``
        (taken from _buf before it was read). Everything after ``text`` in what is
        read moves by its length: a failed bare span's shape (_quiet) with it."""
        self._fed -= len(unread)
        self._replay = text + unread
        if self._quiet > self._fed - len(text):
            self._quiet += len(text)

    def _close_tool(
        self, markup: Markup, inner: str, end: str, calls: list[ToolCall] | None = None
    ) -> None:
        """``calls``: ``inner`` decoded already."""
        assert self.tools is not None
        rest = ""
        if calls is None:
            decoded = self.tools.decode_reply(markup, inner)
            calls, rest = decoded if decoded is not None else (None, "")
        self._tool = None
        if calls:
            if self.max_calls is not None:
                calls = calls[: max(0, self.max_calls - self._calls)]
            self._calls += len(calls)
            self._out.extend(calls)
            self._to_boundary()
            self._orphan = markup.orphan
            # text after the calls that is no part of their markup (a markup running
            # to the end of the reply: Mistral's), spaces dropped as after any call
            text = rest.lstrip()
            self._kept.append(rest[: len(rest) - len(text)])
            if text:
                self._emit(Content, text)
                self._mode = _Mode.CONTENT
        else:  # not a call after all: the markup is what the model said
            self._emit(Content, markup.start + inner + end)
            self._mode = _Mode.CONTENT


def merge(events: Iterable[Event]) -> list[Event]:
    """Adjacent text events of one kind joined (each run joined once: linear in
    the text, however many deltas it came in)."""
    out: list[Event] = []
    run: list[str] = []
    kind: type[Reasoning] | type[Content] | None = None
    for event in events:
        if isinstance(event, (Reasoning, Content)) and type(event) is kind:
            run.append(event.text)
            continue
        if kind is not None:
            out.append(kind("".join(run)))
            kind, run = None, []
        if isinstance(event, (Reasoning, Content)):
            kind, run = type(event), [event.text]
        else:
            out.append(event)
    if kind is not None:
        out.append(kind("".join(run)))
    return out
