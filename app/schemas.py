"""OpenAI chat-completions request schema (pydantic). Unknown fields are kept:
agents send many of their own, and later dialect features read them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """Any non-text content part (images arrive with the vision issue)."""

    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        unsupported = [p.type for p in self.content if not isinstance(p, TextPart)]
        if unsupported:
            raise ValueError(f"content part type {unsupported[0]!r} is not supported by this model")
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """Sampling and limits shared by chat and legacy completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extension: keep generating through EOS (benchmarks, load tests)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for key, bias in value.items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError("logit_bias values must be between -100 and 100")
        return value

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
