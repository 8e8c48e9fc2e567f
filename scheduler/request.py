"""The neutral request every API dialect is translated into, and its lifecycle."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from kvcache.prompt_key import PromptKey

_ids = itertools.count(1)


def next_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}-{int(time.time() * 1000) % 10**9}"


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away
    ERROR = "error"  # the engine failed


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling settings (request values over model defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # token id -> additive bias, kept as a tuple so the params stay hashable
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class CacheHints:
    """What the prefix cache needs to find and store this request's KV."""

    key: PromptKey  # model tokens (== Request.prompt_tokens) + volatile spans + cache key
    session_id: str
    message_hashes: tuple[str, ...] = ()  # canonical hash per message (session layer)
    kv_bits: int | None = None  # None: the server's --kv-bits
    # the adapter's cache namespace (id + content fingerprint, set by the engine):
    # KV computed under one adapter is never handed to another; "" = the base model
    adapter: str = ""
    # session_id is a conversation's own id (not a fallback guess, nor a
    # prompt_cache_key one app may share among its users): what its earlier turns
    # read, this one may keep reading (kvcache.index: reminders only an entry has)
    own_conversation: bool = False


@dataclass(frozen=True)
class ImageInput:
    """One image of a vision request: where its tokens sit in the prompt, what
    they are, and the processor's pixel inputs (numpy arrays) for the engine."""

    start: int  # first prompt token of the image
    tokens: tuple[int, ...]  # the model's ids for it (placeholders and markers)
    # its 32-byte key (kvcache.image_ids.image_key: content digest and tokens): the
    # engine keeps its tower features by it
    key: bytes
    # what its ids in the cache key's view derive from (kvcache.image_ids.run_key):
    # ``key``, or a request's own for an image of too few tokens to be named safely
    run_key: bytes
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)
    # positions its tokens take minus their count: multimodal RoPE (Qwen2-VL) lays
    # an image on a grid, so the text after it sits this far from its index
    rope_shift: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Host memory its processor arrays hold (a 2048 px image tiled for
        SmolVLM: 85 MiB) until its request ends."""
        return sum(int(getattr(v, "nbytes", 0)) for v in self.inputs.values())


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """A token and its log probability, with its bytes (a token may be part of a
    UTF-8 character: the bytes say exactly what it contributes)."""

    token_id: int
    logprob: float
    piece: bytes


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability and the likeliest alternatives at its
    step (most likely first), as the sampler saw them: after logit_bias and the
    penalties, before temperature."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class ReasoningTags:
    """How a chat reply's reasoning is marked, as its output parser reads it:
    client stop strings match only the answer after it (engine.reasoning_gate)."""

    start: str  # the think tag: opens a block at the reply's start
    end: str
    opened: bool  # the prompt ends inside an opened block: the reply starts in it


@dataclass(eq=False)  # one object per request: identity, not an O(prompt) field compare
class Request:
    """One generation job. ``prompt_tokens`` are exactly what the model sees."""

    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # a chat reply drops the space a BPE detokeniser puts before its first word;
    # a raw completion continues the prompt's text and keeps it
    trim_leading_space: bool = True
    # None: stop strings match all the text (a raw completion, a forced tool call)
    reasoning: ReasoningTags | None = None
    cache: CacheHints | None = None  # None: this request neither reads nor feeds the cache
    adapter: str | None = None  # a mounted LoRA adapter's id; None: the base model
    images: tuple[ImageInput, ...] = ()  # in prompt order (vision models)
    # None: no log probabilities; N: each token's, and its N likeliest alternatives
    logprobs: int | None = None
    request_id: str = field(default_factory=next_request_id)
    arrival_time: float = field(default_factory=time.monotonic)  # prepared: queue time runs
    # when its HTTP body had arrived (monotonic), before parsing, rendering and
    # tokenising; None: it did not come over HTTP
    received_at: float | None = None
    state: RequestState = RequestState.WAITING

    @property
    def started_at(self) -> float:
        """Where the client's wait began: TTFT and end-to-end latency count from here."""
        return self.arrival_time if self.received_at is None else self.received_at

    @property
    def reserved_tokens(self) -> int:
        """KV positions this request may ever occupy."""
        return len(self.prompt_tokens) + self.max_tokens

    @property
    def image_bytes(self) -> int:
        """Host memory its images' processor arrays hold: an array shared by an
        image's repeats (``app.image_prompt``) counts once."""
        arrays = {id(v): v for image in self.images for v in image.inputs.values()}
        return sum(int(getattr(v, "nbytes", 0)) for v in arrays.values())


@dataclass(frozen=True)
class CacheReport:
    """What the prefix cache did for one request (plain data for logs, traces, metrics)."""

    layer: str | None = None  # "global" (block-hash chain) / "session"; None: a miss or no cache
    depth: int = 0  # prompt tokens reused
    entry_tokens: int = 0  # length of the entry they came from
    stale_tokens: int = 0  # volatile tokens reused with their older values
    candidates: int = 0
    rejected: tuple[str, ...] = ()  # why candidates were turned down
    tier: str = "none"  # where the reused KV was: ram, disk, none (a miss), disabled
    known_session: bool = False  # the conversation had cached KV before this request

    @property
    def conv_kv(self) -> str:
        """X-Conv-KV: hit (RAM), disk, fresh (a conversation new to the cache),
        none (known, but nothing reusable), disabled (no cache for this request)."""
        if self.tier in ("ram", "disk", "disabled"):
            return "hit" if self.tier == "ram" else self.tier
        return "none" if self.known_session else "fresh"


QUEUE_TIMEOUT = "the request waited in the queue past --request-timeout; retry later"
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class RequestStats:
    """Where one request's time went, reported once, on its final output."""

    queued_s: float  # arrival -> joined the running batch
    prefill_s: float  # joined -> first token
    decode_s: float  # first token -> finish
    cache: CacheReport = field(default_factory=CacheReport)


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, not a total).

    Not changed once it leaves the engine, but not ``frozen``: the engine makes
    one per row per step, and a frozen dataclass's ``__init__`` costs eight times
    as much (a large batch's step pays it on the host's critical path).
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    # why it failed, for the HTTP status and the error body: engine_error (500),
    # queue_timeout / server_shutdown (503, retry later)
    error_code: str | None = None
    # ended by the watchdog (finish LENGTH): delivered, but nothing of it is stored
    timed_out: bool = False
    # seconds from arrival to the first generated token; set on the output carrying it
    ttft: float | None = None
    cache: CacheReport | None = None  # what the prefix cache did, on the first token's output
    stop_sequence: str | None = None  # the stop string that ended it (finish STOP)
    stats: RequestStats | None = None  # on the final output of a request the engine ran
    logprobs: tuple[TokenLogprob, ...] = ()  # per token of ``token_ids``, when requested
    # when the engine produced it (monotonic): inter-token gaps are measured here,
    # not when the HTTP loop gets round to reading the queue
    at: float = field(default_factory=time.monotonic)

    @classmethod
    def failure(cls, request_id: str, error: str, code: str = "engine_error") -> RequestOutput:
        """The final output of a request the engine could not finish."""
        return cls(request_id, finish_reason=FinishReason.ERROR, error=error, error_code=code)

    @classmethod
    def queue_timeout(cls, request_id: str) -> RequestOutput:
        """The watchdog's end for a request that never started: 503, retry later."""
        return cls.failure(request_id, QUEUE_TIMEOUT, "queue_timeout")

    @classmethod
    def shutdown(cls, request_id: str) -> RequestOutput:
        """The end of a request a shutdown cut: 503, retry later (at the next start)."""
        return cls.failure(request_id, SHUTTING_DOWN, "server_shutdown")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
