"""Request bodies: read on the event loop, parsed and prepared off it, within budgets.

The loop only moves bytes. JSON parsing, validation, rendering and tokenising run
in a worker thread (never MLX: that is the engine thread's), one bounded pool
for every route. Before anything is parsed, a cheap byte scan bounds the JSON's
size in values: C parsers hold the GIL for a whole document, so a body of a
million tiny values would stall every other request while it parsed, and no
prompt that fits the model's context needs that many.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import anyio
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ValidationError

from app.errors import APIError, describe_errors
from app.middleware import RELEASE_BODY

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# JSON values a request may hold per token of the model's context: prose has a
# comma every dozen tokens, JSON tool results a few values per token; 8 is far
# above anything a prompt that fits could hold
VALUES_PER_CONTEXT_TOKEN = 8
VALUES_FLOOR = 16_384
PREPARE_THREADS = 2  # preparations at once on the CPU; more would only contend for the GIL
# preparations at once waiting on the network or a subprocess (an image URL,
# ffmpeg) with their CPU slot given up; past this, more such waits are refused
MEDIA_WAITS = 8
# of those, subprocesses decoding at once (ffmpeg, a core each): a wait for them
# is no idle one, and eight beside the CPU slots starved the engine thread
DECODERS = 1
SCAN_WINDOW = 1 << 20


@dataclass(frozen=True)
class BodyLimits:
    """What one request may contain for the loaded model (validation context)."""

    max_values: int  # JSON objects + arrays + separators
    max_messages: int  # a message costs at least one token of context

    @classmethod
    def for_context(cls, context_length: int) -> BodyLimits:
        return cls(
            max_values=VALUES_PER_CONTEXT_TOKEN * context_length + VALUES_FLOOR,
            max_messages=context_length,
        )

    def too_many_values(self, raw: bytes) -> bool:
        """Whether ``raw`` holds more JSON values than ``max_values`` (counted at
        memchr speed, stopping once over)."""
        return json_values(raw, stop_above=self.max_values) > self.max_values


def json_values(raw: bytes, stop_above: int | None = None) -> int:
    """An upper bound on the values in a JSON document, at memchr speed, counted a
    window at a time (the GIL is free between windows) and stopping once over
    ``stop_above``."""
    total = 0
    for start in range(0, len(raw), SCAN_WINDOW):
        end = start + SCAN_WINDOW
        total += raw.count(b"{", start, end) + raw.count(b"[", start, end)
        total += raw.count(b",", start, end)
        if stop_above is not None and total > stop_above:
            break
    return total


def parse_body(raw: bytes, model: type[M], context_length: int) -> M:
    """Validate ``raw`` against ``model`` for a model with ``context_length`` tokens of
    context (400 on any breach, naming the field)."""
    limits = BodyLimits.for_context(context_length)
    if limits.too_many_values(raw):
        raise APIError(
            400,
            f"The request body holds over {limits.max_values} JSON values; a request for this model "
            f"can hold at most {limits.max_values} (its context could never fit more).",
            code="body_too_complex",
        )
    try:
        parsed = model.model_validate_json(raw, context={"limits": limits})
    except ValidationError as exc:
        message, param = describe_errors(exc.errors(), raw)
        raise APIError(400, message, code="invalid_request", param=param) from exc
    check_finite(parsed)
    return parsed


def check_finite(parsed: BaseModel) -> None:
    """Refuse NaN, Infinity and numbers too large for a double anywhere in the
    request. Typed fields refuse them already, but free-form values (metadata,
    tool schemas, extra fields) would reach a response that echoes them, and
    JSON cannot carry them: the reply would fail after the whole generation.

    A walk over the validated values, not a second parse of the body: a C parser
    holds the GIL for the whole document (50 ms for 30 MB), and the walk's
    bytecode lets the event loop in; it costs a step per container, none per
    string byte."""
    where = nonfinite_path(parsed)
    if where is not None:
        raise APIError(
            400,
            f"JSON numbers must be finite: `{where}` is NaN, Infinity or too large for a double.",
            code="invalid_request",
            param=where,
        )


def nonfinite_path(root: object) -> str | None:
    """The dotted path (JSON names) to the first non-finite float under ``root``
    (pydantic models, their extra fields, dicts, lists and tuples), or None."""
    isfinite = math.isfinite
    # (value, node); node = (parent node, key, the container holding key) or None
    stack: list[tuple[object, tuple | None]] = [(root, None)]
    while stack:
        value, node = stack.pop()
        items: Iterable[tuple[object, object]]
        if isinstance(value, BaseModel):
            if value.__pydantic_extra__:
                stack.append((value.__pydantic_extra__, node))
            items = value.__dict__.items()
        elif isinstance(value, dict):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            continue
        for key, item in items:
            kind = type(item)
            if kind is float:
                if not isfinite(item):
                    return _dotted((node, key, value))
            elif kind not in _SCALARS:  # most values: no isinstance (an ABC check) for them
                stack.append((item, (node, key, value)))
    return None


_SCALARS = frozenset({str, int, bool, type(None)})


def _dotted(node: tuple | None) -> str:
    keys: list[str] = []
    while node is not None:
        node, key, container = node
        field = type(container).model_fields.get(key) if isinstance(container, BaseModel) else None
        keys.append((field.alias or str(key)) if field is not None else str(key))
    return ".".join(reversed(keys))


class Preparer:
    """Runs request preparation in worker threads, off the event loop: at most
    ``threads`` at once on the CPU. A job waiting on the network or a subprocess
    (``io_wait``: an image URL, ffmpeg) gives its CPU slot up meanwhile, so a
    slow download holds no other agent's request back."""

    def __init__(
        self,
        threads: int = PREPARE_THREADS,
        media_waits: int = MEDIA_WAITS,
        decoders: int = DECODERS,
    ):
        self._cpu = _Gate(threads, media_waits, decoders)
        # threads: every CPU slot plus every wait, so waiting jobs never starve the CPU's
        self._limiter = anyio.CapacityLimiter(threads + media_waits)

    async def run(self, job: Callable[[], T]) -> T:
        gate = self._cpu

        def gated() -> T:
            with gate.slot():
                token = _GATE.set(gate)
                try:
                    return job()
                finally:
                    _GATE.reset(token)

        return await anyio.to_thread.run_sync(gated, limiter=self._limiter)

    async def body(self, http: HTTPRequest, job: Callable[[bytes], T]) -> T:
        """Receive the body (the loop's part), then join it and run ``job(raw)`` in the
        pool: even joining a 30 MB body would hold the loop for tens of ms."""
        try:
            chunks = [chunk async for chunk in http.stream()]
            return await self.run(lambda: job(b"".join(chunks)))
        finally:
            release = http.scope.get(RELEASE_BODY)
            if release is not None:
                release()  # prepared (or failed): its bytes no longer count


class _Gate:
    """CPU slots for preparation jobs, the count of jobs waiting on I/O, and the
    slots of decoding subprocesses."""

    def __init__(self, slots: int, max_waits: int, decoders: int):
        self._slots = threading.Semaphore(slots)
        self.decoders = threading.Semaphore(decoders)
        self._max_waits = max_waits
        self._waits = 0
        self._lock = threading.Lock()

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._slots:
            yield

    @contextmanager
    def released(self) -> Iterator[None]:
        with self._lock:
            if self._waits >= self._max_waits:
                raise APIError(
                    503,
                    f"{self._waits} requests are already waiting on image downloads or video "
                    "decoding; retry shortly.",
                    "overloaded_error",
                    code="media_busy",
                    headers={"Retry-After": "1"},
                )
            self._waits += 1
        self._slots.release()
        try:
            yield
        finally:
            self._slots.acquire()
            with self._lock:
                self._waits -= 1


_GATE: ContextVar[_Gate | None] = ContextVar("kvwarm_prepare_gate", default=None)


@contextmanager
def io_wait() -> Iterator[None]:
    """Around a preparation's wait on the network: its CPU slot goes to another
    request meanwhile (outside a Preparer job: no effect)."""
    gate = _GATE.get()
    if gate is None:
        yield
        return
    with gate.released():
        yield


@contextmanager
def decoder_wait(timeout: float) -> Iterator[None]:
    """Around a preparation's decoding subprocesses (ffmpeg): its CPU slot goes to
    another request, and they run in one of the few decoder slots, waited for up to
    ``timeout`` seconds (then a 503: the server is busy, the video may be fine)."""
    gate = _GATE.get()
    if gate is None:
        yield
        return
    with gate.released():
        if not gate.decoders.acquire(timeout=timeout):
            raise APIError(
                503,
                f"other videos have been decoding for {timeout:g} s; retry shortly.",
                "overloaded_error",
                code="media_busy",
                headers={"Retry-After": "5"},
            )
        try:
            yield
        finally:
            gate.decoders.release()
