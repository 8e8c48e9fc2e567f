"""Memory-budget admission: only admit KV that fits, refuse what never can.

The engine decodes admitted sequences in one left-padded batch cache (mlx-lm's
``BatchKVCache``): every row is as wide as the widest, and buffers grow in
256-position steps. The KV a running set S can ever occupy is therefore

    |S| * layout.sequence_bytes(round_up(max over S of (prompt + max_tokens), 256))

where the layout counts each cache type as it grows: attention layers per
position plus what a grown buffer may hold past its positions (up to 510:
kvcache.layout.allocated), sliding windows up to their window, recurrent layers
a constant state.

Admitting only sets whose bound fits the KV budget makes an out-of-memory in the
KV cache impossible by construction; transients (attention scores of a prefill
chunk, concatenations when a row joins) are covered by a separate reserve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvcache.layout import KV_ALLOCATION_STEP, KVLayout, round_up

__all__ = ["KV_ALLOCATION_STEP", "KVLayout", "round_up"]
MAX_CEILING = 1 << 24  # positions: a bound for models whose state does not grow


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values for one position across all layers."""
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


@dataclass(frozen=True)
class MemoryBudget:
    """How the memory budget splits into weights, a transient reserve and KV."""

    total_bytes: int
    weights_bytes: int
    reserve_bytes: int
    kv_bytes_per_token: int
    source: str = "configured"  # where total_bytes came from (flag, Metal, CUDA, RAM)
    prompt_cache_bytes: int = 0  # held by the prefix cache, never by running requests
    # per-layer costs; None: plain KV caches at kv_bytes_per_token
    layout: KVLayout | None = None
    prefill_chunk: int = 0  # tokens one step may append (sliding windows overshoot by it)
    adapter_bytes: int = 0  # LoRA adapters mounted at run time: weights too
    # the context the reserve's attention scores were sized for: no request goes past it
    context_cap: int | None = None

    def sequence_bytes(self, positions: int) -> int:
        """KV bytes one batch row of ``positions`` positions can occupy."""
        layout = self.layout or KVLayout.attention_only(self.kv_bytes_per_token)
        return layout.sequence_bytes(positions, self.prefill_chunk)

    @property
    def kv_budget_bytes(self) -> int:
        return max(
            0,
            self.total_bytes
            - self.weights_bytes
            - self.adapter_bytes
            - self.reserve_bytes
            - self.prompt_cache_bytes,
        )

    @property
    def ceiling_tokens(self) -> int:
        """The most KV positions a single request can ever reserve."""
        budget = self.kv_budget_bytes
        if self.sequence_bytes(KV_ALLOCATION_STEP) > budget:
            return 0
        lo, hi = 1, MAX_CEILING // KV_ALLOCATION_STEP  # in allocation steps
        while lo < hi:  # sequence_bytes is monotonic in positions
            mid = (lo + hi + 1) // 2
            if self.sequence_bytes(mid * KV_ALLOCATION_STEP) <= budget:
                lo = mid
            else:
                hi = mid - 1
        ceiling = lo * KV_ALLOCATION_STEP
        return ceiling if self.context_cap is None else min(ceiling, self.context_cap)


def transient_reserve(
    total_bytes: int, prefill_tokens: int, context_length: int, num_heads: int
) -> int:
    """Headroom for what is not KV: attention scores of one step's prefill tokens
    against a full context (float32), plus a floor for allocator slack."""
    scores = num_heads * prefill_tokens * context_length * 4
    return scores + max(256 * 2**20, total_bytes // 20)


def plan_budget(
    total_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    context_length: int,
    num_heads: int,
    prefill_chunk: int,
    source: str = "configured",
    layout: KVLayout | None = None,
    prompt_cache: Callable[[int], int] | None = None,
    extra_reserve: int = 0,
) -> MemoryBudget:
    """How a memory budget splits for one model: what engine.boot enforces and
    what the fit views predict (scheduler.fit), from one rule. ``prompt_cache``
    sizes the prefix cache from the bytes weights and reserve leave (None: off);
    ``extra_reserve``: what else the model holds (a vision model's, engine.vision)."""

    def planned(context: int, cap: int | None) -> MemoryBudget:
        reserve = transient_reserve(total_bytes, prefill_chunk, context, num_heads)
        reserve += extra_reserve
        cache = prompt_cache(total_bytes - weights_bytes - reserve) if prompt_cache else 0
        return MemoryBudget(
            total_bytes=total_bytes,
            weights_bytes=weights_bytes,
            reserve_bytes=reserve,
            kv_bytes_per_token=kv_bytes_per_token,
            source=source,
            prompt_cache_bytes=cache,
            layout=layout,
            prefill_chunk=prefill_chunk,
            context_cap=cap,
        )

    full = planned(context_length, None)
    if full.ceiling_tokens >= context_length:
        return full
    # Scores sized for the model's whole context (128k) left a 16 GB Mac no KV at
    # all: size them for the longest context the memory reaches, the largest c
    # whose own reserve still leaves a ceiling of c, and hold requests to it.
    lo, hi = 0, context_length // KV_ALLOCATION_STEP  # in allocation steps
    while lo < hi:  # a larger context's reserve never leaves a higher ceiling
        mid = (lo + hi + 1) // 2
        if planned(mid * KV_ALLOCATION_STEP, None).ceiling_tokens >= mid * KV_ALLOCATION_STEP:
            lo = mid
        else:
            hi = mid - 1
    reach = lo * KV_ALLOCATION_STEP
    return planned(reach, reach) if reach > 0 else full


class AdmissionError(Exception):
    """A request refused at the door; maps to an HTTP status and error code."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ContextLengthExceeded(AdmissionError):
    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        prompt_tokens: int | None = None,
        limit: int | None = None,
        max_tokens: int = 0,
    ):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens  # at least this many (None: not counted)
        self.limit = limit  # the context length
        self.max_tokens = max_tokens  # what the completion asked for on top

    @property
    def anthropic_message(self) -> str:
        """Anthropic's words for it, which Claude Code reads: to compact the
        conversation, or to retry with a smaller max_tokens."""
        prompt, limit = self.prompt_tokens, self.limit
        if prompt is None or limit is None:
            return f"prompt is too long: {self.message}"
        if self.max_tokens and prompt < limit:
            return (
                f"input length and `max_tokens` exceed context limit: {prompt} + "
                f"{self.max_tokens} > {limit}, decrease input length or `max_tokens` and try again"
            )
        # a prompt of the whole context leaves no room for one token of reply
        most = limit if prompt > limit else limit - 1
        return f"prompt is too long: {prompt} tokens > {most} maximum"


class OverBudget(AdmissionError):
    error_type = "memory_admission"
    code = "context_over_budget"


class QueueFull(AdmissionError):
    status = 429
    error_type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after: int | None = retry_after


RETRY_AFTER_S = 5  # what a 503 that is worth retrying tells the client to wait


class EngineUnavailable(AdmissionError):
    status = 503
    error_type = "server_error"
    code = "engine_unavailable"

    def __init__(self, message: str, retry_after: int | None = None, code: str | None = None):
        super().__init__(message)
        self.retry_after = retry_after  # seconds; None: nobody knows (the engine died)
        if code is not None:
            self.code = code

    @classmethod
    def loading(cls) -> EngineUnavailable:
        return cls("The model is still loading; retry shortly.", RETRY_AFTER_S, "loading")

    @classmethod
    def shutting_down(cls) -> EngineUnavailable:
        return cls("The server is shutting down; retry shortly.", RETRY_AFTER_S, "server_shutdown")


class AdmissionController:
    """Decides whether a request can ever run, and whether it can run now."""

    def __init__(self, budget: MemoryBudget, context_length: int):
        self.budget = budget
        self.context_length = context_length

    def footprint(self, reserved_tokens: Iterable[int]) -> int:
        """Upper bound on KV bytes of a batch whose rows reserve these many tokens."""
        sizes = list(reserved_tokens)
        if not sizes:
            return 0
        return len(sizes) * self.budget.sequence_bytes(round_up(max(sizes)))

    def check_ever_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        total = prompt_tokens + max_tokens
        if total > self.context_length:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, you requested {total} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the "
                f"messages or completion.",
                prompt_tokens,
                self.context_length,
                max_tokens,
            )
        cap = self.budget.context_cap
        if self.footprint([total]) > self.budget.kv_budget_bytes or (cap and total > cap):
            raise OverBudget(
                f"Request needs {total} KV positions ({prompt_tokens} prompt + {max_tokens} "
                f"max_tokens) but the memory budget admits at most "
                f"{self.budget.ceiling_tokens} per request "
                f"(KV budget {format_size(self.budget.kv_budget_bytes)} of "
                f"{format_size(self.budget.total_bytes)} total, "
                f"{self.budget.kv_bytes_per_token} bytes per token, "
                f"{self.budget.sequence_bytes(0)} bytes of fixed state per sequence). "
                f"Lower max_tokens or shorten the prompt."
            )

    def fits_with(self, running: Iterable[int], candidate: int) -> bool:
        """Would the running set plus ``candidate`` stay within the KV budget?"""
        return self.footprint([*running, candidate]) <= self.budget.kv_budget_bytes
