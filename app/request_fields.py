"""The sampling fields every dialect accepts, validated once with their bounds.

Each dialect's request model inherits ``SamplingFields`` (OpenAI chat and
completions, Anthropic Messages and OpenAI Responses take the same extensions:
``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ...). The same model
validates the ``extra_body`` and ``metadata`` envelopes some clients wrap them
in, so a value is checked the same way whatever route or envelope carried it,
and a breach is a 400 naming the field. The engine only ever sees values that
passed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    JsonValue,
    StringConstraints,
    model_validator,
)
from pydantic_core import core_schema

from app.protocol.thinking import readable_if_said, readable_switch

# OpenAI-style logit_bias keys: token ids as decimal strings (ASCII digits only:
# "²".isdigit() is true and int("²") raises)
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
MAX_STOP_CHARS = 256  # stop matching costs O(len^2) per token on the engine thread


def _bounded_list(limit: int):
    """Reject an over-long list before its items are validated: pydantic checks
    ``max_length`` only after validating every item, so a million bad items
    would first build a million errors."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} items are allowed, got {len(value)}")
        return value

    return BeforeValidator(check)


@dataclass(frozen=True)
class null_is:  # noqa: N801 - used as a field annotation, named like one
    """A field OpenAI marks nullable (its SDK sends null for a None): null is the
    default. The schema says null is accepted; the value read is never None."""

    default: Any

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_before_validator_function(
            lambda value: self.default if value is None else value, handler(source)
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        return {"anyOf": [handler(schema), {"type": "null"}]}


def bounded_list(item: Any, limit: int, min_items: int = 0) -> Any:
    """``list[item]`` with at most ``limit`` items, enforced early and documented."""
    return Annotated[
        list[item],  # type: ignore[valid-type]
        _bounded_list(limit),
        Field(max_length=limit, min_length=min_items),
    ]


StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
StopList = bounded_list(StopString, 4)


class SamplingFields(BaseModel):
    """Sampling parameters (request values win over generation_config.json)."""

    model_config = ConfigDict(
        extra="allow", strict=True, allow_inf_nan=False, protected_namespaces=()
    )

    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=-1, le=2**31 - 1, description="0 or -1 (vLLM's spelling) = disabled"
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # under 0.01 the penalty's division overflows logits to inf, and the sampler
    # then draws from NaN
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0, description="1 = off")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        None, description="token id (decimal string) -> bias in [-100, 100]"
    )


SAMPLING_NAMES: tuple[str, ...] = tuple(SamplingFields.model_fields)


class CacheSwitch(BaseModel):
    use_kv_cache: bool | None = Field(
        None,
        strict=True,
        description="false: this request neither reuses nor stores cached KV",
    )
    kv_bits: Literal[4, 8] | None = Field(
        None,
        description="store this request's cached KV quantized to 4 or 8 bits (it then "
        "reuses only KV stored at the same precision); default: the server's --kv-bits",
    )


class AdapterSwitch(BaseModel):
    adapter: str | None = Field(
        None,
        strict=True,
        min_length=1,
        max_length=64,
        description="id of a mounted LoRA adapter (GET /v1/adapters) to generate with; "
        "default: the base model",
    )


# apply_chat_template's own arguments, and the template variables the server sets:
# a client's value would collide with them (a TypeError) or undo them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "self",  # kvwarm's own render arguments (engine.prompt_format.render_chat)
        "relocate_volatile",
        "count_only",
        "image_placeholder",
        # the tokenizer's special tokens and the template's globals: a client's value
        # wrote control tokens where the template itself puts them
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "thinking",  # the thinking switch, as templates that read this name have it
    }
)


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    if "chat_template" in value:
        # a template is code the server runs: nested loops over range(100000) held
        # a preparation thread for hours, and two of them every request after
        raise ValueError(
            "a chat template sent with a request is not accepted (it is code the server "
            "would run); the model's own template is used"
        )
    # read as the thinking switch: as at the top level, null is unset, and any
    # other value a bool, a number or a word saying on or off
    switch = value.get("enable_thinking")
    if switch is not None:
        if not isinstance(switch, (bool, int, str)):
            raise ValueError("enable_thinking must be a boolean, an integer or a string")
        readable_switch(switch)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
    if reserved:
        raise ValueError(
            f"{', '.join(reserved)} cannot be set here: the server sets "
            f"{'it' if len(reserved) == 1 else 'them'} (tools go in the request's tools)"
        )
    return value


Effort = Annotated[str, AfterValidator(readable_switch)]


class ThinkingSwitch(BaseModel):
    """The thinking switches outside the dialects' own fields (app.protocol.thinking):
    a value that says neither on nor off is a 400, not the server default."""

    enable_thinking: Annotated[bool | int | str, AfterValidator(readable_switch)] | None = None
    reasoning_effort: Effort | None = Field(None, description="none = thinking off")
    # a bool, a level, Anthropic's {"type": ...} or {"effort": ...}; the dialects
    # with a schema of their own for one (Anthropic, Responses) replace it
    thinking: Annotated[JsonValue, AfterValidator(readable_if_said)] | None = None
    reasoning: Annotated[JsonValue, AfterValidator(readable_if_said)] | None = None


class TemplateSwitch(BaseModel):
    chat_template_kwargs: (
        Annotated[dict[str, JsonValue], AfterValidator(_template_kwargs)] | None
    ) = Field(
        None,
        description="extra variables for the model's chat template (e.g. enable_thinking); "
        "a chat_template of its own and apply_chat_template's arguments are refused",
    )


# fields an envelope may spell as text: OpenAI's metadata holds strings only
SPELLED_NUMBERS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "kv_bits",
    }
)
SPELLED_SWITCHES = {"use_kv_cache": {"true": True, "false": False}}


def _spelled(name: str, value: Any) -> Any:
    """The number or switch ``value`` spells, where it is text that spells one."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if name in SPELLED_SWITCHES:
        return SPELLED_SWITCHES[name].get(text, value)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return value


class Envelope(SamplingFields, CacheSwitch, AdapterSwitch, TemplateSwitch, ThinkingSwitch):
    """``extra_body`` / ``metadata``: free-form, but any sampling field inside is
    held to the same bounds as at the top level; there a number or switch may be
    spelled as text ("42", "false"), as OpenAI's string-only metadata has it."""

    @model_validator(mode="before")
    @classmethod
    def _read_spelled(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        names = SPELLED_NUMBERS.union(SPELLED_SWITCHES).intersection(data)
        return {**data, **{name: _spelled(name, data[name]) for name in names}} if names else data


class EnvelopedSampling(SamplingFields, CacheSwitch, AdapterSwitch, TemplateSwitch, ThinkingSwitch):
    """A request body whose sampling fields may also arrive in an envelope."""

    extra_body: Envelope | None = None

    def _enveloped(self, name: str) -> Any:
        """A cache field: top level over ``extra_body`` over ``metadata``; None if unset."""
        for scope in (self, self.extra_body, getattr(self, "metadata", None)):
            value = getattr(scope, name, None) if scope is not None else None
            if value is not None:
                return value
        return None

    def kv_bits_requested(self) -> int | None:
        value = self._enveloped("kv_bits")
        return None if value is None else int(value)

    def adapter_requested(self) -> str | None:
        value = self._enveloped("adapter")
        return None if value is None else str(value)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: top level over ``extra_body`` over
        ``metadata``, key by key."""
        merged: dict[str, Any] = {}
        for scope in (getattr(self, "metadata", None), self.extra_body, self):
            if isinstance(scope, TemplateSwitch) and scope.chat_template_kwargs:
                merged.update(scope.chat_template_kwargs)
        return merged

    def kv_cache_enabled(self) -> bool:
        return self._enveloped("use_kv_cache") is not False

    def sampling(self) -> SamplingFields:
        """The effective values: top level over ``extra_body`` over ``metadata``."""
        merged: dict[str, Any] = {}
        for scope in (getattr(self, "metadata", None), self.extra_body, self):
            if isinstance(scope, SamplingFields):
                for name in SAMPLING_NAMES:
                    value = getattr(scope, name)
                    if value is not None:
                        merged[name] = value
        return SamplingFields.model_construct(**merged)


# Fields outside the schemas that the server does read (thinking switches,
# template kwargs, session ids: see app.protocol.thinking and app.session_id)
READ_EXTRAS = frozenset(
    {
        "thinking",
        "reasoning",
        "session_id",
        "conversation",
        "conversation_id",
        "thread_id",
        "chat_id",
        "prompt_cache_key",
    }
)


def ignored_fields(body: BaseModel) -> tuple[str, ...]:
    """Fields the client sent that nothing acts on (response_format, ...; inside
    ``extra_body`` too, where only sampling, cache and thinking fields are read):
    said in a response header and the log, never silent. ``metadata`` is the
    client's own free-form record, not reported. A field sent as null asks for
    nothing (SDKs send unset fields so): not reported either."""
    ignored = _unread(body.model_extra)
    envelope = getattr(body, "extra_body", None)
    if isinstance(envelope, BaseModel):
        ignored += [f"extra_body.{k}" for k in _unread(envelope.model_extra)]
    return tuple(sorted(ignored))


def _unread(extra: dict[str, Any] | None) -> list[str]:
    return [k for k in sent_keys(extra) if k not in READ_EXTRAS]


def sent_keys(extra: dict[str, Any] | None) -> list[str]:
    """The keys of a model's extras the client gave a value: one sent as null
    asks for nothing (SDKs send unset fields so), so it is never reported."""
    return [k for k, v in (extra or {}).items() if v is not None]
