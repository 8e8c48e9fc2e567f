"""Chat messages -> model tokens and the cache-key view of them (both pipelines).

The model tokens are the chat template's rendering of the messages exactly as
sent (after healing). Volatile spans are located in that rendered text message
by message (``kvcache.volatile_rules``) and mapped onto tokens through the
tokenizer's offsets, so the cache key is derived from the very tokens the model
reads and the two views can never drift apart. Per-message boundaries are those
of cumulative rendering (message k ends where the rendering of the first k + 1
messages ends), found in linear time by ``engine.chat_render``; a new turn of a
known conversation reuses what its previous turn computed (a snapshot) and
costs time linear in what it adds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any

from engine.call_ids import short_call_ids
from engine.chat_render import (
    Conversation,
    OffsetEncoder,
    Part,
    Snapshot,
    SnapshotStore,
    Tokens,
    Walk,
    common_prefix,
    fallback_budget,
    locate,
    merge_ranges,
    token_range,
)
from engine.chat_template import ChatTemplate
from engine.control_tokens import ControlTokens
from engine.text_syntax import demands_short_call_ids
from kvcache.healing import canonical_tool_calls
from kvcache.prompt_key import PromptKey, RenderedPrompt, token_spans
from kvcache.volatile_rules import (
    CharSpan,
    MessageSlice,
    canonical_text,
    prompt_spans,
    relocate_volatile_lines,
)
from scheduler.admission import ContextLengthExceeded

log = logging.getLogger("kvwarm.prompt")
TAIL_CHARS = 64
SYSTEM_ROLES = ("system", "developer")

# Rendered at load for the tokenizer's splice self-check (engine.chat_render.OffsetEncoder).
SAMPLE_CHAT = (
    {"role": "system", "content": "You are terse.\nCurrent time is 10:42"},
    {"role": "user", "content": " Hi  there,\n\n  12345 ünïcödé 🙂\t"},
    {"role": "assistant", "content": "Hello!\n\n    indented "},
    {"role": "user", "content": "<system-reminder>x</system-reminder>\nbye "},
)


class ChatFormatter:
    """Implements scheduler.contracts.PromptFormatter over an mlx-lm TokenizerWrapper.

    Safe to call from several threads at once: the fast tokenizer is
    thread-safe, the snapshot store is locked, and no MLX is involved.
    """

    def __init__(self, tokenizer, context_length: int | None = None):
        self._tokenizer = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._render = ChatTemplate(tokenizer)
        self._control = ControlTokens.of(self._hf)
        self._encoder = OffsetEncoder(self._hf, self._sample_text())
        self._snapshots = SnapshotStore()
        self._context_length = context_length
        self._max_chars = max_prompt_chars(self._hf, context_length)
        self._short_call_ids = demands_short_call_ids(tokenizer)

    def check_length(self, text: str) -> None:
        """Refuse, before tokenising it, a text no tokenisation could fit into the
        context (so a body of 30 MB of text costs a length check, not seconds)."""
        self._check_chars(len(text), "your prompt renders to")

    def _check_chars(self, chars: int, what: str) -> None:
        if self._max_chars is not None and chars > self._max_chars:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self._context_length} tokens. "
                f"However, {what} {chars} characters, more than any "
                f"{self._context_length} tokens can hold. Please reduce the length of the "
                f"messages."
            )

    def check_texts(self, texts: Sequence[str], count_only: bool = False) -> None:
        """The messages' texts, refused before anything scans them (volatile rules,
        healing, control tokens: each a regex pass holding the GIL, 8 MB of system
        text stalled every stream 0.9 s) when together they cannot fit: by their
        length, then by the tokens of their head (tokenising releases the GIL)."""
        total = sum(map(len, texts))
        self._check_chars(total, "your messages hold")
        if count_only or not self._context_length:
            return
        head = PROBE_CHARS_PER_TOKEN * (self._context_length + 1)
        if total <= head:
            return
        pieces, taken = [], 0
        for text in texts:  # just past the head: check_head_tokens reads that much
            pieces.append(text[: head + 1 - taken])
            taken += len(pieces[-1])
            if taken > head:
                break
        self.check_head_tokens("".join(pieces))

    def check_head_tokens(self, text: str) -> None:
        """Refuse a text whose head alone is over the context. ``check_length``
        allows the longest vocabulary entry per token (81 characters), but digits or
        emoji take a token a character: 650 KB of them took 4 s of tokenising to
        refuse. The head (PROBE_CHARS_PER_TOKEN characters per token of context) is
        tokenised first; texts that pass are tokenised whole as before."""
        if not self._context_length:
            return
        head = PROBE_CHARS_PER_TOKEN * (self._context_length + 1)
        if len(text) <= head:
            return
        count = len(self._encode(text[:head], add_special_tokens=False))
        if count > self._context_length + PROBE_SLACK:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self._context_length} tokens. "
                f"However, the first {head} characters of your prompt alone are {count} "
                f"tokens. Please reduce the length of the messages.",
                count,
                self._context_length,
            )

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        relocate_volatile: bool = False,
        count_only: bool = False,
        image_placeholder: str | None = None,
        **template_kwargs: Any,
    ) -> RenderedPrompt:
        # what a client wrote is text, never turn boundaries (engine.control_tokens)
        messages = self._control.messages([dict(m) for m in messages], keep=image_placeholder)
        if self._short_call_ids:  # Mistral's template refuses any other: every dialect's ids
            messages = short_call_ids(messages)
        template_kwargs = self._control.plain(template_kwargs)  # tools, a client's kwargs
        if relocate_volatile:
            contents = relocate_volatile_lines(
                [m.get("content") for m in messages],
                [m["role"] for m in messages],
                fixed=image_placeholder,
            )
            for m, content in zip(messages, contents):
                m["content"] = content
        if not getattr(self._tokenizer, "has_chat_template", False):
            # No template: a plain transcript the base model can continue.
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            text += "assistant:"
            self.check_length(text)
            if not count_only:
                self.check_head_tokens(text)
            return RenderedPrompt(PromptKey.build(self.encode(text)), tail=text[-TAIL_CHARS:])
        text = self._template(messages, True, template_kwargs)
        self.check_length(text)
        if not count_only:  # a count over the context is an answer (agents compact on it)
            self.check_head_tokens(text)
        conversation = Conversation.of(messages, template_kwargs)
        base, reused = self._reusable(conversation, text)
        walk = base.walk.prefix(reused) if base else Walk()
        locate(self._template, messages, text, template_kwargs, walk)
        if base:
            tokens, kept = self._encoder.extend(base.tokens, text, base.walk.horizon[reused])
        else:
            tokens, kept = self._encoder.encode(text), 0
        if tokens is None:  # tokenizer without offsets: no spans, still a correct prompt
            ids = list(
                self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, **template_kwargs
                )
            )
            return RenderedPrompt(PromptKey.build(ids), tail=text[-TAIL_CHARS:])
        old = base.parts[:reused] if base else ()
        parts = self._parts(messages, text, walk, tokens, old, kept)
        if conversation is not None:
            snapshot = Snapshot(conversation, text, walk, parts, tokens)
            self._snapshots.put(snapshot, parent=base)
        return RenderedPrompt(
            self._key(tokens, parts, _newest_user_text(messages, text, parts)),
            tuple(p.hash for p in parts),
            tail=text[-TAIL_CHARS:],
        )

    def encode(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)

    def continued(self, rendered: RenderedPrompt, text: str) -> PromptKey:
        """The rendered prompt with ``text`` appended, its tokens re-cut from the
        last added token on (nothing before such a token changes its tokenisation):
        ``text`` tokenised alone split the seam as the whole text never would
        ("\n\n" after "assistant\n" as two tokens), so the model read an odd
        tokenisation and the next turn's render missed the cache from there."""
        key = rendered.key
        ids = key.model_tokens
        cut = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in self._encoder.cut_ids), -1)
        special = self._encoder.added_text(ids[cut]) if cut >= 0 else None
        at = rendered.tail.rfind(special) if special else -1
        if at >= 0:
            after = rendered.tail[at + len(special) :]
            if self.encode(after) == list(ids[cut + 1 :]):  # the tail is what those tokens say
                return key.truncated(cut + 1).extended(self.encode(after + text))
        return key.extended(self.encode(text))

    def encode_prompt(self, text: str) -> list[int]:
        self.check_length(text)
        self.check_head_tokens(text)
        return self._encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        raw = getattr(self._hf, "_tokenizer", None)
        if hasattr(raw, "encode_batch"):  # releases the GIL, unlike encode
            (enc,) = raw.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(enc.ids)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- helpers -------------------------------------------------------------
    def _template(self, messages, generation_prompt: bool, kwargs) -> str:
        return self._render(messages, generation_prompt, kwargs)

    def _sample_text(self) -> str:
        if not getattr(self._tokenizer, "has_chat_template", False):
            return ""
        try:
            return self._template(SAMPLE_CHAT, True, {})
        except Exception:  # noqa: BLE001 - the encoder's synthetic sample still checks
            return ""

    def _reusable(
        self, conversation: Conversation | None, text: str
    ) -> tuple[Snapshot | None, int]:
        """The snapshot sharing the most placed messages with this request, and
        how many of them it places as this request's own placing would."""
        best, reused = None, 0
        if conversation is None:
            return None, 0
        for snapshot in self._snapshots.candidates(conversation.key):
            if snapshot.conversation.kwargs != conversation.kwargs:
                continue
            # its last message was placed as the last one (generation prompt after it)
            k = min(
                common_prefix(snapshot.messages, conversation.messages),
                snapshot.walk.placed,
                len(snapshot.messages) - 1,
            )
            if k > reused:
                best, reused = snapshot, k
        if best is None:
            return None, 0
        if not text.startswith(best.text[: best.walk.horizon[reused]]):
            return None, 0
        if best.walk.spent[reused] > fallback_budget(text):
            return None, 0  # this request's own placing would have stopped earlier
        return best, reused

    def _parts(
        self,
        messages: list[dict[str, Any]],
        text: str,
        walk: Walk,
        tokens: Tokens,
        old: tuple[Part, ...],
        kept: int,
    ) -> tuple[Part, ...]:
        """Placed messages: ``old`` ones reused (their token positions too where
        their text lies before ``kept``, the character up to which tokens were
        reused), the rest computed."""
        intact = bisect_right(old, kept, key=lambda p: p.slice.end)
        parts = list(old[:intact])
        parts += (_place(p, tokens) for p in old[intact:])
        for k in range(len(old), walk.placed):
            s = MessageSlice(walk.bounds[k], walk.bounds[k + 1], messages[k]["role"])
            spans = tuple(prompt_spans(text, [s]))
            part = Part(s, spans, _message_hash(text, spans, s, messages[k]), 0, ())
            parts.append(_place(part, tokens))
        return tuple(parts)

    @staticmethod
    def _key(tokens: Tokens, parts: tuple[Part, ...], newest_user: int | None = None) -> PromptKey:
        """``newest_user``: the character where the newest user message's own text
        begins (None: not known, and then no value is read for being in it)."""
        if tokens.monotone:
            spans = merge_ranges(r for p in parts for r in p.ranges)
        else:
            offsets = list(zip(tokens.starts, tokens.ends))
            spans = token_spans(offsets, [s for p in parts for s in p.spans])
        system_end = 0
        for p in parts:
            if p.slice.role not in SYSTEM_ROLES:
                break
            system_end = p.end_token
        newest = None
        if newest_user is not None:  # a token that straddles its start is its own
            newest = _token_at(tokens, newest_user)
        return PromptKey.build(tokens.ids, spans, [p.end_token for p in parts], system_end, newest)


# a head of this many characters per token of context is tokenised before the
# whole text (English runs ~4); the slack covers a token cut at the head's end
PROBE_CHARS_PER_TOKEN = 8
PROBE_SLACK = 16


def max_prompt_chars(hf: Any, context_length: int | None) -> int | None:
    """The most characters ``context_length`` tokens can stand for: no token
    decodes to more characters than its vocabulary string has, and a normaliser
    may shrink text (NFC composes up to 3 characters into 1) before it is split."""
    if not context_length:
        return None
    try:
        longest = max(map(len, hf.get_vocab()))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: no bound
        return None
    raw = getattr(hf, "_tokenizer", None)
    shrink = 1 if raw is not None and getattr(raw, "normalizer", None) is None else 4
    return context_length * longest * shrink


def _newest_user_text(
    messages: Sequence[dict[str, Any]], text: str, parts: tuple[Part, ...]
) -> int | None:
    """Where the newest user message's own text begins in ``text``, or None where
    it has no place (its text was not scanned: no span to read) or is not found.

    Not where its rendered slice begins: Gemma 3 and Llama 2 fold the system
    prompt into the first user turn, and its per-request nonce (Claude Code's
    ``cch=``) then ended every hit of a one-query agent. Not found (a template
    that rewrites the user's text), the rule is off rather than the slice's start
    taken, which would again read that folded system prompt's values: a stale
    value stands in the user's edit, as one does in any older message."""
    newest = max((k for k, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if not 0 <= newest < len(parts):
        return None
    s = parts[newest].slice
    return own_text_start(text, s.start, s.end, messages[newest].get("content"))


def own_text_start(text: str, start: int, end: int, content: Any) -> int | None:
    """Where ``content`` (a string, or its text parts in order) begins within
    ``text[start:end]`` (templates may trim it: each part is looked for stripped),
    found from the end (a system prompt folded before it may hold the same text);
    its end when it has no text, None when a part is not there.

    Linear in the slice and the parts: ``str.rfind`` has no linear worst case
    (CPython searches backwards naively), so the reversed slice is searched
    forwards, each part from where the later one was found."""
    pieces: list[Any]
    if isinstance(content, str):
        pieces = [content]
    elif isinstance(content, list):
        pieces = [p.get("text") for p in content if isinstance(p, dict)]
    elif content is None:
        pieces = []
    else:
        return None
    needles = [p.strip()[::-1] for p in pieces if isinstance(p, str) and p.strip()]
    backwards = text[start:end][::-1]
    at = 0  # characters of the slice's end already matched to later parts
    for needle in reversed(needles):
        found = backwards.find(needle, at)
        if found < 0:
            return None
        at = found + len(needle)
    return end - at


def _token_at(tokens: Tokens, char: int) -> int:
    """The first token ending past ``char`` (the one holding it, or the next)."""
    if tokens.monotone:
        return bisect_right(tokens.ends, char)
    return next((t for t, e in enumerate(tokens.ends) if e > char), len(tokens.ids))


def _place(part: Part, tokens: Tokens) -> Part:
    """``part`` with its token positions in ``tokens``."""
    return dataclasses.replace(
        part,
        end_token=bisect_left(tokens.starts, part.slice.end),
        ranges=tuple(token_range(tokens, s) for s in part.spans),
    )


def _message_hash(
    text: str, spans: Sequence[CharSpan], s: MessageSlice, message: dict[str, Any]
) -> str:
    canon = canonical_text(text, spans, s.start, s.end)
    calls = canonical_tool_calls(message.get("tool_calls"))
    return hashlib.blake2b((canon + "\x00" + calls).encode(), digest_size=12).hexdigest()
