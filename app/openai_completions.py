"""POST /v1/completions (legacy OpenAI text completions): no chat template, no
reasoning or tool parsing; the prompt is text or token ids."""

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
from app.chat_pipeline import Prepared
from app.errors import APIError, error_body
from app.generation import Generation
from app.generation_params import resolve_max_tokens, resolve_sampling
from app.logprobs_format import CompletionLogprobs, logprob_frames
from app.openai_chat import usage
from app.openapi_doc import TEXT_COMPLETION, generation_route
from app.protocol.output_parser import Event, OutputParser, Syntax
from app.request_fields import ignored_fields
from app.schemas import CompletionRequest
from app.session_id import session_id_from
from app.sse import SSE_DONE, SSE_HEADERS, Frames, FrameTemplate, framed, frames_written, sse_data
from app.state import AppState
from kvcache.prompt_key import PromptKey
from kvcache.sessions import fallback_session_id
from scheduler.request import CacheHints, Request, TokenLogprob

router = APIRouter()

# OpenAI's documented default for this endpoint (vLLM's too), not --max-tokens
DEFAULT_MAX_TOKENS = 16


def _prompt_tokens(prompt: str | list[int], state: AppState) -> list[int]:
    info = state.model_info()
    if isinstance(prompt, str):
        return info.formatter.encode_prompt(prompt)
    bad = [t for t in prompt if not 0 <= t < info.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary.", param="prompt")
    return list(prompt)


def prepare_completion(body: CompletionRequest, state: AppState, headers) -> Prepared:
    if body.logprobs is not None and body.echo:
        raise APIError(
            400,
            "logprobs with echo would need the prompt's log probabilities, which are not "
            "computed; send one or the other.",
            param="logprobs",
        )
    if body.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported.", param="suffix")
    info = state.model_info()
    adapter = state.adapter(body.adapter_requested(), body.model)
    tokens = _prompt_tokens(body.prompt_value, state)
    if not tokens:  # [""] passes the schema; text may also encode to nothing
        raise APIError(400, "The prompt is empty: it encodes to no tokens.", param="prompt")
    key = PromptKey.build(tokens)
    # metadata and extra_body are declared fields: model_extra never held them
    fields = body.model_dump(exclude={"prompt"})
    session = session_id_from(fields, headers) or fallback_session_id(key.canonical)
    request = Request(
        prompt_tokens=tokens,
        max_tokens=resolve_max_tokens(
            body.completion_limit,
            len(tokens),
            info.context_length,
            DEFAULT_MAX_TOKENS,
            info.budget.ceiling_tokens,
        ),
        sampling=resolve_sampling(body.sampling(), info.generation_defaults, info.vocab_size),
        stop=body.stops,
        ignore_eos=body.ignore_eos,
        trim_leading_space=False,  # the text continues the prompt: keep its first space
        cache=CacheHints(key, session, kv_bits=body.kv_bits_requested())
        if body.kv_cache_enabled()
        else None,
        adapter=adapter,
        logprobs=body.logprobs,
    )
    return Prepared(
        request,
        OutputParser(Syntax(None, None)),
        answered=None,
        ignored=ignored_fields(body),
        conversation_id=session,
    )


def echoed(body: CompletionRequest, state: AppState) -> str:
    """What ``echo`` puts before the reply: the prompt's text; token ids decoded
    (as vLLM does), in the preparation thread like all tokenising."""
    if not body.echo:
        return ""
    prompt = body.prompt_value
    return prompt if isinstance(prompt, str) else state.model_info().formatter.decode(prompt)


def prepare(raw: bytes, state: AppState, headers: dict[str, str]):
    body = parse_body(raw, CompletionRequest, state.model_info().context_length)
    prepared = prepare_completion(body, state, headers)  # the ids are checked first
    return body, prepared, echoed(body, state)


@router.post("/v1/completions", **generation_route(CompletionRequest, TEXT_COMPLETION))
async def completions(http: HTTPRequest):
    state: AppState = http.app.state.kvwarm
    headers = dict(http.headers)
    state.service.scheduler.check_room()
    body, prepared, echo = await state.preparer.body(http, lambda raw: prepare(raw, state, headers))
    gen = Generation(state, prepared, "completions", http)
    meta = {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": gen.model_name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not await gen.start(http):
            return Response(status_code=499)  # the client left while queued
        return StreamingResponse(
            _stream(gen, meta, echo, include_usage, body.logprobs is not None),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **gen.response_headers()},
        )
    done = await gen.collect(http)
    if done is None:
        return Response(status_code=499)  # the client left: nothing to build or store
    if done.failed:
        raise done.failure()

    def respond() -> JSONResponse:
        choice = {
            "text": echo + done.content,
            "index": 0,
            "logprobs": None if body.logprobs is None else CompletionLogprobs().take(done.logprobs),
            "finish_reason": done.stop_kind,
        }
        return JSONResponse(
            {**meta, "choices": [choice], "usage": usage(done)}, headers=gen.response_headers()
        )

    # many tokens with their alternatives: built and encoded off the event loop
    return await asyncio.to_thread(respond) if body.logprobs is not None else respond()


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


async def _stream(
    gen: Generation, meta: dict[str, Any], echo: str, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    usage_field = {"usage": None} if include_usage else {}
    template = FrameTemplate(
        {**meta, "choices": [_choice(FrameTemplate.HOLE, None)], **usage_field}
    )
    done = gen.outcome
    arrays = CompletionLogprobs()

    def chunk(text: str, finish: str | None = None) -> Frames:
        if not logprobs:
            return template(text) if finish is None else sse_data(payload(text, finish))

        def build(entries: list[TokenLogprob], own: bool) -> str:
            # frames before the event's own (a long run of tokens) carry no text
            body = payload(text, finish) if own else payload("", None)
            body["choices"][0]["logprobs"] = arrays.take(entries)
            return sse_data(body)

        # the tokens up to this event; the last chunk carries what is left
        return logprob_frames(done.frame_logprobs(last=finish is not None), build)

    def payload(text: str, finish: str | None) -> dict[str, Any]:
        return {**meta, "choices": [_choice(text, finish)], **usage_field}

    if echo:
        yield sse_data({**meta, "choices": [_choice(echo, None)], **usage_field})

    def frame(event: Event) -> Frames:
        return chunk(event.text)  # type: ignore[union-attr]

    async for frames in framed(gen.events(), frame, on_error=gen.broke):
        yield frames
    if done.failed:
        err = done.failure()
        yield sse_data(error_body(err.message, err.error_type, err.code))
    elif done.finish_reason is not None:
        async for part in frames_written(chunk("", done.stop_kind)):
            yield part
        if include_usage:
            yield sse_data({**meta, "choices": [], "usage": usage(done)})
    yield SSE_DONE
