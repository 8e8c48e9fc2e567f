"""Client-chosen text (session ids, field names) made safe for a log line or a
header: escaped to ASCII, so a newline in it cannot forge a log line and a header
stays latin-1."""

from __future__ import annotations


def ascii_escaped(value: str, limit: int | None = None) -> str:
    shown = value.encode("unicode_escape").decode("ascii")
    return shown if limit is None else shown[:limit]
