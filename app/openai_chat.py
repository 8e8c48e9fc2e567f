"""POST /v1/chat/completions (OpenAI dialect), streaming and not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from app.chat_pipeline import ChatCall, parse_openai_tool_choice, prepare_chat, template_tool_calls
from app.errors import APIError, error_body
from app.generation import Generation, Outcome, openai_tool_calls
from app.protocol.output_parser import Content, Reasoning
from app.protocol.tool_formats import ToolCall
from app.protocol.tool_schema import function_tools
from app.schemas import ChatCompletionRequest, ChatMessage
from app.sse import KEEPALIVE_S, SSE_DONE, SSE_HEADERS, SSE_KEEPALIVE, sse_data, with_heartbeat
from app.state import AppState

router = APIRouter()


def template_message(message: ChatMessage) -> dict[str, Any]:
    try:
        content = message.text()
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    calls = template_tool_calls(message.tool_calls)
    if calls:
        out["tool_calls"] = calls
    return out


def chat_call(body: ChatCompletionRequest) -> ChatCall:
    tools = function_tools(body.tools)
    return ChatCall(
        messages=[template_message(m) for m in body.messages],
        fields=body.model_dump(exclude={"messages", "tools"}),
        tools=tools,
        tool_choice=parse_openai_tool_choice(body.tool_choice, tools),
        max_tokens=body.completion_limit,
        stop=tuple(body.stop or ()),
        ignore_eos=body.ignore_eos,
    )


def call_id(call: ToolCall) -> str:
    return call.call_id or f"call_{uuid.uuid4().hex[:24]}"


def usage(done: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    prepared = prepare_chat(chat_call(body), state, http.headers)
    gen = Generation(state, prepared, "chat", http.headers)
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": state.model_info().model_id,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream_chunks(gen, meta, include_usage),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    done = await gen.collect(http)
    if done.failed:
        raise APIError(500, f"Generation failed: {done.error}", "server_error", "engine_error")
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.reasoning:
        message["reasoning_content"] = done.reasoning
    if done.tool_calls:
        message["tool_calls"] = openai_tool_calls(
            done.tool_calls, [call_id(c) for c in done.tool_calls]
        )
        message["content"] = done.content or None
    return JSONResponse(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": done.stop_kind}
            ],
            "usage": usage(done),
        }
    )


def _chunk(meta: dict[str, Any], delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        **meta,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


async def _stream_chunks(
    gen: Generation, meta: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    usage_field = {"usage": None} if include_usage else {}
    done = gen.outcome
    calls = 0
    yield sse_data({**_chunk(meta, {"role": "assistant", "content": ""}, None), **usage_field})
    async for event in with_heartbeat(gen.events(), KEEPALIVE_S):
        if event is None:
            yield SSE_KEEPALIVE
            continue
        if isinstance(event, Reasoning):
            delta: dict[str, Any] = {"reasoning_content": event.text}
        elif isinstance(event, Content):
            delta = {"content": event.text}
        else:
            (tool,) = openai_tool_calls([event], [call_id(event)])
            delta = {"tool_calls": [{"index": calls, **tool}]}
            calls += 1
        yield sse_data({**_chunk(meta, delta, None), **usage_field})
    if done.failed:
        yield sse_data(
            error_body(f"Generation failed: {done.error}", "server_error", "engine_error")
        )
    elif done.finish_reason is not None:
        yield sse_data({**_chunk(meta, {}, done.stop_kind), **usage_field})
        if include_usage:
            yield sse_data(
                {**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage(done)}
            )
    yield SSE_DONE
