"""Anthropic Messages request schema (pydantic). Content blocks stay loose dicts
and are checked where they are translated: agents send block types (and fields
such as ``cache_control``) newer than any schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Claude Code also sends "system" turns mid-conversation (it falls back when refused)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
