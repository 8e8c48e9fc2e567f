"""Chat messages -> prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChatFormatter:
    """Implements scheduler.contracts.PromptFormatter over an mlx-lm TokenizerWrapper.

    Safe to call from the HTTP thread: the fast tokenizer is thread-safe and no
    MLX is involved.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def render_chat(self, messages: Sequence[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        if getattr(self._tokenizer, "has_chat_template", False):
            ids = self._tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs
            )
            return list(ids)
        # No template: a plain transcript the base model can continue.
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return self.encode(text + "assistant:")

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))
