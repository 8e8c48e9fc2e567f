"""A minimal streaming client for any OpenAI-compatible chat completions server.

Used by `kvwarm chat`. It speaks plain HTTP through httpx and parses the SSE stream
by hand, so it works against kvwarm, mlx_lm.server, llama.cpp, vLLM or OpenAI alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx


class ChatError(Exception):
    """A failure worth one readable line: HTTP error, unreachable server, bad stream."""


@dataclass(frozen=True)
class Delta:
    """One streamed piece of the reply: reasoning and/or answer text."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class Usage:
    completion_tokens: int | None
    cached_tokens: int


def base_url(host: str) -> str:
    """`127.0.0.1:8080`, `http://h:8080` or `https://h/v1` -> the API root ending in /v1."""
    url = host.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme = httpx.URL(url).scheme
    if scheme not in ("http", "https"):  # no later turn could reach it: not "will retry"
        raise ValueError(f"a {scheme}:// URL; the server speaks http:// or https://")
    # A URL that already names a path (`.../v1`, `.../openai/v1`) is taken as the API root.
    if httpx.URL(url).path in ("", "/"):
        url += "/v1"
    return url


def _error_message(response: httpx.Response) -> str:
    """`HTTP 400 Bad Request: <the OpenAI error body's message>`."""
    detail = response.text.strip()
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(error, dict):
            detail = str(error.get("message") or error.get("detail") or error)
        elif isinstance(error, str):
            detail = error
    except ValueError:
        pass
    status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
    return f"{status}: {detail[:500]}" if detail else status


class ChatClient:
    def __init__(self, host: str, api_key: str | None = None, origin: str = "") -> None:
        """``origin``: where ``host`` came from, said when it cannot be reached."""
        self.base = base_url(host)
        self._unreachable = f"cannot reach {self.base}" + (f" ({origin})" if origin else "")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a long prompt's prefill can keep the first byte away for
        # minutes on a CPU; Ctrl-C is the way out.
        self._http = httpx.Client(
            base_url=self.base, headers=headers, timeout=httpx.Timeout(10.0, read=None)
        )

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> str:
        """The first id GET /v1/models lists: the server's default model."""
        try:
            response = self._http.get("/models")
        except httpx.TransportError as exc:
            raise ChatError(f"{self._unreachable}: {exc}") from exc
        if response.is_error:
            raise ChatError(_error_message(response))
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatError(f"{self.base}/models lists no model") from exc

    def stream(self, body: dict[str, Any]) -> Generator[Delta | Usage, None, None]:
        """POST a streaming chat completion and yield its deltas, then its usage.

        Closing the generator (as Ctrl-C does) closes the HTTP stream, which tells
        the server to stop generating.
        """
        answering = False  # headers in: a transport failure now is no unreachable server
        try:
            with self._http.stream("POST", "/chat/completions", json=body) as response:
                answering = True
                if response.is_error:
                    response.read()
                    raise ChatError(_error_message(response))
                kind = response.headers.get("content-type", "")
                if response.status_code != 200 or not kind.startswith("text/event-stream"):
                    # a redirect, or a proxy's page: no stream, and no reply to show
                    where = response.headers.get("location")
                    raise ChatError(
                        f"{self.base} answered {response.status_code} "
                        + (f"redirecting to {where}" if where else f"with {kind or 'no type'}")
                        + ", not an event stream"
                    )
                finished = False  # a finish_reason: complete even if [DONE] never comes
                for line in sse_lines(response.iter_bytes()):
                    if not line.startswith("data:"):
                        continue  # blank separators, `event:` lines, `: keep-alive` comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    finished = (yield from _parse_chunk(data)) or finished
        except httpx.TransportError as exc:
            if answering:  # it was reached: "cannot reach" would send the user the wrong way
                raise ChatError(f"the connection closed mid-reply: {exc}") from exc
            raise ChatError(f"{self._unreachable}: {exc}") from exc
        # a server that crashed (or a proxy that timed out) just closes the stream:
        # what came so far is no whole reply, and must not join the conversation
        if not finished:
            raise ChatError("the stream ended before the reply was complete")


_LINE_END = re.compile(rb"\r\n|\r|\n")


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """An event stream's lines, ended by CR, LF or CRLF only (the SSE grammar).

    Not ``iter_lines``: it splits as str.splitlines does, also at U+2028, U+2029
    and U+0085, which JSON strings may hold raw, cutting a data line in two.
    Lines are split as bytes (CR and LF never occur inside a UTF-8 character),
    and only the newest piece is scanned, so a long line costs linear time."""
    pending = bytearray()
    skip_lf = False  # the last piece ended in CR: an LF opening the next one ends no line
    for chunk in chunks:
        if skip_lf and chunk:
            skip_lf = False
            chunk = chunk[1:] if chunk[:1] == b"\n" else chunk
        ends = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if ends < 0:
            pending += chunk
            continue
        skip_lf = chunk.endswith(b"\r")
        pending += chunk[: ends + 1]
        *lines, _ = _LINE_END.split(bytes(pending))
        pending = bytearray(chunk[ends + 1 :])
        for line in lines:
            yield line.decode("utf-8", "replace")
    if pending:  # a last line with no line end
        yield pending.decode("utf-8", "replace")


def _parse_chunk(data: str) -> Generator[Delta | Usage, None, bool]:
    """Yield a chunk's deltas and usage; return whether it carried a finish_reason."""
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise ChatError(f"unreadable stream chunk: {data[:200]}") from exc
    if not isinstance(chunk, dict):
        return False
    if chunk.get("error"):  # some servers report mid-stream failures as a data chunk
        error = chunk["error"]
        raise ChatError(str(error.get("message", error) if isinstance(error, dict) else error))
    finished = False
    # what is not shaped as the spec says (`"choices": [null]`) is passed over: one
    # odd chunk from some server is no reason to lose the conversation
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        finished = finished or bool(choice.get("finish_reason"))
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        # `reasoning_content` (DeepSeek, vLLM, kvwarm) or `reasoning` (OpenRouter, Ollama)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        content = delta.get("content") or ""
        if reasoning or content:
            yield Delta(reasoning=str(reasoning), content=str(content))
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        yield Usage(
            completion_tokens=_count(usage.get("completion_tokens")),
            cached_tokens=_count(cached) or 0,
        )
    return finished


def _count(value: object) -> int | None:
    """A token count, or None for what is none (the stats line does sums with it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
