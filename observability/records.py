"""Plain records the server hands to its observers (metrics, traces, logs).

No prometheus or opentelemetry here: the app builds these, observability/
turns them into whatever each backend wants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.contracts import EngineStats
from scheduler.request import CacheReport, RequestStats


@dataclass(frozen=True)
class RequestRecord:
    """One finished request (or one that ended early), as every observer sees it."""

    request_id: str
    dialect: str  # chat / messages / responses / completions
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish: str  # stop / length / tool_calls / abort / error
    e2e_s: float
    started_at: float  # wall clock (time.time()) at arrival
    prepare_s: float = 0.0  # body received -> queued: parsing, rendering, tokenising
    waited_s: float | None = None  # queued -> left, for one that never joined the batch
    ttft_s: float | None = None
    max_itl_s: float | None = None  # the longest gap between two tokens (None: < 2 tokens)
    stats: RequestStats | None = None  # queue / prefill / decode + cache report (engine-run)
    session: str | None = None
    disconnected: bool = False
    tool_calls: int = 0
    request: dict[str, Any] = field(default_factory=dict)  # max_tokens, temperature, top_p
    # what the prefix cache did, known from the first token on (also for requests
    # that ended early, which carry no stats)
    cache: CacheReport | None = None
    adapter: str = ""  # the LoRA adapter it ran with; "" = the base model

    @property
    def cache_report(self) -> CacheReport | None:
        """None: the request never reached the prefix cache (or ran without one)."""
        return self.stats.cache if self.stats else self.cache

    @property
    def queued_s(self) -> float | None:
        """Its time in the queue: until it joined the batch, or all of its time there
        when it never did (expired or given up). None: it joined and left with no
        timings (aborted)."""
        return self.stats.queued_s if self.stats is not None else self.waited_s

    @property
    def reached_engine(self) -> bool:
        """Looked up in the prefix cache, prefilled or decoded: the engine took it on
        (a request cancelled mid-prefill has only its cache report)."""
        return (
            self.stats is not None
            or self.cache is not None
            or self.completion_tokens > 0
            or self.ttft_s is not None
        )

    @property
    def tokens_per_s(self) -> float:
        if self.stats is None:
            return self.completion_tokens / self.e2e_s if self.e2e_s > 0 else 0.0
        # decode time runs from the first token: it holds the gaps after it
        decode = self.stats.decode_s
        return (self.completion_tokens - 1) / decode if decode > 0 else 0.0

    def fields(self) -> dict[str, Any]:
        """The flat form for one-line logs."""
        stats, cache = self.stats, self.cache_report
        return {
            "request_id": self.request_id,
            "session": self.session,
            "dialect": self.dialect,
            "adapter": self.adapter or None,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            # its wait also when it never joined the batch, as /metrics counts it
            "queue_s": round(self.queued_s, 3) if self.queued_s is not None else None,
            "prefill_s": round(stats.prefill_s, 3) if stats else None,
            "decode_s": round(stats.decode_s, 3) if stats else None,
            "ttft_s": round(self.ttft_s, 3) if self.ttft_s is not None else None,
            "e2e_s": round(self.e2e_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "finish": self.finish,
            "tool_calls": self.tool_calls,
            "cache_layer": cache.layer if cache else None,
            "cache_depth": cache.depth if cache else 0,
        }


@dataclass(frozen=True)
class ServerSnapshot:
    """Gauges read at scrape time."""

    model: str
    running: int
    waiting: int
    reserved_kv_bytes: int
    kv_budget_bytes: int
    watchdog_aborts: int
    engine: EngineStats
