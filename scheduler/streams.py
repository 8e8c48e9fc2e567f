"""Per-request async streams fed from the engine thread, one hop per step."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from scheduler.request import RequestOutput


class OutputRouter:
    """Owns one asyncio.Queue per in-flight request.

    The engine thread calls ``publish`` with everything one step produced; that is
    a single ``call_soon_threadsafe`` into the event loop, however many tokens.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

    def open(self, request_id: str) -> asyncio.Queue[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def publish(self, outputs: Iterable[RequestOutput]) -> None:
        batch = list(outputs)
        if not batch:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, batch)
        except RuntimeError:  # the loop closed (the server exited): nobody reads them
            pass

    def _dispatch(self, batch: list[RequestOutput]) -> None:
        for output in batch:
            queue = self._queues.get(output.request_id)
            if queue is not None:  # None: the client already left
                queue.put_nowait(output)

    def end_open(self, final: Callable[[str], RequestOutput]) -> int:
        """End every open stream with ``final(request_id)`` now, on the loop (the
        engine, busy in a step, would end them only when it returns); what the
        engine publishes for them later is dropped, as for a closed stream.
        Returns how many were ended."""
        queues, self._queues = self._queues, {}
        for request_id, queue in queues.items():
            queue.put_nowait(final(request_id))
        return len(queues)

    def __len__(self) -> int:
        return len(self._queues)
