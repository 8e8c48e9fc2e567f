"""Typed boundaries between the HTTP layer, the scheduler and the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvcache.interface import KVCacheManager
from kvcache.prompt_key import PromptKey, RenderedPrompt
from kvcache.stats import KVCacheStats
from scheduler.admission import MemoryBudget
from scheduler.request import ImageInput, Request, RequestOutput
from scheduler.step_timings import StepReport, StepTimings

T = TypeVar("T")


class PromptFormatter(Protocol):
    """Turns chat messages into the model tokens plus their cache-key view."""

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        relocate_volatile: bool = False,
        count_only: bool = False,
        image_placeholder: str | None = None,
        **template_kwargs: Any,
    ) -> RenderedPrompt:
        """``count_only``: the tokens are counted, not generated from, so a prompt
        over the context is tokenised whole rather than refused early.
        ``image_placeholder``: lines holding it are never relocated."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def continued(self, rendered: RenderedPrompt, text: str) -> PromptKey:
        """The rendered prompt with ``text`` appended (a prefill, a forced call's
        opening), tokenised across the seam as the whole text would be."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt, with the special tokens (BOS) the model expects."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids' text, special tokens included (a completion prompt's echo)."""
        ...

    def check_length(self, text: str) -> None:
        """Raise ContextLengthExceeded if no tokenisation of ``text`` fits the context."""
        ...

    def check_texts(self, texts: Sequence[str], count_only: bool = False) -> None:
        """Raise ContextLengthExceeded if the messages' ``texts`` together cannot fit,
        before anything scans them (``count_only``: a count, answered over the context)."""
        ...


class ImageRejected(ValueError):
    """The model's processor cannot turn this image into tokens (an extreme aspect
    ratio, a side too thin to resize): the client's image, so a 400, never a 500."""


class ImageFront(Protocol):
    """A vision model's processor as request preparation uses it (worker threads)."""

    placeholder: str  # the text the chat template gets where an image goes
    image_token: str  # the token in it that the processor widens to the image
    markers: tuple[str, ...]  # the tokens the placeholder is made of (image_token among them)
    placeholder_id: int  # that token's id

    def image_input(self, image: Any, digest: bytes, start: int) -> ImageInput:
        """The image's tokens and pixel inputs, placed at prompt position ``start``;
        ``ImageRejected`` when the processor cannot make them."""
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
    # the template accepts only 9-alphanumeric tool-call ids (Mistral v0.3/Nemo)
    short_call_ids: bool = False


class AdapterError(ValueError):
    """An adapter that cannot be mounted, or a request naming none: the client's (400)."""


class AdapterNotFound(KeyError):
    """No adapter is mounted under that id (404)."""

    def __str__(self) -> str:
        return f"no adapter {self.args[0]!r} is mounted"


class AdapterInUse(RuntimeError):
    """Queued or running requests use the adapter (409): unmounting it under them
    would change their model mid-reply."""


class AdapterExists(AdapterError):
    """An adapter is already mounted under that id (409)."""


class AdapterTooLarge(AdapterError):
    """Mounting it would leave no KV budget for any request."""


class AdapterFormatError(AdapterError):
    """Its files were read and are no adapter a mount takes (a config or weights
    header it refuses): reading them again reads the same, so at start it is lasting.
    Failing to read them (a mount not up yet, EIO) is a plain AdapterError."""


class AdapterNoRoomNow(AdapterError):
    """It fits once the running or queued requests' KV is released: retry then."""


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter directory read and checked off the engine thread
    (engine.adapter_files): what the engine is handed to mount."""

    path: Path
    config: dict[str, Any]  # adapter_config.json, checked
    weights_file: Path
    fingerprint: str  # of config + weights: cached KV is keyed by content, not by path
    # the weights' bytes exactly as hashed: the engine loads these, never the file
    # again (rewritten since with its old size and mtime, its KV was stored under
    # the old fingerprint and served to the real adapter after a restart)
    weights: bytes = field(repr=False)

    @property
    def weights_size(self) -> int:
        return len(self.weights)


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA/DoRA adapter mounted into the running model (GET /v1/adapters)."""

    id: str
    path: str
    rank: int
    scale: float  # the mount's multiplier on the adapter's own lora_parameters.scale
    lora_scale: float  # adapter_config.json's lora_parameters.scale
    fine_tune_type: str  # lora / dora
    size_bytes: int
    mounted_layers: int
    fingerprint: str  # of its files: cached KV is keyed by content, not by path
    slot: int  # its row-routing slot in the engine

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "adapter",
            "path": self.path,
            "rank": self.rank,
            "scale": self.scale,
            "lora_scale": self.lora_scale,
            "fine_tune_type": self.fine_tune_type,
            "size_bytes": self.size_bytes,
            "mounted_layers": self.mounted_layers,
            "fingerprint": self.fingerprint,
        }


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
    # memory bandwidth as decode sees it, measured once at start (engine.device_memory)
    bandwidth_bytes_s: float = 0.0
    vision: ImageFront | None = None  # None: a text-only model
    # the file the model came from when ``path`` is what was made of it (a GGUF's
    # conversion, float32 on the CPU backend); "" when it is ``path`` itself
    source_path: str = ""
    # linear layers a run-time adapter can target: bounds an adapter file's tensor
    # count before the engine loads it (engine.adapter_files.tensor_cap); 0: not known
    adapter_layers: int = 0


@dataclass(frozen=True)
class VisionStats:
    """What the vision tower did (engine.vision), for /stats and /metrics."""

    encoder_runs: int = 0  # images run through the tower
    encoder_seconds: float = 0.0
    feature_hits: int = 0  # re-sent images whose features were reused (the tower skipped)
    images_prefilled: int = 0  # images whose tokens went through the language model


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
    recoveries: int = 0  # step faults no row owned (each rebuilt the batch)
    steps_report: StepReport | None = None  # step times, prefill slices, the cost model
    vision: VisionStats | None = None  # None: a text model


@dataclass
class StepPlan:
    """What the engine must change in its batch before the next step."""

    admit: list[Request] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)  # the client left: just drop them
    # past --request-timeout while running: end as if max_tokens was hit
    timed_out: list[str] = field(default_factory=list)
    # past --request-timeout before they ever ran: refused (retry later)
    expired: list[str] = field(default_factory=list)
    # the server is shutting down and they did not finish in time
    shutdown: list[str] = field(default_factory=list)
    # queued, then the budget shrank (an adapter mounted) below what they need even
    # alone: refused (request id, why) rather than holding the FIFO queue forever
    over_budget: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.admit
            or self.abort
            or self.timed_out
            or self.expired
            or self.shutdown
            or self.over_budget
        )


class Runner(Protocol):
    """What the engine loop drives each step (engine.batch_runner.BatchRunner;
    tests hand in a model-free one that runs under the same loop)."""

    prefix_cache: KVCacheManager | None
    prefill_tokens: int  # prompt tokens run through the model so far
    generated_tokens: int
    batch_sizes: list[int]  # decode steps by rows decoding together (index = rows)
    row_faults: int
    recoveries: int
    timings: StepTimings  # what each step took, and the step budget that sized it
    waited_on_reads: bool  # the last step() only waited on disk reads (not a step)
    # set by the engine loop, called as one long step moves on (a recovery's probes
    # and replays): the step is progressing, not hung (--stall-timeout)
    progress: Callable[[], None]

    @property
    def active(self) -> int:
        """Rows in the batch (prefilling or decoding)."""
        ...

    def add(self, request: Request) -> RequestOutput | None:
        """Join the batch (its prefix-cache lookup happens here); may raise for
        this request alone. Returns a first, token-less output carrying what the
        cache did (or None)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One step: a prefill slice for joiners, one token for each decoding row."""
        ...

    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> AdapterInfo:
        """Mount a LoRA adapter (AdapterError: refused, nothing changed)."""
        ...

    def unmount_adapter(self, adapter_id: str) -> AdapterInfo:
        """Unmount (AdapterNotFound; AdapterInUse while its rows run)."""
        ...

    def adapter_infos(self) -> list[AdapterInfo]: ...

    def adapter_bytes(self) -> int:
        """Weights of the mounted adapters (admission counts them)."""
        ...

    def remove(self, request_id: str) -> object:
        """Leave the batch now (client gone); its KV is not kept."""
        ...

    def cut_short(self, request_id: str) -> RequestOutput | None:
        """End as if max_tokens was hit (the watchdog): what it generated is delivered."""
        ...

    def close(self) -> None: ...


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

    @property
    def busy_since(self) -> float | None:
        """When the engine step or control job in progress began (time.monotonic);
        None while idle. Read without a lock: a step that never ends shows here."""
        ...

    def engine_stats(self) -> EngineStats: ...

    def kv(self, op: Callable[[KVCacheManager], T]) -> Future[T]:
        """Run ``op`` on the KV manager on the engine thread, between two steps."""
        ...

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The mounted adapters (a snapshot; any thread may read it)."""
        ...

    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> Future[AdapterInfo]: ...

    def unmount_adapter(self, adapter_id: str) -> Future[AdapterInfo]: ...
