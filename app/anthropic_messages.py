"""POST /v1/messages and /v1/messages/count_tokens (Anthropic dialect).

Anthropic conversations are translated into the same template messages as chat
completions (thinking blocks -> reasoning_content, tool_use -> tool_calls,
tool_result -> tool messages), so Claude Code and an OpenAI client sending the
same conversation give the model the same tokens and share cached prefixes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.anthropic_client_tools import client_tool
from app.anthropic_schemas import (
    AnthropicMessage,
    AnthropicToolChoice,
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    ServerTool,
)
from app.body import parse_body
from app.chat_pipeline import ChatCall, choice_of, forced_tool, prepare_chat
from app.content_parts import parts_content, parts_text
from app.errors import APIError, anthropic_error_body
from app.generation import CallIds, Generation, Outcome
from app.middleware import REQUEST_ID
from app.openapi_doc import ANTHROPIC_ERROR, MESSAGE, TOKEN_COUNT, generation_route
from app.protocol.output_parser import Content, Event, Reasoning
from app.protocol.tool_formats import ToolCall
from app.protocol.tool_schema import ToolChoice
from app.request_fields import ignored_fields
from app.sse import SSE_HEADERS, framed, sse_event
from app.state import AppState

router = APIRouter()


def _system_text(system: str | list[Any] | None) -> str | None:
    if system is None:
        return None
    return parts_text(_dicts(system), "system")


def _dicts(content: Any) -> Any:
    """Validated blocks as the plain dicts the translators read."""
    if isinstance(content, list):
        return [b.model_dump() if hasattr(b, "model_dump") else b for b in content]
    return content


def _search_results_as_text(content: Any) -> Any:
    """Search result blocks as the text blocks a template renders: title, source,
    then the result's text (a text model has no other way to read them)."""
    if not isinstance(content, list):
        return content
    return [_search_result_text(b) if b.get("type") == "search_result" else b for b in content]


def _search_result_text(block: dict[str, Any]) -> dict[str, Any]:
    texts = [part["text"] for part in block["content"]]
    return {"type": "text", "text": "\n".join([block["title"], block["source"], *texts])}


def _user_messages(content: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages (in order), the rest one user message."""
    out: list[dict[str, Any]] = []
    text: list[dict[str, Any]] = []
    for block in _search_results_as_text(content):
        kind = block.get("type")
        if kind == "tool_result":
            result = _search_results_as_text(block.get("content", ""))
            body = parts_content(result, where, in_tool_result=True)
            if block.get("is_error"):  # the model must know the tool failed
                if not isinstance(body, str):
                    body = [{"type": "text", "text": "Error:"}, *body]
                else:  # a failure with nothing to say is "Error", not "Error: "
                    body = f"Error: {body}" if body else "Error"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": body})
        elif kind in ("text", "image", "document"):
            text.append(block)
        else:
            raise APIError(400, f"Unsupported user content block type {kind!r}.", param=where)
    if text:
        out.append({"role": "user", "content": parts_content(text, where)})
    return out


def _assistant_message(content: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": block.get("input") or {}},
                }
            )
        else:
            raise APIError(400, f"Unsupported assistant content block type {kind!r}.", param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def template_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system_text(body.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    run: list[dict[str, Any]] = []  # consecutive turns of one role, joined once
    final = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        for translated in _translate(message, where):
            # a final assistant turn stays apart: it is the prefill the reply continues
            prefill = i == final and translated["role"] == "assistant"
            if run and not prefill and run[-1]["role"] == translated["role"]:
                run.append(translated)  # as Anthropic does: templates may need turns
                continue
            if run:
                out.append(_joined(run))
            run = [translated]
            if translated["role"] not in ("user", "assistant"):
                out.append(translated)
                run = []
    if run:
        out.append(_joined(run))
    return out


def _joined(run: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive turns of one role as one (Anthropic joins them; templates that
    want alternating roles refused the request). One pass over the run: folding
    turn by turn rebuilt the joined text per turn, quadratic in the run."""
    if len(run) == 1:
        return run[0]
    first = run[0]
    first["content"] = _joined_content([m.get("content") or "" for m in run])
    reasoning = "\n".join(t for m in run if (t := m.get("reasoning_content")))
    if reasoning:
        first["reasoning_content"] = reasoning
    calls = [call for m in run for call in m.get("tool_calls") or ()]
    if calls:
        first["tool_calls"] = calls
    return first


def _joined_content(contents: list[str | list[dict[str, Any]]]) -> str | list[dict[str, Any]]:
    """Texts joined by newlines; once a turn holds parts (images), the texts before
    it are one text part and every later turn adds its own parts."""
    head = next((i for i, c in enumerate(contents) if isinstance(c, list)), len(contents))
    text = "\n".join(c for c in contents[:head] if isinstance(c, str) and c)
    if head == len(contents):
        return text
    parts = _as_parts(text)
    for content in contents[head:]:
        parts += _as_parts(content)
    return parts


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if content else []


def prefilled(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """A final assistant message is where the reply starts (Anthropic's prefill: the
    model continues it, the response holds only what it adds): the messages before it,
    and its text."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls") or last.get("reasoning_content"):
        return messages, ""
    return messages[:-1], str(last.get("content") or "")


def _translate(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    content = _dicts(message.content)
    if message.role == "system":
        return [{"role": "system", "content": parts_text(content, where)}]
    if isinstance(content, str):
        return [{"role": message.role, "content": content}]
    if message.role == "user":
        return _user_messages(content, where)
    return [_assistant_message(content, where)]


def function_tools(tools: list[CustomTool | ServerTool] | None) -> list[dict[str, Any]]:
    """Custom tools (those with an ``input_schema``) and the Anthropic-defined
    tools a client runs (bash, text editor, memory); server tools are ignored."""
    out = []
    for tool in tools or ():
        if isinstance(tool, CustomTool):
            fn: dict[str, Any] | None = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                fn["description"] = tool.description
        else:
            fn = client_tool(tool)
        if fn is not None:
            out.append({"type": "function", "function": fn})
    return out


def ignored_tools(tools: list[CustomTool | ServerTool] | None) -> tuple[str, ...]:
    """Tools nothing here runs (web search, code execution, computer use): named
    in the ignored-fields header, never dropped in silence."""
    return tuple(
        f"tools.{t.type}"
        for t in tools or ()
        if isinstance(t, ServerTool) and client_tool(t) is None
    )


def ignored_thinking(body: CountTokensRequest) -> tuple[str, ...]:
    """``thinking.budget_tokens`` only turns thinking on here (nothing caps the
    reasoning at it): named in the ignored-fields header, as Claude Code's 31999
    would otherwise look honoured."""
    if body.thinking is not None and body.thinking.budget_tokens is not None:
        return ("thinking.budget_tokens",)
    return ()


def tool_choice(value: AnthropicToolChoice | None, tools: list[dict[str, Any]]) -> ToolChoice:
    kind = value.type if value is not None else ("auto" if tools else "none")
    if kind == "tool":
        if not value or not value.name:
            raise APIError(400, "tool_choice of type tool needs a name.", param="tool_choice")
        return forced_tool(value.name, tools)
    return choice_of({"auto": "auto", "any": "required", "none": "none"}[kind], tools)


def chat_call(body: CountTokensRequest, max_tokens: int | None) -> ChatCall:
    tools = function_tools(body.tools)
    # counting stops nothing; an undeclared stop_sequences there is any JSON value
    stops = (body.stop_sequences or ()) if isinstance(body, MessagesRequest) else ()
    messages, prefill = prefilled(template_messages(body))
    return ChatCall(
        messages=messages,
        prefill=prefill,
        fields=body.model_dump(exclude={"messages", "system", "tools"}),
        tools=tools,
        tool_choice=tool_choice(body.tool_choice, tools),
        parallel_tool_calls=not (body.tool_choice and body.tool_choice.disable_parallel_tool_use),
        max_tokens=max_tokens,
        clamp_max_tokens=True,
        thinking_default=False,
        stop=tuple(s for s in stops if s),
        sampling=body.sampling(),
        use_kv_cache=body.kv_cache_enabled(),
        kv_bits=body.kv_bits_requested(),
        adapter=body.adapter_requested(),
        template_kwargs=body.template_kwargs(),
        ignored=ignored_fields(body) + ignored_tools(body.tools) + ignored_thinking(body),
        same_indices=False,  # the system prompt comes first; blocks split into messages
    )


def _prepare(raw: bytes, state: AppState, headers: dict[str, str], model: type[CountTokensRequest]):
    body = parse_body(raw, model, state.model_info().context_length)
    generating = isinstance(body, MessagesRequest)
    call = chat_call(body, body.max_tokens if generating else 1)
    return body, prepare_chat(replace(call, count_only=not generating), state, headers)


def stop_reason(done: Outcome, limit_lowered: bool = False) -> str | None:
    """``limit_lowered``: max_tokens was lowered to the room the context left, so a
    reply cut at it met the context window (Anthropic's own stop reason for that),
    not the client's limit."""
    kind = done.stop_kind
    if kind == "tool_calls":
        return "tool_use"
    if kind == "length":
        # a watchdog cut ends as length too: the context was not what ended it
        full = limit_lowered and not done.timed_out
        return "model_context_window_exceeded" if full else "max_tokens"
    if kind == "stop":
        return "stop_sequence" if done.stop_sequence else "end_turn"
    return None


def stop_sequence(done: Outcome) -> str | None:
    """The stop sequence, said only with ``stop_reason: stop_sequence`` (as
    Anthropic does): a turn that ended in calls reports ``tool_use`` alone."""
    return done.stop_sequence if stop_reason(done) == "stop_sequence" else None


def usage(done: Outcome) -> dict[str, int]:
    return {
        "input_tokens": done.prompt_tokens - done.cached_tokens,
        "output_tokens": done.completion_tokens,
        "cache_read_input_tokens": done.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


# what Anthropic's tool_use ids match (its API refuses any other in the next turn)
TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")


def tool_use_ids(short: bool = False) -> CallIds:
    """A reply's tool_use ids: unique, and legal for Anthropic, whatever the model wrote."""
    return CallIds("toolu", TOOL_USE_ID, short)


def tool_use_block(call: ToolCall, ids: CallIds) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": ids(call),
        "name": call.name,
        "input": call.arguments_dict(),
    }


@router.post(
    "/v1/messages/count_tokens",
    **generation_route(
        CountTokensRequest,
        TOKEN_COUNT,
        error=ANTHROPIC_ERROR,
        streams=False,
        statuses=(400, 413, 503),
    ),
)
async def count_tokens(http: HTTPRequest) -> JSONResponse:
    state: AppState = http.app.state.kvwarm
    headers = dict(http.headers)
    _, prepared = await state.preparer.body(
        http, lambda raw: _prepare(raw, state, headers, CountTokensRequest)
    )
    http.scope[REQUEST_ID] = prepared.request.request_id  # what its log lines name
    return JSONResponse(
        {"input_tokens": len(prepared.request.prompt_tokens)}, headers=prepared.headers
    )


@router.post("/v1/messages", **generation_route(MessagesRequest, MESSAGE, error=ANTHROPIC_ERROR))
async def messages(http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    headers = dict(http.headers)
    state.service.scheduler.check_room()
    body, prepared = await state.preparer.body(
        http, lambda raw: _prepare(raw, state, headers, MessagesRequest)
    )
    gen = Generation(state, prepared, "messages", http)
    message = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": gen.model_name,
    }
    if body.stream:
        if not await gen.start(http):
            return Response(status_code=499)  # the client left while queued
        return StreamingResponse(
            _stream(gen, message),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **gen.response_headers()},
        )
    done = await gen.collect(http)
    if done is None:
        return Response(status_code=499)  # the client left: nothing to build or store
    if done.failed:
        raise done.failure()
    ids = tool_use_ids(gen.prepared.short_call_ids)
    content = [_block(event, ids) for event in done.events]
    return JSONResponse(
        {
            **message,
            "content": content,
            "stop_reason": stop_reason(done, prepared.max_tokens_lowered),
            "stop_sequence": stop_sequence(done),
            "usage": usage(done),
        },
        headers=gen.response_headers(),
    )


def _block(event: Reasoning | Content | ToolCall, ids: CallIds) -> dict[str, Any]:
    if isinstance(event, Reasoning):
        return {"type": "thinking", "thinking": event.text, "signature": ""}
    if isinstance(event, Content):
        return {"type": "text", "text": event.text}
    return tool_use_block(event, ids)


class _Blocks:
    """Open/close content blocks as the kind of output changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def switch(self, kind: str, start: dict[str, Any]) -> list[str]:
        if self.kind == kind and kind != "tool_use":
            return []
        out = self.close()
        self.index += 1
        self.kind = kind
        out.append(
            sse_event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": start},
            )
        )
        return out

    def delta(self, delta: dict[str, Any]) -> str:
        payload = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", payload)

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        ]


async def _stream(gen: Generation, message: dict[str, Any]) -> AsyncIterator[str]:
    done = gen.outcome
    prompt = done.prompt_tokens or len(gen.prepared.request.prompt_tokens)
    # the cache's answer is known once the engine took the request (gen.start waits
    # for it): a client reading message_start alone sees its cache reads too
    start_usage = {"input_tokens": prompt - done.cached_tokens, "output_tokens": 0}
    yield sse_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                **message,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    **start_usage,
                    "cache_read_input_tokens": done.cached_tokens,
                    "cache_creation_input_tokens": 0,
                },
            },
        },
    )
    blocks = _Blocks()
    ids = tool_use_ids(gen.prepared.short_call_ids)

    def frames(event: Event) -> Iterator[str]:
        if isinstance(event, Reasoning):
            yield from blocks.switch(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""}
            )
            yield blocks.delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, Content):
            yield from blocks.switch("text", {"type": "text", "text": ""})
            yield blocks.delta({"type": "text_delta", "text": event.text})
        else:
            block = tool_use_block(event, ids)
            yield from blocks.switch("tool_use", {**block, "input": {}})
            yield blocks.delta(
                {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(block["input"], ensure_ascii=False),
                }
            )

    ping = sse_event("ping", {"type": "ping"})
    async for text in framed(gen.events(), lambda event: "".join(frames(event)), ping, gen.broke):
        yield text
    for frame in blocks.close():
        yield frame
    if done.failed:
        err = done.failure()
        yield sse_event("error", anthropic_error_body(err.status, err.message))
        return
    yield sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(done, gen.prepared.max_tokens_lowered),
                "stop_sequence": stop_sequence(done),
            },
            "usage": usage(done),
        },
    )
    yield sse_event("message_stop", {"type": "message_stop"})
