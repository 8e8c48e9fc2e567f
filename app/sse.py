"""Server-sent events framing shared by every streaming dialect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# a stream item's frame, or its frames to build one at a time (a long run of logprobs)
Frames = str | Iterator[str]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


# Line breaks JSON lets through raw but str.splitlines (httpx's iter_lines, many
# Python SSE clients) splits at: one would cut a data line in two.
_SPLITLINES_BREAKS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\u0085", "\\u0085"))


def sse_json(value: Any) -> str:
    """``value`` as one line of compact UTF-8 JSON: the three line breaks above
    escaped (the same JSON), each replaced only when present."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for raw, escaped in _SPLITLINES_BREAKS:
        if raw in text:
            text = text.replace(raw, escaped)
    return text


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {sse_json(payload)}\n\n"


class FrameTemplate:
    """A stream's data frame that differs per event in one value (``HOLE``): the
    rest (a chunk's id, model, constant fields) is encoded once per stream, not
    once per token. The bytes are ``sse_data``'s for the same payload."""

    HOLE = "\x00kvwarm-hole\x00"

    def __init__(self, payload: dict[str, Any]):
        head, *rest = sse_data(payload).split(json.dumps(self.HOLE))
        if len(rest) != 1:
            raise ValueError("a frame template needs exactly one HOLE")
        self._head, self._tail = head, rest[0]

    def __call__(self, value: Any) -> str:
        return self._head + sse_json(value) + self._tail


SSE_DONE = "data: [DONE]\n\n"
# an SSE comment: clients skip it, proxies and idle timeouts see a live stream
SSE_KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 10.0  # a long queue wait or prefill must not look like a dead server


def sse_event(event: str, payload: dict[str, Any]) -> str:
    """A named event (Anthropic and Responses streams name every event)."""
    return f"event: {event}\ndata: {sse_json(payload)}\n\n"


async def with_heartbeat(items: AsyncIterator[T], interval: float) -> AsyncIterator[list[T] | None]:
    """``items`` in batches: every item that arrived since the last batch was
    taken, and None whenever ``interval`` seconds pass without one, so a stream can
    send keep-alives through a long prefill. Closing this iterator closes ``items``
    (which aborts the request).

    A batch lets a stream that fell behind (a busy event loop, a large batch
    producing faster than it is sent) catch up in one socket write instead of one
    per token. A task drains ``items`` into a buffer (an async generator cannot be
    waited on with a timeout without cancelling it); the reader waits on one future
    and one timer per idle wait."""
    loop = asyncio.get_running_loop()
    buffer: list[tuple[bool, Any]] = []
    wake: asyncio.Future[None] | None = None

    def push(entry: tuple[bool, Any]) -> None:
        buffer.append(entry)
        if wake is not None:
            _wake(wake)

    async def pump() -> None:
        try:
            async for item in items:
                push((False, item))
            push((True, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            push((True, exc))

    task = asyncio.create_task(pump())
    try:
        while True:
            if not buffer:
                wake = loop.create_future()
                timer = loop.call_later(interval, _wake, wake)
                try:
                    await wake
                finally:
                    timer.cancel()
                    wake = None
                if not buffer:
                    yield None  # idle for ``interval``
                    continue
            taken = buffer[:]
            del buffer[:]
            batch = [value for done, value in taken if not done]
            if batch:
                yield batch
            if taken[-1][0]:  # the end: items are exhausted or failed
                value = taken[-1][1]
                if isinstance(value, BaseException) and not isinstance(
                    value, asyncio.CancelledError
                ):
                    raise value
                return
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def frame_parts(frames: Frames) -> Iterator[str]:
    """``frames`` one at a time: a caller writing several lets the event loop run
    after each (a long run of them, built in one turn, stalled every stream)."""
    return iter((frames,)) if isinstance(frames, str) else frames


async def frames_written(frames: Frames) -> AsyncIterator[str]:
    """``frames`` one at a time, the event loop let in after each (a long run of
    logprob frames: one built per turn)."""
    for part in frame_parts(frames):
        yield part
        await asyncio.sleep(0)


async def framed(
    events: AsyncIterator[T],
    frame: Callable[[T], Frames],
    keepalive: str = SSE_KEEPALIVE,
    on_error: Callable[[Exception], None] | None = None,
) -> AsyncIterator[bytes]:
    """A stream's body: each batch of ``events`` that is waiting framed into one
    string (one socket write however far the stream fell behind), ``keepalive``
    whenever ``KEEPALIVE_S`` pass without one. A fault producing or framing an
    event goes to ``on_error`` and ends the body: the caller then sends its
    dialect's error event (once the headers are out, nothing else can tell the
    client; the connection was cut mid-chunk). Frames are encoded here, inside
    that guard: text UTF-8 cannot hold failed in the server's write, after it,
    and cut the stream with no error event. An item framed in parts has each
    built in an event-loop turn of its own and written as it is built."""
    try:
        async for batch in with_heartbeat(events, KEEPALIVE_S):
            if batch is None:
                yield keepalive.encode()
                continue
            text: list[str] = []
            for item in batch:
                out = frame(item)
                if isinstance(out, str):
                    text.append(out)
                    continue
                for part in out:  # built one per event-loop turn, each written as built
                    text.append(part)
                    yield "".join(text).encode()
                    text.clear()
                    await asyncio.sleep(0)
            if text:
                yield "".join(text).encode()
    except Exception as exc:  # noqa: BLE001 - this stream fails alone
        if on_error is None:
            raise
        on_error(exc)
