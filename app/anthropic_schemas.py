"""Anthropic Messages request schemas (pydantic, strict, bounds included).

Content blocks are a union on ``type``; fields the schema does not name
(``cache_control``, ``citations``) are kept and ignored. Which block may appear
in which role is checked where the blocks are translated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from app.request_fields import Envelope, EnvelopedSampling, StopString, bounded_list, null_is
from app.schemas import (
    MAX_NAME,
    MAX_PARTS,
    MAX_TOOLS,
    STRICT,
    MaxTokens,
    ToolName,
    check_message_count,
)


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ImageBlock(BaseModel):
    model_config = STRICT
    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlock(BaseModel):
    model_config = STRICT
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1, max_length=MAX_NAME)
    input: dict[str, Any] = Field(default_factory=dict)


class SearchResultBlock(BaseModel):
    """A search result the client found (RAG): read as its title, source and text."""

    model_config = STRICT
    type: Literal["search_result"]
    source: str
    title: str
    content: bounded_list(TextBlock, MAX_PARTS)
    citations: dict[str, Any] | None = None


ResultPart = Annotated[
    TextBlock | ImageBlock | DocumentBlock | SearchResultBlock, Field(discriminator="type")
]


class ToolResultBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | bounded_list(ResultPart, MAX_PARTS) | None = None
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = STRICT
    type: Literal["redacted_thinking"]
    data: str | None = None


Block = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | SearchResultBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(BaseModel):
    model_config = STRICT
    # Claude Code also sends "system" turns mid-conversation (it falls back when refused)
    role: Literal["user", "assistant", "system"]
    content: str | bounded_list(Block, MAX_PARTS)


class CustomTool(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]


class ServerTool(BaseModel):
    """Anthropic's own tools (web search, code execution, ...): accepted, ignored."""

    model_config = STRICT
    type: str
    name: str | None = None

    @field_validator("type")
    @classmethod
    def _not_custom(cls, value: str) -> str:
        if value == "custom":  # a custom tool that failed its own checks: not ignorable
            raise ValueError("a custom tool needs a valid name and input_schema")
        return value


class AnthropicToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "none", "tool"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=2**31 - 1)


class CountTokensRequest(EnvelopedSampling):
    model_config = STRICT

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | bounded_list(TextBlock, MAX_PARTS) | None = None
    tools: bounded_list(CustomTool | ServerTool, MAX_TOOLS) | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: Envelope | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _fits_context(cls, value: Any, info: ValidationInfo) -> Any:
        return check_message_count(value, info)


class MessagesRequest(CountTokensRequest):
    max_tokens: MaxTokens
    stop_sequences: bounded_list(StopString, 8) | None = None
    stream: Annotated[bool, null_is(False)] = False
