"""A model-free engine for HTTP-contract tests: same scheduler, same streams,
tokens are words "w0 w1 ..." produced at a controlled pace."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcache.prompt_key import PromptKey, RenderedPrompt
from scheduler.admission import AdmissionController, MemoryBudget
from scheduler.contracts import EngineStats, ModelInfo
from scheduler.request import FinishReason, Request, RequestOutput, RequestStats
from scheduler.scheduler import Scheduler
from scheduler.streams import OutputRouter


class CharFormatter:
    """One token per character of the rendered transcript; remembers what the
    last render was given, so tests can check what the template would see."""

    def __init__(self) -> None:
        self.last_messages: list[dict[str, Any]] = []
        self.last_kwargs: dict[str, Any] = {}

    def render_chat(
        self, messages: Sequence[dict[str, Any]], relocate_volatile: bool = False, **kwargs: Any
    ) -> RenderedPrompt:
        self.last_messages, self.last_kwargs = [dict(m) for m in messages], kwargs
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages) + "<assistant>"
        return RenderedPrompt(PromptKey.build(self.encode(text)), tail=text[-64:])

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def check_length(self, text: str) -> None:
        pass  # one token per character: the context check after rendering is exact

    encode_prompt = encode


def prompt_text(req: Request) -> str:
    return "".join(map(chr, req.prompt_tokens))


# Replies the engine should produce for a request instead of "w0 w1 ...": one
# piece of text per step, then EOS. None: the default word stream.
Script = Callable[[Request], Sequence[str] | None]


class FakeEngine(threading.Thread):
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
    ):
        super().__init__(daemon=True, name="fake-engine")
        self.scheduler = scheduler
        self.router = router
        self.step_delay = step_delay
        self.eos_after = eos_after
        self.script = script
        self.on_fatal = on_fatal  # as EngineThread: the process should exit non-zero
        budget = MemoryBudget(
            total_bytes=1000 + 500 + kv_budget_tokens * 10,
            weights_bytes=1000,
            reserve_bytes=500,
            kv_bytes_per_token=10,
        )
        self.info = ModelInfo(
            model_id="fake-model",
            path="/fake",
            context_length=context_length,
            budget=budget,
            formatter=CharFormatter(),
            vocab_size=256,
        )
        scheduler.admission = AdmissionController(budget, context_length)
        self._active: dict[str, list] = {}
        self._halt = threading.Event()
        self._failure: str | None = None
        self._fault: BaseException | None = None
        self.steps = 0

    ready = property(lambda self: self.alive)
    alive = property(lambda self: self._failure is None and not self._halt.is_set())
    failure = property(lambda self: self._failure)
    model_info = property(lambda self: self.info)

    def engine_stats(self) -> EngineStats:
        return EngineStats(self.steps, len(self._active), 0, 0)

    def inject_fault(self, exc: BaseException) -> None:
        self._fault = exc
        self.scheduler.wake()

    def stop(self) -> None:
        self._halt.set()
        self.scheduler.wake()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if self._fault is not None:
                    raise self._fault
                plan = self.scheduler.schedule()
                ended = []
                for rid in (*plan.abort, *plan.shutdown):
                    self._active.pop(rid, None)
                for rid in plan.timed_out:  # as the real engine: cut short, not failed
                    entry = self._active.pop(rid, None)
                    n = entry[1] if entry else 0
                    ended.append(
                        RequestOutput(
                            rid,
                            finish_reason=FinishReason.LENGTH,
                            completion_tokens=n,
                            timed_out=True,
                        )
                    )
                ended += [
                    RequestOutput.failure(r, "waited past --request-timeout", "queue_timeout")
                    for r in plan.expired
                ]
                ended += [
                    RequestOutput.failure(r, "the server is shutting down", "server_shutdown")
                    for r in plan.shutdown
                ]
                self.router.publish(ended)
                for req in plan.admit:
                    pieces = self.script(req) if self.script else None
                    self._active[req.request_id] = [req, 0, pieces, time.monotonic()]
                if not self._active:
                    self.scheduler.wait_for_work(0.05)
                    continue
                outputs = []
                for rid, entry in list(self._active.items()):
                    req, n, pieces, joined = entry
                    entry[1] = n = n + 1
                    finish = None
                    eos = self.eos_after is not None and n >= self.eos_after and not req.ignore_eos
                    if (n >= len(pieces)) if pieces else eos:
                        finish = FinishReason.STOP
                    elif n >= req.max_tokens:
                        finish = FinishReason.LENGTH
                    text = pieces[n - 1] if pieces else f"w{n - 1} "
                    stats = None
                    if finish is not None:
                        now = time.monotonic()
                        waited = joined - req.arrival_time
                        stats = RequestStats(
                            waited, self.step_delay, max(0.0, now - joined - self.step_delay)
                        )
                    outputs.append(
                        RequestOutput(
                            rid, text, (n,), finish, len(req.prompt_tokens), n, stats=stats
                        )
                    )
                    if finish:
                        del self._active[rid]
                        self.scheduler.finish(rid)
                self.steps += 1
                self.router.publish(outputs)
                time.sleep(self.step_delay)
        except BaseException as exc:  # noqa: BLE001
            self._failure = f"engine step failed: {exc}"
            dropped = self.scheduler.fail_all(self._failure)
            self.router.publish(RequestOutput.failure(r.request_id, self._failure) for r in dropped)
            if self.on_fatal is not None:
                self.on_fatal(self._failure)
