"""A model-free engine for HTTP-contract tests: same scheduler, same streams,
tokens are words "w0 w1 ..." produced at a controlled pace."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine.engine_thread import Booted, EngineConfig, EngineThread
from kvcache.layout import GROWTH_SLACK
from kvcache.prompt_key import PromptKey, RenderedPrompt
from scheduler.admission import AdmissionController, MemoryBudget
from scheduler.contracts import (
    AdapterExists,
    AdapterFiles,
    AdapterInfo,
    AdapterInUse,
    AdapterNotFound,
    ModelInfo,
)
from scheduler.request import (
    CacheReport,
    FinishReason,
    Request,
    RequestOutput,
    RequestStats,
    TokenChoice,
    TokenLogprob,
)
from scheduler.scheduler import Scheduler
from scheduler.step_timings import StepTimings
from scheduler.streams import OutputRouter


class CharFormatter:
    """One token per character of the rendered transcript; remembers what the
    last render was given, so tests can check what the template would see."""

    def __init__(self) -> None:
        self.last_messages: list[dict[str, Any]] = []
        self.last_kwargs: dict[str, Any] = {}

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        relocate_volatile: bool = False,
        count_only: bool = False,
        image_placeholder: str | None = None,
        **kwargs: Any,
    ) -> RenderedPrompt:
        self.last_messages, self.last_kwargs = [dict(m) for m in messages], kwargs
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages) + "<assistant>"
        return RenderedPrompt(PromptKey.build(self.encode(text)), tail=text[-64:])

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def continued(self, rendered: RenderedPrompt, text: str) -> PromptKey:
        return rendered.key.extended(self.encode(text))  # one token per character: no seam

    def check_length(self, text: str) -> None:
        pass  # one token per character: the context check after rendering is exact

    def check_texts(self, texts: Sequence[str], count_only: bool = False) -> None:
        pass

    encode_prompt = encode

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))


def prompt_text(req: Request) -> str:
    return "".join(map(chr, req.prompt_tokens))


# Replies the engine should produce for a request instead of "w0 w1 ...": one
# piece of text per step, then EOS. None: the default word stream.
Script = Callable[[Request], Sequence[str] | None]


class FakeRunner:
    """A model-free Runner: each step every row gets its next word (or scripted
    piece), so the real engine loop, scheduler and streams run unchanged."""

    def __init__(
        self, scheduler: Scheduler, step_delay: float, eos_after: int | None, script: Script | None
    ):
        self.scheduler = scheduler
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.script = script
        self.prefix_cache = None
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.batch_sizes = [0] * 9
        self.row_faults = 0
        self.recoveries = 0
        self.progress: Callable[[], None] = lambda: None
        self.timings = StepTimings()
        self.waited_on_reads = False
        self._active: dict[str, list] = {}
        self.adapters: dict[str, AdapterInfo] = {}

    @property
    def active(self) -> int:
        return len(self._active)

    # adapters: any directory with an adapter_config.json "fits"; rows of an
    # adapter write "<id>-w0 <id>-w1 ..." so tests see which adapter ran
    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> AdapterInfo:
        if adapter_id in self.adapters:
            raise AdapterExists(f"an adapter {adapter_id!r} is already mounted")
        rank = files.config["lora_parameters"]["rank"]
        info = AdapterInfo(
            adapter_id, str(files.path), rank, scale, 20.0, "lora", 4096, 4, files.fingerprint, 1
        )
        self.adapters[adapter_id] = info
        return info

    def unmount_adapter(self, adapter_id: str) -> AdapterInfo:
        if adapter_id not in self.adapters:
            raise AdapterNotFound(adapter_id)
        if any(entry[0].adapter == adapter_id for entry in self._active.values()):
            raise AdapterInUse(f"adapter {adapter_id!r} is in use")
        return self.adapters.pop(adapter_id)

    def adapter_infos(self) -> list[AdapterInfo]:
        return list(self.adapters.values())

    def adapter_bytes(self) -> int:
        return sum(a.size_bytes for a in self.adapters.values())

    def add(self, request: Request) -> RequestOutput | None:
        if request.adapter is not None and request.adapter not in self.adapters:
            raise AdapterNotFound(request.adapter)
        pieces = self.script(request) if self.script else None
        report = CacheReport(tier="none" if request.cache is not None else "disabled")
        self._active[request.request_id] = [request, 0, pieces, time.monotonic(), report]
        return RequestOutput(
            request.request_id, prompt_tokens=len(request.prompt_tokens), cache=report
        )

    def remove(self, request_id: str) -> object:
        return self._active.pop(request_id, None)

    def cut_short(self, request_id: str) -> RequestOutput | None:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return None
        req, _, _, joined, report = entry
        now = time.monotonic()  # the real runner's cut carries its timings too
        return RequestOutput(
            request_id,
            finish_reason=FinishReason.LENGTH,
            completion_tokens=entry[1],
            timed_out=True,
            stats=RequestStats(joined - req.arrival_time, 0.0, now - joined, report),
        )

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = []
        for rid, entry in list(self._active.items()):
            req, n, pieces, joined, report = entry
            entry[1] = n = n + 1
            finish = None
            eos = self.eos_after is not None and n >= self.eos_after and not req.ignore_eos
            if (n >= len(pieces)) if pieces else eos:
                finish = FinishReason.STOP
            elif n >= req.max_tokens:
                finish = FinishReason.LENGTH
            word = f"{req.adapter}-w{n - 1} " if req.adapter else f"w{n - 1} "
            text = pieces[n - 1] if pieces else word
            # a stop string inside this step's text ends the reply before it
            hit = min(((text.find(s), s) for s in req.stop if s in text), default=None)
            stop_sequence = None
            if hit is not None:
                text, finish, stop_sequence = text[: hit[0]], FinishReason.STOP, hit[1]
            stats = None
            if finish is not None:
                now = time.monotonic()
                waited = joined - req.arrival_time
                stats = RequestStats(
                    waited, self.step_delay, max(0.0, now - joined - self.step_delay), report
                )
            out = RequestOutput(
                rid,
                text,
                (n,),
                finish,
                len(req.prompt_tokens),
                n,
                stats=stats,
                stop_sequence=stop_sequence,
            )
            if n == 1:  # as the real runner: from when the client's wait began
                out.ttft = time.monotonic() - req.started_at
            if req.logprobs is not None:  # the chosen token first, then made-up alternatives
                chosen = TokenChoice(n, -0.25, text.encode())
                alts = [TokenChoice(10_000 + i, -1.0 - i, f"alt{i}".encode()) for i in range(20)]
                out.logprobs = (TokenLogprob(chosen, tuple([chosen, *alts][: req.logprobs])),)
            outputs.append(out)
            if finish:
                del self._active[rid]
        self.generated_tokens += len(outputs)
        self.batch_sizes[min(len(outputs), 8)] += 1
        time.sleep(self.step_delay)
        self.timings.record(time.perf_counter() - started, 0, 0, False)
        return outputs

    def close(self) -> None:
        self._active.clear()


class FakeEngine(EngineThread):
    """The real engine loop (plan exits, faults, shutdown, engine death) over a
    FakeRunner: HTTP-contract tests without a model."""

    def __init__(
        self,
        scheduler: Scheduler,
        router: OutputRouter,
        context_length: int = 2048,
        kv_budget_tokens: int = 4096,
        step_delay: float = 0.005,
        eos_after: int | None = None,
        script: Script | None = None,
        on_fatal: Callable[[str], None] | None = None,
        adapters: tuple[tuple[str, Path], ...] = (),
        ranks: object = None,
        on_load_failure: Callable[[str, bool], None] | None = None,
        model_id: str = "fake-model",
    ):
        budget = MemoryBudget(
            # one request of kv_budget_tokens (a 256 multiple) fits, with the part of a
            # step a cache grown off the 256 grid may hold past it
            total_bytes=1000 + 500 + (kv_budget_tokens + GROWTH_SLACK) * 10,
            weights_bytes=1000,
            reserve_bytes=500,
            kv_bytes_per_token=10,
        )
        info = ModelInfo(
            model_id=model_id,
            path="/fake",
            context_length=context_length,
            budget=budget,
            formatter=CharFormatter(),
            vocab_size=256,
        )
        self.fake = FakeRunner(scheduler, step_delay, eos_after, script)

        def boot(_config: EngineConfig) -> Booted:
            return Booted(self.fake, info, AdmissionController(budget, context_length), ranks=ranks)

        super().__init__(
            EngineConfig(source=None, adapters=adapters),  # type: ignore[arg-type]  # no model
            scheduler,
            router,
            on_load_failure=on_load_failure,
            on_fatal=on_fatal,
            boot=boot,
        )
        # handlers may submit before the thread runs: admission exists from the start
        scheduler.admission = AdmissionController(budget, context_length)
        self._model_info = info

    @property
    def info(self) -> ModelInfo:
        assert self._model_info is not None
        return self._model_info

    @info.setter
    def info(self, value: ModelInfo) -> None:
        self._model_info = value
