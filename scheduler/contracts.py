"""Typed boundaries between the HTTP layer, the scheduler and the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcache.prompt_key import RenderedPrompt
from kvcache.stats import KVCacheStats
from scheduler.admission import MemoryBudget


class PromptFormatter(Protocol):
    """Turns chat messages into the model tokens plus their cache-key view."""

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        relocate_volatile: bool = False,
        **template_kwargs: Any,
    ) -> RenderedPrompt: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt, with the special tokens (BOS) the model expects."""
        ...

    def check_length(self, text: str) -> None:
        """Raise ContextLengthExceeded if no tokenisation of ``text`` fits the context."""
        ...


@dataclass(frozen=True)
class TextSyntax:
    """How the loaded model writes reasoning and tool calls, probed once at load."""

    think_start: str | None = "<think>"
    think_end: str | None = "</think>"
    tool_family: str | None = None  # mlx-lm tool parser name inferred from the template
    tool_call_start: str | None = None  # that family's markup, as mlx-lm knows it
    tool_call_end: str | None = None
    # variables the chat template reads that kvwarm may set (enable_thinking, preserve_thinking)
    template_vars: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the server needs to know about the loaded model."""

    model_id: str
    path: str
    context_length: int
    budget: MemoryBudget  # also holds the weights and KV-per-token sizes
    # sampling defaults from generation_config.json (only the fields it sets)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    formatter: PromptFormatter | None = None
    vocab_size: int = 0
    blas: str = ""
    device: str = ""
    syntax: TextSyntax = field(default_factory=TextSyntax)


@dataclass(frozen=True)
class EngineStats:
    """Counters the engine thread keeps (read without locks; ints are atomic)."""

    steps: int
    active_rows: int
    prefill_tokens: int
    generated_tokens: int
    prompt_cache: KVCacheStats | None = None  # None: no prefix cache
    batch_sizes: tuple[int, ...] = ()  # decode steps by rows decoding together (index = rows)
    # MLX allocator bytes (active, peak, cache), sampled by the engine thread
    memory: dict[str, int] = field(default_factory=dict)
    row_faults: int = 0  # requests failed alone by a fault of their own
    recoveries: int = 0  # batches rebuilt after a step fault no row owned


class EngineHandle(Protocol):
    """The engine as the HTTP layer sees it (implemented by engine.EngineThread)."""

    @property
    def ready(self) -> bool: ...

    @property
    def alive(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def model_info(self) -> ModelInfo | None: ...

    def engine_stats(self) -> EngineStats: ...
