"""Content parts of every dialect flattened to the text a text model reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.errors import APIError
from app.images import source_of

IMAGE_OMITTED = "[image omitted: this model cannot read images]"
DOCUMENT_OMITTED = "[document omitted: this model reads plain-text documents only]"
DOCUMENT_PARTS = frozenset({"document", "input_file"})
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "reasoning_text", "summary_text"})
IMAGE_PARTS = frozenset(
    {"image", "input_image", "image_url", "video_url", "document", "input_file"}
)
# a vision model reads these (a video as frames: app.video_frames)
IMAGE_KINDS = frozenset({"image", "input_image", "image_url", "video_url"})


def parts_content(
    content: Any, where: str, in_tool_result: bool = False
) -> str | list[dict[str, Any]]:
    """User or tool content: its text, or, when it holds images, its parts in
    order (``{"type": "text", "text"}`` and ``{"type": "image", "source"}``),
    which request preparation resolves for the model (app.image_prompt)."""
    if not isinstance(content, list) or not any(
        isinstance(p, Mapping) and p.get("type") in IMAGE_KINDS for p in content
    ):
        return parts_text(content, where, in_tool_result)
    out: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") in IMAGE_KINDS:
            out.append({"type": "image", "source": source_of(dict(part), f"{where}.{i}")})
        else:
            out.append({"type": "text", "text": parts_text([part], where, in_tool_result)})
    return out


def parts_text(content: Any, where: str, in_tool_result: bool = False) -> str:
    """Text parts joined by newlines. Images are refused here (400): only user
    and tool content carries them (``parts_content``)."""
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
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(400, f"a {kind} part needs a text string.", param=where)
            out.append(text)
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        elif kind == "document" and (text := document_text(part, where)) is not None:
            out.append(text)
        elif kind in DOCUMENT_PARTS and in_tool_result:
            out.append(DOCUMENT_OMITTED)
        elif kind in IMAGE_PARTS and in_tool_result:
            out.append(IMAGE_OMITTED)
        elif kind in IMAGE_PARTS:
            raise APIError(400, f"{kind} content is not supported by this model", param=where)
        else:
            raise APIError(400, f"Unsupported content part type {kind!r}.", param=where)
    return "\n".join(out)


def document_text(part: Mapping[str, Any], where: str) -> str | None:
    """A plain-text document's text (Anthropic's ``text`` source, or ``content``
    blocks), its title first; None for a PDF or a URL, which a text model cannot read."""
    source = part.get("source")
    if not isinstance(source, Mapping):
        return None
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif kind == "content" and isinstance(source.get("content"), (str, list)):
        body = parts_text(source["content"], where)
    else:
        return None
    title = part.get("title")
    return f"{title}\n{body}" if isinstance(title, str) and title else body
