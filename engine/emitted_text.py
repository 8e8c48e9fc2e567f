"""What a streaming detokenizer has emitted, for ``engine.text_output`` to read."""

from __future__ import annotations

from collections.abc import Callable


class EmittedText:
    """Pieces kept as emitted and joined only when ``text`` is read (``+=`` on the
    whole reply copied it on every token); each handed out once by ``take``."""

    __slots__ = ("_parts", "_segment")

    def __init__(self) -> None:
        self._parts: list[str] = []  # every piece emitted, none empty
        self._segment = ""  # emitted, not yet taken

    def __bool__(self) -> bool:
        return bool(self._parts)

    def emit(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            self._segment += piece

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def take(self) -> str:
        segment, self._segment = self._segment, ""
        return segment


class EmittedOutput:
    """The reading side of mlx-lm's ``StreamingDetokenizer`` interface over an
    ``EmittedText`` (``_out``), shared by kvwarm's detokenizers; each adds tokens
    with its own ``add_token``."""

    _out: EmittedText
    add_token: Callable[[int], None]  # the detokenizer's own (annotated: none defined here)

    @property
    def text(self) -> str:
        return self._out.text

    @property
    def last_segment(self) -> str:
        return self._out.take()

    def push(self, token: int) -> str:
        """Add ``token``; the text it completes (what ``last_segment`` would give)."""
        self.add_token(token)
        return self._out.take()
