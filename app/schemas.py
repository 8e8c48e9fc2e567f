"""OpenAI chat-completions and legacy completions request schemas.

Validation is strict (a JSON ``false`` is not a temperature) and every bound
the server enforces is in the model, so the OpenAPI document generated from
these models says exactly what is accepted. Unknown fields are kept (agents
send many of their own; later dialect features read them) and reported as
ignored when nothing reads them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.request_fields import (
    Envelope,
    EnvelopedSampling,
    StopList,
    StopString,
    bounded_list,
    null_is,
)

STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
MAX_TOOLS = 1024
MAX_PARTS = 4096  # content parts in one message
MAX_CALLS = 1024  # tool calls in one assistant message
MAX_NAME = 256
MaxTokens = Annotated[int, Field(ge=1, le=2**31 - 1)]
# a tool's name as it is written into prompts and forced-call openings: what
# OpenAI and Anthropic accept ([A-Za-z0-9_-]), plus the dots, colons and slashes
# of namespaced MCP names (SEP-986); never quotes, spaces or markup
ToolName = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.:/-]+$")]


def one_choice(value: Any, info: ValidationInfo) -> Any:
    """``n`` / ``best_of`` other than 1, refused with the reason (the schema's own
    error said only "Input should be 1")."""
    if type(value) is int and value != 1:
        raise PydanticCustomError(
            "one_choice",
            "one choice per request: {field} must be 1; send separate requests for more",
            {"field": info.field_name},
        )
    return value


def check_message_count(value: Any, info: ValidationInfo, what: str = "messages") -> Any:
    """A message costs at least one token, so no request holds more messages than
    the model has context (checked before any message is validated)."""
    limits = (info.context or {}).get("limits")
    if limits is not None and isinstance(value, list) and len(value) > limits.max_messages:
        raise ValueError(
            f"at most {limits.max_messages} {what} fit this model's context, got {len(value)}"
        )
    return value


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = STRICT
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    model_config = STRICT
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    model_config = STRICT
    url: str


class VideoPart(BaseModel):
    """vLLM's extension: a vision model reads --video-frames frames of it."""

    model_config = STRICT
    type: Literal["video_url"]
    video_url: VideoURL


class AudioPart(BaseModel):
    model_config = STRICT
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FilePart(BaseModel):
    model_config = STRICT
    type: Literal["file"]
    file: dict[str, Any]


class RefusalPart(BaseModel):
    model_config = STRICT
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | AudioPart | FilePart | RefusalPart,
    Field(discriminator="type"),
]


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1, max_length=MAX_NAME)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client echoes it."""

    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | bounded_list(ContentPart, MAX_PARTS) | None = None
    name: str | None = None
    tool_calls: bounded_list(ToolCallIn, MAX_CALLS) | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # the same, as vLLM >= 0.10 and OpenRouter (reasoning) and gpt-oss (thinking) name it
    reasoning: str | None = None
    thinking: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        unsupported = [p.type for p in self.content if not isinstance(p, TextPart | RefusalPart)]
        if unsupported:
            raise ValueError(f"content part type {unsupported[0]!r} is not supported by this model")
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class FunctionDef(BaseModel):
    model_config = STRICT
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """A function tool; other tool types are accepted and ignored."""

    model_config = STRICT
    type: str = "function"
    function: FunctionDef | None = None

    @model_validator(mode="after")
    def _function_has_definition(self) -> ChatTool:
        if self.type == "function" and self.function is None:
            raise ValueError("a function tool needs a 'function' definition")
        return self


class NamedFunction(BaseModel):
    model_config = STRICT
    name: ToolName


class ToolChoiceObject(BaseModel):
    model_config = STRICT
    type: str = "function"
    function: NamedFunction | None = None
    name: ToolName | None = None  # Responses puts it at the top level


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class GenerationFields(EnvelopedSampling):
    """Limits and streaming shared by chat and legacy completions."""

    model_config = STRICT

    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: StopString | StopList | None = None
    n: Annotated[Literal[1], null_is(1)] = Field(1, description="only one choice per request")
    stream: Annotated[bool, null_is(False)] = False
    stream_options: StreamOptions | None = None
    # vLLM extension: keep generating through EOS (benchmarks, load tests)
    ignore_eos: bool = False
    # vLLM's: the stop string in the text; not done here, so refused when asked
    include_stop_str_in_output: Annotated[bool, null_is(False)] = Field(
        False, description="vLLM's option to keep the stop string: not supported (400)"
    )
    metadata: Envelope | None = None

    _one_choice = field_validator("n", mode="before")(one_choice)

    @field_validator("include_stop_str_in_output")
    @classmethod
    def _stop_str_dropped(cls, value: bool) -> bool:
        if value:
            raise ValueError("keeping the stop string in the output is not supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_with_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # OpenAI and vLLM refuse them too: a client expecting a usage chunk gets none.
        # A field's check (stream is declared before it), so the error names the field
        # (a stream that failed its own check is not in info.data: that error is the one)
        if value is not None and info.data.get("stream", True) is False:
            raise PydanticCustomError(
                "stream_options_without_stream",
                "stream_options is only allowed when stream is true",
            )
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: bounded_list(ChatTool, MAX_TOOLS) | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: Annotated[bool, null_is(True)] = Field(
        True, description="false: the reply's first tool call only"
    )
    logprobs: bool | None = Field(None, description="return each generated token's log probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="and this many likeliest alternatives (needs logprobs)"
    )

    @field_validator("messages", mode="before")
    @classmethod
    def _fits_context(cls, value: Any, info: ValidationInfo) -> Any:
        return check_message_count(value, info)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]


class CompletionRequest(GenerationFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | bounded_list(str, 1, min_items=1)
        | TokenIds
        | bounded_list(TokenIds, 1, min_items=1)
    )
    echo: Annotated[bool, null_is(False)] = False
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="return each token's log probability and this many likeliest "
        "alternatives (not with echo)",
    )
    suffix: str | None = Field(None, description="fill-in-the-middle: not supported (400)")
    best_of: Annotated[Literal[1], null_is(1)] = Field(
        1, description="only one completion per request (as n)"
    )

    _one_completion = field_validator("best_of", mode="before")(one_choice)

    @field_validator("prompt", mode="before")
    @classmethod
    def _fits_context(cls, value: Any, info: ValidationInfo) -> Any:
        # a batch (several texts or token lists) is one shape of its own, not a
        # wrong type in each branch of the union
        if isinstance(value, list) and len(value) > 1 and isinstance(value[0], (str, list)):
            raise PydanticCustomError(
                "one_prompt", "one prompt per request; send a batch as separate requests"
            )
        if isinstance(value, list) and value and isinstance(value[0], list):
            check_message_count(value[0], info, "prompt tokens")
        return check_message_count(value, info, "prompt tokens")

    @property
    def prompt_value(self) -> str | list[int]:
        """The one prompt: text, or token ids (a list of one of either is that one)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]
