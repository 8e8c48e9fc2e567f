"""Chat messages -> model tokens and the cache-key view of them (both pipelines).

The model tokens are the chat template's rendering of the messages exactly as
sent (after healing). Volatile spans are located in that rendered text message
by message (``scheduler.volatile_rules``) and mapped onto tokens through the
tokenizer's offsets, so the cache key is derived from the very tokens the model
reads and the two views can never drift apart. Per-message token boundaries come
from rendering growing prefixes of the conversation (cumulative rendering).
"""

from __future__ import annotations

import hashlib
import logging
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from scheduler.healing import canonical_tool_calls
from scheduler.prompt_key import PromptKey, RenderedPrompt, token_spans
from scheduler.volatile_rules import (
    MessageSlice,
    canonical_text,
    prompt_spans,
    relocate_volatile_lines,
)

log = logging.getLogger("kvwarm.prompt")
TAIL_CHARS = 64


class ChatFormatter:
    """Implements scheduler.contracts.PromptFormatter over an mlx-lm TokenizerWrapper.

    Safe to call from the HTTP thread: the fast tokenizer is thread-safe and no
    MLX is involved.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._warned = False

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        relocate_volatile: bool = False,
        **template_kwargs: Any,
    ) -> RenderedPrompt:
        messages = [dict(m) for m in messages]
        if relocate_volatile:
            contents = relocate_volatile_lines(
                [m.get("content") for m in messages], [m["role"] for m in messages]
            )
            for m, content in zip(messages, contents):
                m["content"] = content
        if not getattr(self._tokenizer, "has_chat_template", False):
            # No template: a plain transcript the base model can continue.
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            text += "assistant:"
            return RenderedPrompt(PromptKey.build(self.encode(text)), tail=text[-TAIL_CHARS:])
        text = self._template(messages, True, template_kwargs)
        slices = self._message_slices(messages, text, template_kwargs)
        ids, offsets = self._encode_with_offsets(text)
        if ids is None:  # tokenizer without offsets: no spans, still a correct prompt
            ids = list(
                self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, **template_kwargs
                )
            )
            return RenderedPrompt(PromptKey.build(ids), tail=text[-TAIL_CHARS:])
        char_spans = prompt_spans(text, slices)
        starts = [o[0] for o in offsets]
        ends = [bisect_left(starts, s.end) for s in slices]
        system_end = 0
        for s, end in zip(slices, ends):
            if s.role not in ("system", "developer"):
                break
            system_end = end
        hashes = tuple(self._message_hash(text, char_spans, s, m) for s, m in zip(slices, messages))
        key = PromptKey.build(ids, token_spans(offsets, char_spans), ends, system_end)
        return RenderedPrompt(key, hashes, tail=text[-TAIL_CHARS:])

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    # -- helpers -------------------------------------------------------------
    def _template(self, messages, generation_prompt: bool, kwargs) -> str:
        return self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    def _message_slices(self, messages, text: str, kwargs) -> list[MessageSlice]:
        """Character range of each message, from rendering growing prefixes. Stops
        at the first prefix the full rendering does not start with (templates
        that rewrite earlier turns): later messages then get no slice."""
        slices: list[MessageSlice] = []
        prev = 0
        for k in range(1, len(messages) + 1):
            try:
                partial = self._template(messages[:k], False, kwargs)
            except Exception:  # noqa: BLE001 - e.g. templates that demand a user turn
                break
            if not text.startswith(partial) or len(partial) < prev:
                break
            slices.append(MessageSlice(prev, len(partial), messages[k - 1]["role"]))
            prev = len(partial)
        return slices

    def _encode_with_offsets(self, text: str):
        try:
            enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception:  # noqa: BLE001 - slow tokenizers have no offsets
            if not self._warned:
                log.warning("tokenizer gives no offsets: prompt cache keys ignore volatile spans")
                self._warned = True
            return None, None
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    @staticmethod
    def _message_hash(text: str, spans, s: MessageSlice, message: dict[str, Any]) -> str:
        canon = canonical_text(text, spans, s.start, s.end)
        calls = canonical_tool_calls(message.get("tool_calls"))
        return hashlib.blake2b((canon + "\x00" + calls).encode(), digest_size=12).hexdigest()
