"""POST /v1/chat/completions (OpenAI dialect), streaming and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.body import parse_body
from app.chat_pipeline import (
    ChatCall,
    parse_openai_tool_choice,
    prepare_chat,
    template_tool_calls,
)
from app.content_parts import parts_content
from app.errors import APIError, error_body
from app.generation import CallIds, Generation, Outcome, openai_tool_calls
from app.logprobs_format import chat_logprobs, logprob_frames
from app.openapi_doc import CHAT_COMPLETION, generation_route
from app.protocol.output_parser import Content, Event, Reasoning
from app.protocol.tool_schema import function_tools
from app.request_fields import ignored_fields
from app.schemas import ChatCompletionRequest, ChatMessage
from app.sse import SSE_DONE, SSE_HEADERS, Frames, FrameTemplate, framed, frames_written, sse_data
from app.state import AppState
from scheduler.request import TokenLogprob

router = APIRouter()


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    where = f"messages.{index}.content"
    content: str | list[dict[str, Any]]
    if message.role in ("user", "tool") and isinstance(message.content, list):
        parts = [p.model_dump(exclude_none=True) for p in message.content]
        content = parts_content(parts, where, in_tool_result=message.role == "tool")
    else:
        try:
            content = message.text()
        except ValueError as exc:
            raise APIError(400, str(exc), param=where) from exc
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    # whichever name the client used (transformers' order): the template reads it
    reasoning = next(
        (
            v
            for v in (message.reasoning_content, message.thinking, message.reasoning)
            if v is not None
        ),
        None,
    )
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if message.tool_calls:
        out["tool_calls"] = template_tool_calls(
            [c.model_dump(exclude_none=True) for c in message.tool_calls]
        )
    return out


def chat_call(body: ChatCompletionRequest) -> ChatCall:
    if body.top_logprobs and not body.logprobs:  # as OpenAI: never a silent null
        raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    tools = function_tools([t.model_dump(exclude_none=True) for t in body.tools or ()])
    return ChatCall(
        messages=[template_message(m, i) for i, m in enumerate(body.messages)],
        fields=body.model_dump(exclude={"messages", "tools"}),
        tools=tools,
        tool_choice=parse_openai_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls,
        max_tokens=body.completion_limit,
        stop=body.stops,
        ignore_eos=body.ignore_eos,
        sampling=body.sampling(),
        use_kv_cache=body.kv_cache_enabled(),
        kv_bits=body.kv_bits_requested(),
        adapter=body.adapter_requested(),
        template_kwargs=body.template_kwargs(),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        ignored=ignored_fields(body),
    )


def prepare(raw: bytes, state: AppState, headers: dict[str, str]):
    """Everything before the engine (worker thread): parse, translate, render, tokenise."""
    body = parse_body(raw, ChatCompletionRequest, state.model_info().context_length)
    return body, prepare_chat(chat_call(body), state, headers)


def usage(done: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
    }


@router.post("/v1/chat/completions", **generation_route(ChatCompletionRequest, CHAT_COMPLETION))
async def chat_completions(http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    headers = dict(http.headers)
    state.service.scheduler.check_room()
    body, prepared = await state.preparer.body(http, lambda raw: prepare(raw, state, headers))
    gen = Generation(state, prepared, "chat", http)
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": gen.model_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not await gen.start(http):
            return Response(status_code=499)  # the client left while queued
        return StreamingResponse(
            _stream_chunks(gen, meta, include_usage, bool(body.logprobs)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **gen.response_headers()},
        )
    done = await gen.collect(http)
    if done is None:
        return Response(status_code=499)  # the client left: nothing to build or store
    if done.failed:
        raise done.failure()
    message: dict[str, Any] = {
        "role": "assistant",
        "content": done.content,
        "message_id": gen.request_id,  # names this turn (logs, X-Conv-Id, traces)
    }
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    if done.tool_calls:
        ids = CallIds("call", short=gen.prepared.short_call_ids)
        message["tool_calls"] = openai_tool_calls(
            done.tool_calls, [ids(c) for c in done.tool_calls]
        )
        message["content"] = done.content or None

    def respond() -> JSONResponse:
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(done.logprobs) if body.logprobs else None,
            "finish_reason": done.stop_kind,
        }
        return JSONResponse(
            {**meta, "object": "chat.completion", "choices": [choice], "usage": usage(done)},
            headers=gen.response_headers(),
        )

    # 16k tokens with 20 alternatives each: ~2 s of building and encoding, off the loop
    return await asyncio.to_thread(respond) if body.logprobs else respond()


def _chunk(meta: dict[str, Any], delta: Any, finish: str | None) -> dict[str, Any]:
    return {
        **meta,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


async def _stream_chunks(
    gen: Generation, meta: dict[str, Any], include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    usage_field = {"usage": None} if include_usage else {}
    done = gen.outcome
    calls = 0
    ids = CallIds("call", short=gen.prepared.short_call_ids)
    first = {"role": "assistant", "content": "", "message_id": gen.request_id}
    template = FrameTemplate({**_chunk(meta, FrameTemplate.HOLE, None), **usage_field})

    def chunk(delta: dict[str, Any], finish: str | None = None) -> Frames:
        if not logprobs:
            return (
                template(delta)
                if finish is None
                else sse_data({**_chunk(meta, delta, finish), **usage_field})
            )

        def build(entries: list[TokenLogprob], own: bool) -> str:
            # frames before the event's own (a long run of tokens) carry no text
            payload = _chunk(meta, delta, finish) if own else _chunk(meta, {"content": ""}, None)
            payload["choices"][0]["logprobs"] = chat_logprobs(entries)
            return sse_data({**payload, **usage_field})

        # the tokens up to this chunk's event (a token whose text the parser held
        # back, think tags and tool markup included); the last chunk: what is left
        return logprob_frames(done.frame_logprobs(last=finish is not None), build)

    yield sse_data({**_chunk(meta, first, None), **usage_field})

    def frame(event: Event) -> Frames:
        nonlocal calls
        if isinstance(event, Reasoning):
            delta: dict[str, Any] = {"reasoning_content": event.text}
        elif isinstance(event, Content):
            delta = {"content": event.text}
        else:
            (tool,) = openai_tool_calls([event], [ids(event)])
            delta = {"tool_calls": [{"index": calls, **tool}]}
            calls += 1
        return chunk(delta)

    async for frames in framed(gen.events(), frame, on_error=gen.broke):
        yield frames
    if done.failed:
        err = done.failure()
        yield sse_data(error_body(err.message, err.error_type, err.code))
    elif done.finish_reason is not None:
        async for part in frames_written(chunk({}, done.stop_kind)):
            yield part
        if include_usage:
            yield sse_data(
                {**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(done)}
            )
    yield SSE_DONE
