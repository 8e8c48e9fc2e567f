"""What a streaming detokenizer has emitted, for ``engine.text_output`` to read."""

from __future__ import annotations


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
