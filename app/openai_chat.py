"""POST /v1/chat/completions (OpenAI dialect), streaming and not."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from app.errors import APIError, error_body
from app.generation_params import resolve_max_tokens, resolve_sampling
from app.schemas import ChatCompletionRequest, ChatMessage
from app.session_id import session_id_from
from app.sse import SSE_DONE, SSE_HEADERS, sse_data
from app.state import AppState
from scheduler.healing import context_of
from scheduler.prefix_index import VolatilePolicy
from scheduler.request import CacheHints, FinishReason, Request, RequestOutput
from scheduler.sessions import fallback_session_id

log = logging.getLogger("kvwarm.http.chat")
router = APIRouter()

DISCONNECT_POLL_S = 0.25


@dataclass
class Completion:
    """Running totals of one request's outputs."""

    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.ttft is not None:
            self.ttft = out.ttft
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.error = out.error

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _template_message(message: ChatMessage) -> dict[str, Any]:
    try:
        content = message.text()
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    return out


def build_request(
    body: ChatCompletionRequest, state: AppState, headers: Mapping[str, str] | None = None
) -> Request:
    info = state.model_info()
    messages = state.healing.heal_all([_template_message(m) for m in body.messages])
    relocate = state.settings.volatile_policy is VolatilePolicy.RELOCATE
    try:
        rendered = info.formatter.render_chat(messages, relocate_volatile=relocate)
    except Exception as exc:  # jinja errors of the model's own template
        raise APIError(400, f"The chat template rejected these messages: {exc}") from exc
    prompt = rendered.tokens
    max_tokens = resolve_max_tokens(
        body.completion_limit, len(prompt), info.context_length, state.settings.max_tokens
    )
    # session fields are not in the schema: they arrive as extra fields
    session = session_id_from(body.model_extra or {}, headers or {}) or fallback_session_id(
        rendered.key.canonical
    )
    return Request(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        sampling=resolve_sampling(body.model_dump(), info.generation_defaults, info.vocab_size),
        stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos,
        cache=CacheHints(rendered.key, session, rendered.message_hashes),
    )


def _finish(state: AppState, req: Request, done: Completion, started: float, answered: str) -> None:
    """``answered``: ``context_of`` the request's last message (the healing key)."""
    if done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        state.healing.remember(done.text, context=answered)
    _log_done(req, done, started)


def _log_done(req: Request, done: Completion, started: float) -> None:
    elapsed = time.monotonic() - started
    rate = done.completion_tokens / elapsed if elapsed > 0 else 0.0
    log.info(
        "%s done: prompt=%d cached=%d completion=%d finish=%s ttft=%s total=%.2fs (%.1f tok/s)",
        req.request_id,
        done.prompt_tokens,
        done.cached_tokens,
        done.completion_tokens,
        done.finish_reason.value if done.finish_reason else "aborted",
        f"{done.ttft:.2f}s" if done.ttft is not None else "-",
        elapsed,
        rate,
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    req = build_request(body, state, http.headers)
    answered = context_of(_template_message(body.messages[-1]))
    stream = state.service.submit(req)  # admission errors raise here, before any byte is sent
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": state.model_info().model_id,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream_chunks(state, req, stream, meta, include_usage, answered),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    done = await _collect(state, req, stream, http, answered)
    if done.finish_reason == FinishReason.ERROR:
        raise APIError(500, f"Generation failed: {done.error}", "server_error", "engine_error")
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done.text},
                    "logprobs": None,
                    "finish_reason": done.finish_reason.value,
                }
            ],
            "usage": done.usage(),
        }
    )


async def _collect(
    state: AppState,
    req: Request,
    stream: AsyncIterator[RequestOutput],
    http: HTTPRequest,
    answered: str,
) -> Completion:
    """Gather the whole completion, aborting if the client hangs up meanwhile."""
    done = Completion()
    started = time.monotonic()

    async def consume() -> None:
        async for out in stream:
            done.add(out)

    task = asyncio.create_task(consume())
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if finished:
                task.result()
                break
            if await http.is_disconnected():
                log.info("%s: client disconnected, aborting", req.request_id)
                task.cancel()
                break
    finally:
        if done.finish_reason is None:
            state.service.cancel(req.request_id)
        _finish(state, req, done, started, answered)
    return done


def _chunk(meta: dict[str, Any], delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        **meta,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


async def _stream_chunks(
    state: AppState,
    req: Request,
    stream: AsyncIterator[RequestOutput],
    meta: dict[str, Any],
    include_usage: bool,
    answered: str,
) -> AsyncIterator[str]:
    done = Completion()
    started = time.monotonic()
    usage_field = {"usage": None} if include_usage else {}
    try:
        yield sse_data({**_chunk(meta, {"role": "assistant", "content": ""}, None), **usage_field})
        async for out in stream:
            done.add(out)
            if out.finish_reason == FinishReason.ERROR:
                yield sse_data(
                    error_body(f"Generation failed: {out.error}", "server_error", "engine_error")
                )
                break
            if out.text:
                yield sse_data({**_chunk(meta, {"content": out.text}, None), **usage_field})
            if out.finish_reason is not None:
                yield sse_data({**_chunk(meta, {}, out.finish_reason.value), **usage_field})
        if include_usage and done.finish_reason != FinishReason.ERROR:
            yield sse_data(
                {**meta, "object": "chat.completion.chunk", "choices": [], "usage": done.usage()}
            )
        yield SSE_DONE
    finally:
        if done.finish_reason is None:
            log.info("%s: stream closed early, aborting", req.request_id)
            state.service.cancel(req.request_id)
        _finish(state, req, done, started, answered)
