"""Resolve what a request asks for into the neutral Request's settings.

Precedence for sampling: explicit request value > the model's
generation_config.json > OpenAI's documented defaults.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pydantic import ValidationError

from app.errors import APIError
from app.request_fields import SAMPLING_NAMES, SamplingFields
from scheduler.admission import ContextLengthExceeded
from scheduler.request import SamplingParams

log = logging.getLogger("kvwarm.http")

OPENAI_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def resolve_logit_bias(
    bias: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise APIError(
                400,
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                param="logit_bias",
            )
        out.append((token, float(value)))
    return tuple(sorted(out))


def valid_defaults(model_defaults: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json values held to the bounds requests are: one that is
    out of range is dropped (with a warning), never handed to the sampler. The
    model's defaults never change, so they are checked (and warned about) once."""
    items = tuple(model_defaults.items())
    try:
        return dict(_checked_defaults(items))
    except TypeError:  # an unhashable value: check it uncached
        return dict(_checked_defaults.__wrapped__(items))


@functools.lru_cache(maxsize=8)
def _checked_defaults(items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = []
    for name, value in items:
        if name not in SAMPLING_NAMES:
            continue
        try:
            out.append((name, getattr(SamplingFields.model_validate({name: value}), name)))
        except ValidationError:
            log.warning("ignoring generation_config.json %s=%r: out of range", name, value)
    return tuple(out)


def resolve_sampling(
    requested: SamplingFields, model_defaults: dict[str, Any], vocab_size: int = 0
) -> SamplingParams:
    defaults = valid_defaults(model_defaults)
    values = {}
    for name, fallback in OPENAI_DEFAULTS.items():
        value = getattr(requested, name)
        if value is None:
            value = defaults.get(name, fallback)
        values[name] = value
    return SamplingParams(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        min_p=float(values["min_p"]),
        repetition_penalty=float(values["repetition_penalty"]),
        presence_penalty=float(values["presence_penalty"]),
        frequency_penalty=float(values["frequency_penalty"]),
        # any int64 is a valid OpenAI seed; MLX keys take an unsigned 64-bit one
        seed=None if requested.seed is None else requested.seed % 2**64,
        logit_bias=resolve_logit_bias(requested.logit_bias, vocab_size),
    )


def resolve_max_tokens(
    requested: int | None,
    prompt_tokens: int,
    context_length: int,
    server_default: int,
    ceiling_tokens: int | None = None,
) -> int:
    """An explicit limit is kept as asked (admission refuses it if it cannot fit);
    an omitted one is the server default clipped to the room left in the context
    and under the memory ceiling (a client that set no limit was refused for the
    server's default of 2048 where 992 tokens of room were left)."""
    if requested is not None:
        return requested
    room = context_length - prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, "
            f"your messages resulted in {prompt_tokens} tokens. Please reduce the length "
            f"of the messages.",
            prompt_tokens,
            context_length,
        )
    if ceiling_tokens is not None and ceiling_tokens - prompt_tokens >= 1:
        room = min(room, ceiling_tokens - prompt_tokens)  # else admission says why not
    return min(server_default, room)
