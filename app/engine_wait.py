"""Awaiting a control job's answer (conversation KV, adapters) from the engine thread.

Control jobs run between two steps: behind a step that never returns (a GPU hang,
swap thrash) their callers waited for ever. Past --stall-timeout they get a 503.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TypeVar

from app.state import AppState
from scheduler.admission import EngineUnavailable

T = TypeVar("T")
STALL_POLL_S = 0.25  # how often a waiting call looks at the step in progress


async def engine_answer(state: AppState, future: Future[T]) -> T:
    """``future``'s result; EngineUnavailable (503, engine_stalled) once the engine's
    step or job in progress has run past --stall-timeout. A job not begun by then
    never runs; one running still finishes on the engine, unanswered."""
    waiting = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=STALL_POLL_S)
            if done:
                return waiting.result()
            try:
                state.check_not_stalled()
            except EngineUnavailable:
                waiting.cancel()  # cancels the job too, if it has not begun
                raise
    except asyncio.CancelledError:  # the caller went away: as awaiting the future did
        waiting.cancel()
        raise
