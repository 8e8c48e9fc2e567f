"""Content parts of every dialect flattened to the text a text model reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.errors import APIError

IMAGE_OMITTED = "[image omitted: this model cannot read images]"
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "reasoning_text", "summary_text"})
IMAGE_PARTS = frozenset({"image", "input_image", "image_url", "document", "input_file"})


def parts_text(content: Any, where: str, in_tool_result: bool = False) -> str:
    """Text parts joined by newlines. An image the user sends is refused (400); one
    inside a tool result (a screenshot tool) becomes a visible note, so an agent
    whose history holds one can go on."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts.", param=where)
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            raise APIError(400, "content parts must be objects.", param=where)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            out.append(str(part.get("text", "")))
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind in IMAGE_PARTS and in_tool_result:
            out.append(IMAGE_OMITTED)
        elif kind in IMAGE_PARTS:
            raise APIError(400, f"{kind} content is not supported by this model", param=where)
        else:
            raise APIError(400, f"Unsupported content part type {kind!r}.", param=where)
    return "\n".join(out)
