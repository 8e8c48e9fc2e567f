"""POST /v1/responses, GET/DELETE /v1/responses/{id} (OpenAI Responses dialect).

Input items are translated into the same template messages as chat completions.
A stored response keeps its whole conversation (the reply as the model wrote
it, reasoning included), so ``previous_response_id`` renders exactly the tokens
the previous turn's KV holds and the prefix cache resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.body import BodyLimits, parse_body
from app.chat_pipeline import ChatCall, prepare_chat, template_tool_calls
from app.content_parts import parts_content, parts_text
from app.errors import APIError
from app.generation import CallIds, Generation, Outcome
from app.generation import new_id as _new_id
from app.openapi_doc import DELETED, OPENAI_ERROR, RESPONSE, errors, generation_route, json_content
from app.protocol.output_parser import Content, Event, Reasoning
from app.protocol.tool_formats import ToolCall
from app.request_fields import ignored_fields
from app.response_store import StoredResponse
from app.responses_items import (
    Listed,
    holders,
    listed,
    resolved,
    response_not_found,
    skipped,
)
from app.responses_items import router as items_router
from app.responses_schemas import (
    CustomToolCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    client_metadata,
)
from app.responses_tools import echoed_choice, echoed_tool, read_tools
from app.sse import SSE_HEADERS, framed, sse_event
from app.state import AppState

router = APIRouter()
router.include_router(items_router)  # GET /v1/responses/{id}/input_items


def _parts(parts: Any) -> Any:
    return [p.model_dump(exclude_none=True) for p in parts] if isinstance(parts, list) else parts


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> template messages (function and custom tool calls join
    the assistant turn; hosted tools' items, run by nothing here, are skipped)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    # each assistant message's reasoning, joined once at the end: re-joined at
    # each call that followed a thought, it was copied again per call (quadratic)
    thoughts: dict[int, list[str]] = {}
    reasoning: list[str] = []

    def give_reasoning(message: int) -> None:
        if reasoning:
            thoughts.setdefault(message, []).extend(reasoning)
            reasoning.clear()

    for i, item in enumerate(items):
        where = f"input.{i}"
        turn_over = (isinstance(item, MessageItem) and item.role != "assistant") or isinstance(
            item, FunctionCallOutputItem
        )
        if reasoning and turn_over:
            # a turn whose output was reasoning alone: it stays that turn's, never
            # the next assistant message's (which the model would then read)
            out.append({"role": "assistant", "content": ""})
            give_reasoning(len(out) - 1)
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            parts = _parts(item.content)
            # images only in a user's message, as in chat and Messages
            content = parts_content(parts, where) if role == "user" else parts_text(parts, where)
            out.append({"role": role, "content": content})
            if role == "assistant":
                give_reasoning(len(out) - 1)
        elif isinstance(item, ReasoningItem):
            reasoning.append(parts_text(_parts(item.content or item.summary or []), where))
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            # a custom tool's call is rendered as a function's: its input is the arguments' text
            arguments = item.input if isinstance(item, CustomToolCallItem) else item.arguments
            fn = {"name": item.name, "arguments": arguments or "{}"}
            (call,) = template_tool_calls(
                [{"id": item.call_id, "type": "function", "function": fn}]
            )
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            give_reasoning(len(out) - 1)  # thought before this call: its turn's
        elif isinstance(item, FunctionCallOutputItem):
            text = parts_content(_parts(item.output), where, in_tool_result=True)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    for message, pieces in thoughts.items():
        said = "\n".join(p for p in pieces if p)  # encrypted-only items carry no text
        if said:
            out[message]["reasoning_content"] = said
    return out


def _reply_message(done: Outcome, kept: str, call_ids: list[str]) -> dict[str, Any]:
    """The reply as a template message, in the form the model wrote it."""
    message: dict[str, Any] = {"role": "assistant", "content": kept}
    if done.tool_calls:
        message["tool_calls"] = [
            {
                "id": i,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_dict()},
            }
            for c, i in zip(done.tool_calls, call_ids)
        ]
    return message


class _Items:
    """Output items, built as events arrive (the same for streamed and not)."""

    def __init__(self, short_call_ids: bool = False, summarise: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self.summarise = summarise  # a reasoning item's summary is its whole text
        self.call_ids: list[str] = []
        # unique in the reply, whatever the model wrote
        self._choose_id = CallIds("call", short=short_call_ids)
        # the open text item's deltas, joined when it closes: += on a str held in a
        # dict copies the whole text each time (quadratic in the reply's length)
        self._pieces: list[str] | None = None

    @property
    def current(self) -> dict[str, Any] | None:
        return self.items[-1] if self.items else None

    def add_text(self, text: str) -> None:
        """A delta of the current (reasoning or message) item."""
        assert self._pieces is not None
        self._pieces.append(text)

    def close(self) -> None:
        """The current text item's text, complete (before it is read)."""
        if self._pieces is not None:
            item = self.items[-1]
            item["content"][0]["text"] = text = "".join(self._pieces)
            if self.summarise and item["type"] == "reasoning":
                item["summary"] = [{"type": "summary_text", "text": text}]
            self._pieces = None

    def _open(self, item: dict[str, Any], text: bool) -> dict[str, Any]:
        self.close()
        self.items.append(item)
        self._pieces = [] if text else None
        return item

    def reasoning(self) -> dict[str, Any]:
        item = {
            "type": "reasoning",
            "id": _new_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}],
        }
        return self._open(item, text=True)

    def message(self) -> dict[str, Any]:
        item = {
            "type": "message",
            "id": _new_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
        return self._open(item, text=True)

    def function_call(self, call: ToolCall) -> dict[str, Any]:
        call_id = self._choose_id(call)
        self.call_ids.append(call_id)
        item = {
            "type": "function_call",
            "id": _new_id("fc"),
            "call_id": call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        return self._open(item, text=False)


# reasoning.summary values that ask for one (OpenAI's); others (none, null) do not
SUMMARIES = frozenset({"auto", "concise", "detailed"})


def _summarised(response: dict[str, Any]) -> bool:
    """Whether the request asked for reasoning summaries (as echoed in ``response``):
    Codex asks for "auto" and shows them. The model writes no summary of its own,
    so the summary is the reasoning's text."""
    return response["reasoning"]["summary"] in SUMMARIES


def _response(
    body: ResponsesRequest, rid: str, created: int, model: str, status: str
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [echoed_tool(t) for t in body.tools or ()],
        # the declared fields only: a client's extra keys are accepted, not echoed
        # (every response would carry them back, serialised on the event loop)
        "tool_choice": echoed_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump(include={"effort", "summary"})
        if body.reasoning
        else {"effort": None, "summary": None},
        "store": body.store,
        # as asked (a json_schema format the SDK's parse() reads), though not enforced
        "text": body.text.echoed() if body.text else {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": client_metadata(body.metadata),
        "usage": None,
    }


def _cut(done: Outcome) -> bool:
    """The reply was cut (max_output_tokens) or failed mid-way: its last message's
    text is not whole, so that message is incomplete. One followed by more output is."""
    return done.failed or done.timed_out or done.stop_kind == "length"


# kvwarm's failure codes as the Responses schema names them (ResponseError.code)
_RESPONSE_ERROR_CODES = {
    "queue_timeout": "rate_limit_exceeded",  # overloaded: worth retrying later
    # not in the schema's list, but what OpenAI sends and Codex acts on (it compacts
    # the conversation; invalid_prompt it retried as it was)
    "context_over_budget": "context_length_exceeded",
    "context_length_exceeded": "context_length_exceeded",
}


def _finalise(
    response: dict[str, Any], done: Outcome, items: _Items, request_timeout: float = 0.0
) -> dict[str, Any]:
    items.close()
    cut = _cut(done)  # once: not per item
    for i, item in enumerate(items.items):
        if item["type"] == "message":
            last = i == len(items.items) - 1
            item["status"] = "incomplete" if last and cut else "completed"
    response["output"] = items.items
    if done.failed:
        response["status"] = "failed"
        err = done.failure()
        code = _RESPONSE_ERROR_CODES.get(err.code or "", "server_error")
        # the Responses schema's codes (and context_length_exceeded): a client
        # validating strictly reads no others
        response["error"] = {"code": code, "message": f"{err.message} ({err.code})"}
    elif done.timed_out:
        # no incomplete reason fits (max_output_tokens is the client's own limit):
        # failed, with what was generated, as chat delivers it (finish length)
        response["status"] = "failed"
        response["error"] = {
            "code": "server_error",
            "message": f"The reply was cut short by the server's request timeout "
            f"(--request-timeout {request_timeout:g} s); the output holds what was generated.",
        }
    elif done.stop_kind == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    response["usage"] = {
        "input_tokens": done.prompt_tokens,
        # 0 as Anthropic's cache_creation_input_tokens here: nothing is billed for a write
        "input_tokens_details": {"cached_tokens": done.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    return response


def _parse(raw: bytes, state: AppState) -> ResponsesRequest:
    """Parse and validate (worker thread); the stored history is read on the loop."""
    body = parse_body(raw, ResponsesRequest, state.model_info().context_length)
    if body.input is None and body.previous_response_id is None:  # nothing to answer
        raise APIError(
            400,
            "Missing required parameter: 'input' (or 'previous_response_id').",
            code="missing_required_parameter",
            param="input",
        )
    return body


def _prepare_call(
    body: ResponsesRequest,
    history: list[dict[str, Any]],
    found: dict[str, StoredResponse],
    state: AppState,
    headers,
):
    items = resolved(body.input or [], found)
    conversation = history + input_messages(items)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = read_tools(body.tools, body.tool_choice)
    call = ChatCall(
        messages=system + conversation,
        fields=body.model_dump(exclude={"input", "tools", "instructions"}),
        tools=tools.tools,
        tool_choice=tools.choice,
        parallel_tool_calls=body.parallel_tool_calls,
        max_tokens=body.max_output_tokens,
        sampling=body.sampling(),
        use_kv_cache=body.kv_cache_enabled(),
        kv_bits=body.kv_bits_requested(),
        adapter=body.adapter_requested(),
        template_kwargs=body.template_kwargs(),
        ignored=ignored_fields(body)
        + tools.ignored
        + (body.text.ignored() if body.text else ())
        + skipped(items),
        messages_field="input",
        same_indices=False,
    )
    kept = listed(items) if body.store else Listed([], frozenset())  # what input_items lists
    return conversation, kept, prepare_chat(call, state, headers)


@router.post(
    "/v1/responses",
    **generation_route(ResponsesRequest, RESPONSE, statuses=(400, 404, 413, 429, 500, 503)),
)
async def create_response(http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    headers = dict(http.headers)
    state.service.scheduler.check_room()
    body = await state.preparer.body(http, lambda raw: _parse(raw, state))
    stored = None
    if body.previous_response_id:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(  # a 400, as OpenAI answers it (GET of an unknown id is a 404)
                400,
                f"Previous response with id '{body.previous_response_id}' not found.",
                "invalid_request_error",
                "previous_response_not_found",
                "previous_response_id",
            )
    limits = BodyLimits.for_context(state.model_info().context_length)
    # (the store is the loop's; the items are parsed in the worker thread)
    found = holders(body.input, state.responses, state.settings.max_body_size, limits)
    conversation, items_in, prepared = await state.preparer.run(
        lambda: _prepare_call(
            body, _stored_history(stored, state) if stored else [], found, state, headers
        )
    )
    gen = Generation(state, prepared, "responses", http)
    response = _response(body, _new_id("resp"), int(time.time()), gen.model_name, "in_progress")

    async def store(items: _Items) -> None:
        if body.store and not gen.outcome.failed and not gen.outcome.timed_out:
            reply = _reply_message(gen.outcome, prepared.parser.kept_text, items.call_ids)
            # JSON of the whole conversation (images included): not on the event loop
            item = await state.preparer.run(
                lambda: StoredResponse.of(response, conversation + [reply], *items_in)
            )
            state.responses.add(response["id"], item)

    if body.stream:
        if not await gen.start(http):
            return Response(status_code=499)  # the client left while queued
        return StreamingResponse(
            _stream(gen, response, store),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **gen.response_headers()},
        )
    items = _Items(gen.prepared.short_call_ids, _summarised(response))
    done = await gen.collect(http)
    if done is None:
        return Response(status_code=499)  # the client left: nothing to build or store
    for event in done.events:
        _apply(items, event)
    _finalise(response, done, items, state.settings.request_timeout)
    if done.failed:
        raise done.failure()
    await store(items)
    return JSONResponse(response, headers=gen.response_headers())


def _stored_history(stored: StoredResponse, state: AppState) -> list[dict[str, Any]]:
    """The conversation a ``previous_response_id`` names, held to a request body's
    limits: a 120-byte request naming a 60 MiB conversation cost 3 s of a
    preparation slot each time, where a body that large is refused."""
    raw = stored.conversation_json
    limit = state.settings.max_body_size
    limits = BodyLimits.for_context(state.model_info().context_length)
    if len(raw) > limit or limits.too_many_values(raw):
        raise APIError(
            400,
            f"The conversation stored under previous_response_id is {len(raw)} bytes of JSON, "
            f"more than one request may carry (at most {limit} bytes and {limits.max_values} values); "
            "send the conversation as input instead.",
            code="previous_response_too_large",
            param="previous_response_id",
        )
    return stored.conversation()


def _apply(items: _Items, event: Reasoning | Content | ToolCall) -> tuple[dict[str, Any], bool]:
    """Add an event to the items; returns the item it went to and whether it is new."""
    current = items.current
    if isinstance(event, Reasoning):
        new = current is None or current["type"] != "reasoning"
        item = items.reasoning() if new else current
        items.add_text(event.text)
    elif isinstance(event, Content):
        new = current is None or current["type"] != "message"
        item = items.message() if new else current
        items.add_text(event.text)
    else:
        item, new = items.function_call(event), True
    return item, new


@router.get(
    "/v1/responses/{response_id}",
    responses={
        200: {"description": "The stored response.", "content": json_content(RESPONSE)},
        **errors(OPENAI_ERROR, [404]),
    },
)
async def get_response(response_id: str, http: HTTPRequest) -> Response:
    state: AppState = http.app.state.kvwarm
    stored = state.responses.get(response_id)
    if stored is None:
        raise response_not_found(response_id)
    return Response(stored.response_json, media_type="application/json")


@router.delete(
    "/v1/responses/{response_id}",
    responses={
        200: {"description": "Deleted.", "content": json_content(DELETED)},
        **errors(OPENAI_ERROR, [404]),
    },
)
async def delete_response(response_id: str, http: HTTPRequest) -> dict[str, Any]:
    state: AppState = http.app.state.kvwarm
    if not state.responses.delete(response_id):
        raise response_not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class _Events:
    """Numbered Responses stream events."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **payload: Any) -> str:
        frame = sse_event(kind, {"type": kind, "sequence_number": self.seq, **payload})
        self.seq += 1
        return frame


def _item_done_frames(
    emit: _Events, item: dict[str, Any], index: int, status: str = "completed"
) -> list[str]:
    frames = []
    if item["type"] in ("message", "reasoning"):
        part = item["content"][0]
        if item["type"] == "message":
            item["status"] = status
            frames.append(
                emit(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
        else:
            frames.append(
                emit(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                )
            )
        frames.append(
            emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        if item["type"] == "reasoning":
            frames += _summary_done_frames(emit, item, index, status)
    else:
        frames.append(
            emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        )
    frames.append(emit("response.output_item.done", output_index=index, item=item))
    return frames


def _summary_done_frames(emit: _Events, item: dict[str, Any], index: int, status: str) -> list[str]:
    """The end of a reasoning item's summary parts (none unless one was asked for)."""
    cut = {"status": "incomplete"} if status == "incomplete" else {}
    frames = []
    for at, part in enumerate(item["summary"]):
        where = {"item_id": item["id"], "output_index": index, "summary_index": at}
        frames.append(emit("response.reasoning_summary_text.done", **where, text=part["text"]))
        frames.append(emit("response.reasoning_summary_part.done", **where, part=part, **cut))
    return frames


async def _stream(gen: Generation, response: dict[str, Any], store) -> AsyncIterator[str]:
    emit = _Events()
    items = _Items(gen.prepared.short_call_ids, _summarised(response))
    yield emit("response.created", response=dict(response))
    yield emit("response.in_progress", response=dict(response))

    def frames(event: Event) -> Iterator[str]:
        before = items.current
        item, new = _apply(items, event)
        index = len(items.items) - 1
        if new:
            if before is not None:
                yield from _item_done_frames(emit, before, index - 1)
            if item["type"] == "function_call":
                added = {**item, "arguments": "", "status": "in_progress"}
            else:
                added = {**item, "content": []}
            yield emit("response.output_item.added", output_index=index, item=added)
            if item["type"] != "function_call":
                empty = {**item["content"][0], "text": ""}
                yield emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=empty,
                )
            if item["type"] == "reasoning" and items.summarise:
                yield emit(
                    "response.reasoning_summary_part.added",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
        if isinstance(event, Reasoning):
            yield emit(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=event.text,
            )
            if items.summarise:
                yield emit(
                    "response.reasoning_summary_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    summary_index=0,
                    delta=event.text,
                )
        elif isinstance(event, Content):
            yield emit(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=event.text,
                logprobs=[],
            )
        else:
            yield emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=event.arguments,
            )

    async for text in framed(
        gen.events(), lambda event: "".join(frames(event)), on_error=gen.broke
    ):
        yield text
    done = gen.outcome
    if done.finish_reason is None:
        return  # the client left
    items.close()
    if items.current is not None:
        status = "incomplete" if _cut(done) else "completed"
        for frame in _item_done_frames(emit, items.current, len(items.items) - 1, status):
            yield frame
    _finalise(response, done, items, gen.state.settings.request_timeout)
    await store(items)
    kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(
        response["status"], "response.completed"
    )
    yield emit(kind, response=response)
