"""A request's row in the continuous batch: its text output, sampler, KV
bookkeeping and the outputs it reports (engine.batch_runner drives the rows)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.lora import is_tag
from engine.row_faults import GuardedProcessor, GuardedSampler
from engine.text_output import TextOutput
from kvcache.disk_reads import PendingHit
from kvcache.prompt_key import PromptKey
from scheduler.request import CacheReport, FinishReason, Request, RequestOutput, RequestStats
from scheduler.step_budget import Prefill


@dataclass
class Row:
    request: Request
    text: TextOutput
    sampler: GuardedSampler
    processors: list[GuardedProcessor]
    generated: int = 0
    tokens: list[int] = field(default_factory=list)  # generated ids (to re-admit after a fault)
    first_token_at: float | None = None
    cached: int = 0  # prompt tokens served from the prefix cache
    kv_offset: int = 0  # KV positions the reused cache holds (differs from ``cached``
    # when a volatile span of another length was stepped over)
    kv_key: PromptKey | None = None  # what this row's KV holds before generation
    entry_id: int | None = None  # prefix-cache entry read (released after prefill)
    disk_read: PendingHit | None = None  # its disk-tier hit, being read (not startable)
    # prefill progress values (prompt tokens after ``cached``) at which to store KV
    checkpoints: list[int] = field(default_factory=list)
    prefill_len: int = 0  # prompt tokens after ``cached`` (what prefill runs)
    stops: tuple[int, ...] = ()  # progress values where the generator pauses prefill
    replayed: int = 0  # generated tokens prefilled again after a batch rebuild
    slot: int = 0  # its adapter's routing slot (engine.lora.BASE: none)
    # multimodal RoPE: the next token's position minus the KV depth (engine.mrope)
    rope_delta: int = 0
    joined_at: float = field(default_factory=time.monotonic)
    report: CacheReport = field(default_factory=CacheReport)

    def stats(self, now: float) -> RequestStats:
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestStats(
            queued_s=max(0.0, self.joined_at - self.request.arrival_time),
            prefill_s=max(0.0, first - self.joined_at),
            decode_s=max(0.0, now - first),
            cache=self.report,
        )

    def output(self, text: str = "", token_ids: tuple[int, ...] = (), **fields) -> RequestOutput:
        """An output of this row carrying its running totals."""
        return RequestOutput(
            request_id=self.request.request_id,
            text=text,
            token_ids=token_ids,
            prompt_tokens=len(self.request.prompt_tokens),
            completion_tokens=self.generated,
            cached_tokens=self.cached,
            **fields,
        )

    def kv_depth(self, done: int) -> int:
        """KV positions this row holds once ``done`` prompt tokens are prefilled."""
        return self.kv_offset + done + self.generated - self.replayed

    def prefill(self, done: int, running: bool, waited: int = 0) -> Prefill:
        """The row as the step budget sees it, ``done`` tokens into its prefill."""
        # the generator runs the prompt's last token as the first decode step
        total = max(0, self.prefill_len - 1 - done)
        stop = next((s for s in self.stops if s > done), done)
        return Prefill(
            self.request.request_id,
            self.kv_depth(done),
            min(stop - done, total),
            total,
            running,
            waited,
        )

    def failure(self, now: float, error: str) -> RequestOutput:
        return self.output(
            finish_reason=FinishReason.ERROR,
            error=f"the request failed in the engine: {error}",
            error_code="engine_error",
            stats=self.stats(now),
        )


@dataclass
class Waiting:
    """A row admitted but not prefilling yet: the step budget starts it."""

    row: Row
    segments: list[list[int]]
    cache: list | None
    cached_tokens: list[int] | None
    waited: int = 0  # steps it was held back
    started: bool = False  # its prefill began (a vision row's first image)
    vision_at: int | None = None  # prompt tokens its images' prefill reached so far


def kv_only(caches: list) -> list:
    """A row's caches without its adapter tag: what the prefix cache stores."""
    return [c for c in caches if not is_tag(c)]
