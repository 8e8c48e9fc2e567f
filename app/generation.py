"""Running one prepared chat request: engine outputs -> parser events -> outcome.

Dialects iterate ``Generation.events()`` (streaming) or await ``collect()`` and
render the result in their own wire format. Either way the same parser sees the
same text, so streamed and non-streamed answers agree, and the same bookkeeping
runs at the end: healing memory, abort on early close, one log line.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest

from app.chat_pipeline import Prepared
from app.errors import ENGINE_DOWN_CODE, APIError, from_admission
from app.middleware import BODY_RECEIVED, REQUEST_ID
from app.protocol.output_parser import Content, Event, Reasoning, merge
from app.protocol.tool_formats import ToolCall
from app.state import AppState
from engine.call_ids import fresh_short_id, is_short_id
from observability.escape import ascii_escaped
from observability.records import RequestRecord
from scheduler.admission import RETRY_AFTER_S, EngineUnavailable
from scheduler.request import (
    CacheReport,
    FinishReason,
    RequestOutput,
    RequestStats,
    TokenLogprob,
)
from scheduler.service import call_soon_on

log = logging.getLogger("kvwarm.http")

DISCONNECT_POLL_S = 0.25
# how long a streamed response's headers wait for admission (and the cache's
# answer) before going out without it: a queued client still gets bytes at once
HEADER_WAIT_S = 2.0
RETRYABLE = frozenset({"queue_timeout", "server_shutdown"})


@dataclass
class Outcome:
    """Everything one request produced, accumulated from its events."""

    # in output order as the parser gave them; ``events`` merges adjacent text when
    # read (merging per delta would copy the whole reply on every token)
    raw_events: list[Event] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    error: str | None = None
    error_code: str | None = None
    timed_out: bool = False  # cut short by the watchdog: delivered, never stored
    stop_sequence: str | None = None
    stats: RequestStats | None = None
    cache: CacheReport | None = None  # what the prefix cache did (from the first token on)
    reasoning_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    logprobs_sent: int = 0  # how many a stream has sent so far
    # len(logprobs) as each event was produced, until the stream frames it
    event_marks: deque[int] = field(default_factory=deque)
    _last: RequestOutput | None = field(default=None, repr=False)
    _merged: int = field(default=0, repr=False)  # raw_events already merged, from the start
    # tool calls among the events (merging keeps them): the stop kind without a scan
    _calls: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._calls = sum(isinstance(e, ToolCall) for e in self.raw_events)

    def add_output(self, out: RequestOutput) -> None:
        if out is self._last:  # the first output is added by start() and events() both
            return
        self._last = out
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.ttft is not None:
            self.ttft = out.ttft
        if out.cache is not None:
            self.cache = out.cache
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.error = out.error
            self.error_code = out.error_code
            self.timed_out = out.timed_out
            self.stop_sequence = out.stop_sequence
            self.stats = out.stats
            if out.stats is not None:
                self.cache = out.stats.cache

    def frame_logprobs(self, last: bool = False) -> list[TokenLogprob]:
        """The entries a stream's next frame carries, frames taken in event order:
        the tokens generated up to that frame's event that no earlier frame carried
        (the ``last`` frame: all that are left). Frames lag the events (a stream
        frames what is waiting in one write), so the mark taken when the event was
        produced, not the count now, says where a frame's entries end."""
        if last or not self.event_marks:
            end = len(self.logprobs)
        else:
            end = self.event_marks.popleft()
        fresh = self.logprobs[self.logprobs_sent : end]
        self.logprobs_sent = max(self.logprobs_sent, end)
        return fresh

    def fail(self, error: str) -> None:
        """Ends the outcome as a failure of this request alone (an internal error)."""
        self.finish_reason = FinishReason.ERROR
        self.error, self.error_code = error, "engine_error"

    def add_event(self, event: Event) -> None:
        self.raw_events.append(event)
        self._calls += isinstance(event, ToolCall)

    @property
    def events(self) -> list[Event]:
        """In output order, adjacent text of one kind merged (once: each of a
        reply's several reads merged all its events again, 5,000 calls beside
        text cost tens of ms on the event loop)."""
        if len(self.raw_events) > self._merged:
            self.raw_events[:] = merge(self.raw_events)
            self._merged = len(self.raw_events)
        return list(self.raw_events)

    @property
    def reasoning(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Reasoning))

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, Content))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [e for e in self.events if isinstance(e, ToolCall)]

    @property
    def failed(self) -> bool:
        return self.finish_reason == FinishReason.ERROR

    def failure(self) -> APIError:
        """The HTTP error for a request that failed: a fault of its own is a 500,
        a queue timeout or a shutdown is a 503 worth retrying. The request was
        accepted: /metrics counts it once, as finished in error, not as refused."""
        error = self._error()
        error.recorded = True
        return error

    def _error(self) -> APIError:
        if self.error_code in RETRYABLE:
            return APIError(
                503,
                self.error or "Service unavailable.",
                "server_error",
                self.error_code,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if self.error_code == ENGINE_DOWN_CODE:  # queued when the engine died
            # what a request arriving a moment later gets: no Retry-After, as the
            # engine's return is nobody's to promise (a supervisor restarts it)
            return from_admission(
                EngineUnavailable(f"The inference engine is not running: {self.error}")
            )
        if self.error_code == "adapter_not_found":  # unmounted between validation and start
            return APIError(400, self.error or "", code="adapter_not_found", param="adapter")
        if self.error_code == "context_over_budget":  # the budget shrank while it was queued
            return APIError(400, self.error or "", "memory_admission", "context_over_budget")
        return APIError(500, f"Generation failed: {self.error}", "server_error", "engine_error")

    @property
    def stop_kind(self) -> str:
        """``tool_calls`` when the turn ended in calls, else the engine's reason."""
        # read once per item by a Responses reply: a scan of the events each time
        # cost items x events on the event loop
        if self._calls and self.finish_reason == FinishReason.STOP:
            return "tool_calls"
        return self.finish_reason.value if self.finish_reason else "abort"


def _header_safe(value: str) -> str:
    """A client-chosen id as a header value: ASCII, bounded."""
    return ascii_escaped(value, 256)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class CallIds:
    """One reply's tool-call ids: the model's own where it wrote one (the next turn
    renders it back, so the reply's KV is reused), unless another call of the reply
    already has it or ``legal`` refuses it; then a fresh ``<prefix>_...`` id. Clients
    pair results with calls by id: two calls of one id lose a result. ``short``: the
    template reads only 9-alphanumeric ids (engine.call_ids), and a fresh id is
    one, so the id the client sends back is the very id the model reads."""

    def __init__(
        self, prefix: str, legal: re.Pattern[str] | None = None, short: bool = False
    ) -> None:
        self.prefix = prefix
        self.legal = legal
        self.short = short
        self.used: set[str] = set()

    def _allowed(self, own: str) -> bool:
        if self.short and not is_short_id(own):
            return False
        return self.legal is None or self.legal.fullmatch(own) is not None

    def __call__(self, call: ToolCall) -> str:
        own = call.call_id
        if own and own not in self.used and self._allowed(own):
            chosen = own
        else:
            chosen = self._fresh()
        self.used.add(chosen)
        return chosen

    def _fresh(self) -> str:
        if not self.short:
            return new_id(self.prefix)
        while (fresh := fresh_short_id()) in self.used:
            pass
        return fresh


def openai_tool_calls(calls: list[ToolCall], ids: list[str]) -> list[dict[str, Any]]:
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c, i in zip(calls, ids)
    ]


class Generation:
    def __init__(
        self,
        state: AppState,
        prepared: Prepared,
        dialect: str,
        http: HTTPRequest | None = None,
    ):
        self.state = state
        self.prepared = prepared
        self.dialect = dialect
        self.headers: Mapping[str, str] = dict(http.headers) if http else {}  # traceparent
        self.outcome = Outcome()
        self._strip = state.settings.strip_thinking
        # the client's wait began when its body had arrived: parsing, rendering and
        # tokenising (and waiting for a preparation thread) are part of its latency
        prepared.request.received_at = http.scope.get(BODY_RECEIVED) if http else None
        if http is not None:  # the response's request-id header: the id the logs name
            http.scope[REQUEST_ID] = prepared.request.request_id
        started = prepared.request.started_at
        self._end = _Ending(
            state,
            prepared,
            dialect,
            self.headers,
            self.outcome,
            started,
            time.time() - (time.monotonic() - started),
        )
        self._last_token_at: float | None = None
        # what responses name as the model: the adapter a request ran with (as vLLM
        # names its LoRA modules), else the loaded model. Read before the request is
        # queued: an engine that died in between made the handler raise after it,
        # and the queued request's stream, never started, was never closed
        self.model_name = prepared.request.adapter or state.model_info().model_id
        # admission errors raise here, before any byte of a response is sent
        self._outputs = state.service.submit(prepared.request)
        self._pending: asyncio.Future[RequestOutput | None] | None = None  # start()'s read-ahead

    @property
    def request_id(self) -> str:
        return self.prepared.request.request_id

    async def start(self, http: HTTPRequest, wait_s: float = HEADER_WAIT_S) -> bool:
        """Wait (up to ``wait_s``) for the engine's first output, which says what
        the KV cache did, so a streamed response's headers can carry it; a request
        still queued after that gets its headers without (X-Conv-KV: queued).
        False: the client left first (the request is aborted). A request that has
        already failed raises its error, as a non-streamed one would: no byte is
        sent yet, so a queue timeout is still a 503 with Retry-After, not an error
        event inside a 200."""
        self._pending = asyncio.ensure_future(anext(self._outputs, None))
        # the read-ahead holds the request's stream for as long as it waits: a
        # response whose body never started (the client left in between) left it
        # queued, then running, for no one; gone with this generation, it ends,
        # observed as any request that ends (no reader is left to close it)
        self._unread = weakref.finalize(
            self, call_soon_on, asyncio.get_running_loop(), _abandoned, self._pending, self._end
        )
        self._unread.atexit = False  # at exit the loop is gone: nothing to cancel
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            done, _ = await asyncio.wait(
                {self._pending}, timeout=max(0.0, min(DISCONNECT_POLL_S, left))
            )
            if done:
                first = self._pending.result()
                if first is not None:
                    self.outcome.add_output(first)  # again in events(): skipped there
                    if first.finished and self.outcome.failed:
                        self._pending = None
                        self._close()
                        raise self.outcome.failure()
                return True
            if await http.is_disconnected():
                log.info("%s: client disconnected before admission, aborting", self.request_id)
                self._pending.cancel()
                self._pending = None
                self._close()
                return False
            if left <= 0:
                return True

    async def _all_outputs(self) -> AsyncIterator[RequestOutput]:
        if self._pending is not None:
            first = await self._pending
            self._pending = None
            self._unread.detach()  # read: nothing to cancel when this goes
            if first is None:
                return
            yield first
            if first.finished:
                return
        async for out in self._outputs:
            yield out

    def response_headers(self) -> dict[str, str]:
        """The request's own headers: ignored fields, and the conversation's KV
        (``X-Conv-*``: its id, fresh|hit|disk|none|disabled, cached and computed tokens)."""
        req, done = self.prepared.request, self.outcome
        report = done.cache
        if report is not None:
            conv = report.conv_kv
        elif req.cache is None:
            conv = "disabled"
        else:
            conv = "queued"  # headers went out before the engine took the request
        prompt = done.prompt_tokens or len(req.prompt_tokens)
        return {
            **self.prepared.headers,
            "X-Conv-Id": _header_safe(self.prepared.conversation_id),
            "X-Conv-KV": conv,
            "X-Conv-Cached-Tokens": str(done.cached_tokens),
            "X-Conv-Processing-Tokens": str(max(0, prompt - done.cached_tokens)),
        }

    async def events(self) -> AsyncIterator[Event]:
        """Parser events as the engine produces text; ends after the final output
        (``outcome.finish_reason`` set) or when the reader stops early (aborted)."""
        parser = self.prepared.parser
        marks = self.prepared.request.logprobs is not None
        try:
            async for out in self._all_outputs():
                self._observe_itl(out)
                self.outcome.add_output(out)
                reasoning_before = parser.in_reasoning
                try:
                    events = parser.feed(out.text) if out.text else []
                    if out.finished:
                        events += parser.finish(
                            truncated=out.finish_reason == FinishReason.LENGTH,
                            stopped_at=out.stop_sequence,
                        )
                except Exception as exc:  # noqa: BLE001 - this reply fails alone, with an error event
                    log.exception("%s: the reply could not be parsed", self.request_id)
                    if not out.finished:
                        self.state.service.cancel(self.request_id)
                    self.outcome.fail(f"the reply could not be parsed: {type(exc).__name__}: {exc}")
                    return
                if reasoning_before or parser.in_reasoning:
                    # tokens read inside a think block, its tags included
                    self.outcome.reasoning_tokens += len(out.token_ids)
                for event in events:
                    if self._strip and isinstance(event, Reasoning):
                        continue
                    self.outcome.add_event(event)
                    if marks:
                        self.outcome.event_marks.append(len(self.outcome.logprobs))
                    yield event
        finally:
            self._close()

    async def collect(self, http: HTTPRequest) -> Outcome | None:
        """The whole outcome; None when the client hung up first (the request is
        aborted: nobody is left to build, store or send a reply for)."""

        async def consume() -> None:
            async for _ in self.events():
                pass

        task = asyncio.create_task(consume())
        while True:
            finished, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if finished:
                task.result()
                break
            if await http.is_disconnected():
                log.info("%s: client disconnected, aborting", self.request_id)
                task.cancel()
                return None
        return self.outcome

    def _observe_itl(self, out: RequestOutput) -> None:
        new = out.completion_tokens - self.outcome.completion_tokens
        if new <= 0:
            return
        if self._last_token_at is not None:
            gap = out.at - self._last_token_at
            self.state.obs.metrics.observe_itl(gap, new)
            self._end.max_gap = max(gap, self._end.max_gap or 0.0)
        self._last_token_at = out.at

    def record(self) -> RequestRecord:
        return self._end.record()

    def broke(self, exc: Exception) -> None:
        """A fault while streaming, outside the parser: this request fails alone,
        ending with its dialect's error event."""
        log.error("%s: the stream failed", self.request_id, exc_info=exc)
        if self.outcome.finish_reason is None:
            self.state.service.cancel(self.request_id)
        self.outcome.fail(f"the reply could not be streamed: {type(exc).__name__}: {exc}")

    def _close(self) -> None:
        self._end.close()


@dataclass
class _Ending:
    """A request's end, observed once whichever way it comes: its reader closing the
    generation, or the generation's finalizer (a streamed response whose body never
    started: no reader ever closed it). Holds no reference to the Generation, so
    that finalizer can call it."""

    state: AppState
    prepared: Prepared
    dialect: str
    headers: Mapping[str, str]
    outcome: Outcome
    started: float  # monotonic, when the body had arrived
    started_wall: float
    max_gap: float | None = None  # the longest wait between two engine outputs
    closed: bool = False

    @property
    def request_id(self) -> str:
        return self.prepared.request.request_id

    def record(self) -> RequestRecord:
        done, req = self.outcome, self.prepared.request
        return RequestRecord(
            request_id=req.request_id,
            dialect=self.dialect,
            model=self.state.engine.model_info.model_id if self.state.engine.model_info else "",
            prompt_tokens=done.prompt_tokens or len(req.prompt_tokens),
            cached_tokens=done.cached_tokens,
            completion_tokens=done.completion_tokens,
            finish=done.stop_kind,
            e2e_s=time.monotonic() - self.started,
            started_at=self.started_wall,
            prepare_s=req.arrival_time - self.started,
            # never joined the batch (expired or given up in the queue, or admitted
            # but never started by the step budget): all of its time there was
            # queueing, which the queue histogram must show
            waited_s=time.monotonic() - req.arrival_time
            if done.cache is None or done.error_code == "queue_timeout"
            else None,
            ttft_s=done.ttft,
            max_itl_s=self.max_gap,
            stats=done.stats,
            session=req.cache.session_id if req.cache else None,
            disconnected=done.finish_reason is None,
            tool_calls=len(done.tool_calls),
            cache=done.cache,
            adapter=req.adapter or "",
            request={
                "max_tokens": req.max_tokens,
                "temperature": req.sampling.temperature,
                "top_p": req.sampling.top_p,
            },
        )

    def close(self, delivered: bool = True) -> None:
        """``delivered`` False: no byte of the reply reached the client (nothing to heal
        back to, even when the engine had finished it)."""
        if self.closed:
            return
        self.closed = True
        done = self.outcome
        if done.finish_reason is None:
            log.info("%s: closed early, aborting", self.request_id)
            self.state.service.cancel(self.request_id)
        elif (
            delivered
            and self.prepared.answered is not None
            and not done.timed_out  # a reply cut by the watchdog is nothing to heal back to
            and done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        ):
            calls = openai_tool_calls(done.tool_calls, [""] * len(done.tool_calls))
            self.state.healing.remember(
                self.prepared.parser.kept_text,
                calls,
                context=self.prepared.answered,
                restore_calls=False,
            )
        self.state.obs.request_done(self.record(), self.headers)


def _abandoned(pending: asyncio.Future[RequestOutput | None], end: _Ending) -> None:
    """A generation gone before its start()'s read-ahead was read: the response body
    never started. Cancelling the read-ahead ends the request; ``end`` observes it
    (as an abort, unless the engine had already finished it)."""
    if pending.done() and not pending.cancelled() and pending.exception() is None:
        # its first output came after start() stopped waiting: the engine had the
        # request (its cache report, its start), which the record must say
        first = pending.result()
        if first is not None:
            end.outcome.add_output(first)
    pending.cancel()
    end.close(delivered=False)
