"""Server-sent events framing shared by every streaming dialect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# an SSE comment: clients skip it, proxies and idle timeouts see a live stream
SSE_KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_S = 10.0  # a long queue wait or prefill must not look like a dead server


def sse_event(event: str, payload: dict[str, Any]) -> str:
    """A named event (Anthropic and Responses streams name every event)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n"


async def with_heartbeat(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """``items``, with a None whenever ``interval`` seconds pass without one, so a
    stream can send keep-alives through a long prefill. Closing this iterator
    closes ``items`` (which aborts the request)."""
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in items:
                await queue.put((False, item))
            await queue.put((True, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((True, exc))

    task = asyncio.create_task(pump())
    getter: asyncio.Task | None = None
    try:
        while True:
            # one pending get survives timeouts, so no item is lost to a cancellation
            getter = getter or asyncio.create_task(queue.get())
            ready, _ = await asyncio.wait({getter}, timeout=interval)
            if not ready:
                yield None
                continue
            done, value = getter.result()
            getter = None
            if done:
                if isinstance(value, BaseException) and not isinstance(
                    value, asyncio.CancelledError
                ):
                    raise value
                return
            yield value
    finally:
        for pending in (getter, task):
            if pending is not None:
                pending.cancel()
        with contextlib.suppress(BaseException):
            await task
