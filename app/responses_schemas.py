"""OpenAI Responses request schemas (pydantic, strict, bounds included)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.request_fields import (
    Effort,
    Envelope,
    EnvelopedSampling,
    bounded_list,
    null_is,
    sent_keys,
)
from app.schemas import (
    MAX_NAME,
    MAX_PARTS,
    MAX_TOOLS,
    STRICT,
    MaxTokens,
    ToolName,
    check_message_count,
)


class InputPart(BaseModel):
    """input_text / output_text / refusal / input_image / input_file / reasoning text parts."""

    model_config = STRICT
    type: Literal[
        "input_text",
        "output_text",
        "text",
        "refusal",
        "input_image",
        "input_file",
        "summary_text",
        "reasoning_text",
    ]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image: a data URL or an http(s) URL
    file_id: str | None = None
    detail: str | None = None


Parts = bounded_list(InputPart, MAX_PARTS)


# an item's id: kept, listed by input_items and named by an item_reference
ItemId = Annotated[str, Field(min_length=1, max_length=256)]


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    id: ItemId | None = None
    role: Literal["user", "assistant", "system", "developer"] = "user"
    content: str | Parts


class ReasoningItem(BaseModel):
    model_config = STRICT
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: Parts | None = None
    content: Parts | None = None


class FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    id: ItemId | None = None
    call_id: str
    name: str = Field(min_length=1, max_length=MAX_NAME)
    arguments: str = "{}"


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    id: ItemId | None = None
    call_id: str
    output: str | Parts


class CustomToolCallItem(BaseModel):
    """A freeform tool's call (Codex's apply_patch): its ``input`` is the call's text."""

    model_config = STRICT
    type: Literal["custom_tool_call"]
    id: ItemId | None = None
    call_id: str
    name: str = Field(min_length=1, max_length=MAX_NAME)
    input: str


class CustomToolCallOutputItem(FunctionCallOutputItem):
    """A freeform tool's output: a function call's output by another name."""

    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


class ItemReference(BaseModel):
    """An item of a stored response, by its id."""

    model_config = STRICT
    type: Literal["item_reference"]
    id: ItemId


# items of tools OpenAI runs (or the client runs for them) that kvwarm does not
# serve: skipped, and named in the ignored-fields header
HOSTED_ITEMS = frozenset(
    {
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
    }
)


class HostedItem(BaseModel):
    """A hosted tool's item: only its type is read (one of ``HOSTED_ITEMS``)."""

    model_config = STRICT
    type: str
    id: ItemId | None = None


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return "hosted" if isinstance(kind, str) and kind in HOSTED_ITEMS else kind


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[HostedItem, Tag("hosted")],
    Discriminator(_item_type),
]


class ResponsesTool(BaseModel):
    """A function tool (flat, Responses style); built-in tool types are ignored."""

    model_config = STRICT
    type: str
    name: ToolName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_has_a_name(self) -> ResponsesTool:
        if self.type == "function" and self.name is None:
            raise ValueError("a function tool needs a name")
        return self


# a short word a response echoes back ("auto", "concise", a tool type)
EchoedWord = Annotated[str, Field(max_length=64)]


class ResponsesToolChoice(BaseModel):
    model_config = STRICT
    type: EchoedWord
    name: ToolName | None = None


class ReasoningConfig(BaseModel):
    model_config = STRICT
    effort: Effort | None = None
    summary: EchoedWord | None = None


# OpenAI's limits on a response's metadata: its own key/value record, echoed back
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
# built-in tools (web_search, file_search, ...) are ignored yet echoed as sent: their
# configurations are small, and nothing else bounds them (the context counts no part)
MAX_BUILT_IN_TOOLS_BYTES = 64 * 2**10


# a text format is echoed back in every event of a response (structured output is
# not enforced, as chat's response_format is not): bounded as built-in tools are
MAX_TEXT_FORMAT_BYTES = 64 * 2**10


class TextFormat(BaseModel):
    """``text.format``: read to be echoed as asked (the SDK's parse() reads it), not applied."""

    model_config = STRICT
    type: Literal["text", "json_schema", "json_object"]
    name: Annotated[str, Field(max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _json_schema_is_whole(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self

    def echoed(self) -> dict[str, Any]:
        fields = {"type", "name", "schema_", "description", "strict"}
        return self.model_dump(include=fields, by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("format")
    @classmethod
    def _small_format(cls, value: TextFormat | None) -> TextFormat | None:
        size = len(json.dumps(value.echoed(), ensure_ascii=False)) if value else 0
        if size > MAX_TEXT_FORMAT_BYTES:
            raise ValueError(
                f"a text format (not enforced, echoed back) of {size} bytes; at most "
                f"{MAX_TEXT_FORMAT_BYTES} are accepted"
            )
        return value

    def echoed(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format.echoed() if self.format else {"type": "text"}}
        if self.verbosity is not None:
            out["verbosity"] = self.verbosity
        return out

    def ignored(self) -> tuple[str, ...]:
        """What of it nothing applies: any format but plain text, verbosity, extra
        keys (not those sent as null, as for top-level fields)."""
        out = [f"text.{k}" for k in sent_keys(self.model_extra)]
        if self.format is not None:
            if self.format.type != "text":
                out.append("text.format")
            out += [f"text.format.{k}" for k in sent_keys(self.format.model_extra)]
        if self.verbosity is not None:
            out.append("text.verbosity")
        return tuple(sorted(out))


def client_metadata(metadata: Envelope | None) -> dict[str, str]:
    """The client's own record in ``metadata`` (kvwarm's cache and sampling fields,
    read from it, are not part of it): what a response echoes."""
    return dict(metadata.model_extra or {}) if metadata is not None else {}


class ResponsesRequest(EnvelopedSampling):
    model_config = STRICT

    model: str | None = None
    # optional as in the SDK: a turn may continue from previous_response_id alone
    input: (
        Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)] | None
    ) = None
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    tools: bounded_list(ResponsesTool, MAX_TOOLS) | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: Annotated[bool, null_is(True)] = True
    reasoning: ReasoningConfig | None = None
    stream: Annotated[bool, null_is(False)] = False
    store: Annotated[bool, null_is(True)] = True
    # ids are "resp_" and 24 hex digits; echoed, and named in a 404
    previous_response_id: Annotated[str, Field(max_length=256)] | None = None
    metadata: Envelope | None = None
    text: TextConfig | None = None

    @field_validator("tools")
    @classmethod
    def _small_built_in_tools(cls, value: list[ResponsesTool] | None) -> Any:
        built_in = [t.model_dump(exclude_none=True) for t in value or () if t.type != "function"]
        size = len(json.dumps(built_in, ensure_ascii=False)) if built_in else 0
        if size > MAX_BUILT_IN_TOOLS_BYTES:
            raise ValueError(
                f"built-in tools (ignored, echoed back) of {size} bytes; at most "
                f"{MAX_BUILT_IN_TOOLS_BYTES} are accepted"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _openai_metadata(cls, value: Envelope | None) -> Envelope | None:
        """Held to OpenAI's limits: every response echoes it, on the event loop."""
        record = client_metadata(value)
        if len(record) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} key/value pairs")
        for key, item in record.items():
            if len(key) > METADATA_KEY:
                raise ValueError(f"key {key[:METADATA_KEY]!r}... is over {METADATA_KEY} characters")
            if not isinstance(item, str) or len(item) > METADATA_VALUE:
                raise ValueError(
                    f"{key!r}: a value is a string of at most {METADATA_VALUE} characters"
                )
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _fits_context(cls, value: Any, info: ValidationInfo) -> Any:
        return check_message_count(value, info, "input items")
