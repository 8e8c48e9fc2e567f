"""Lockstep ranks: the serving rank decides, every rank runs the same engine step.

Each rank holds its shard of the model and a full ``BatchRunner`` (its own KV
store holding its shard of every cached entry). The serving rank's runner is
wrapped in ``LeaderRunner``: the scheduler drives it as usual, and every call
that changes the batch (a row joining with its prompt, a row leaving, the step
with the prefill slice the step budget chose) is recorded as an ``Op``. Before
each step the ops travel to the other ranks in one ``Tick`` through the
distributed runtime; ``follow`` replays them on each worker's runner, so every
rank runs the same forward passes (whose collectives keep them in step) and its
KV store takes the same decisions under the same entry ids.

What would make the replicas drift is sent, not recomputed: the step budget's
slice (a wall-clock cost model) and the clock the cache index ages entries by.
Two checks catch what still could: each add carries the prompt tokens the
serving rank reused, and each tick the tokens its last step produced; a worker
that disagrees stops the group (it exits non-zero; the serving rank sees the
rank lost) rather than serving wrong text.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import group_wire
from scheduler.contracts import AdapterError, AdapterFiles, AdapterInfo
from scheduler.request import Request, RequestOutput
from scheduler.step_budget import SlicePlan

log = logging.getLogger("kvwarm.lockstep")


class TickClock:
    """The time the KV index ages entries by: set from the serving rank's clock
    before each op, so every rank's eviction and TTL decisions are the same."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Op:
    kind: str  # add | remove | cut_short | step | stop | fail
    at: float  # the serving rank's clock when it ran the op
    request: Request | None = None  # add
    request_id: str = ""  # remove, cut_short
    plan: SlicePlan | None = None  # step
    cached: int | None = None  # add: prompt tokens reused (None: the add failed)
    reason: str = ""  # fail: why the serving rank's engine died


@dataclass(frozen=True)
class Tick:
    ops: tuple[Op, ...]
    tokens: str = ""  # digest of what the serving rank's previous step produced


def encode(tick: Tick) -> bytes:
    return group_wire.dumps(tick)


def decode(data: bytes) -> Tick:
    try:
        tick = group_wire.loads(data)  # only this project's dataclasses: the ring is open
    except Exception as exc:  # noqa: BLE001 - whatever the bytes were, they are no tick
        raise LockstepError(f"not a tick: {type(exc).__name__}: {exc}") from exc
    if not isinstance(tick, Tick):
        raise LockstepError(f"not a tick: {type(tick).__name__}")
    return tick


def token_digest(outputs: list[RequestOutput]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for out in outputs:
        h.update(f"{out.request_id}:{','.join(map(str, out.token_ids))};".encode())
    return h.hexdigest()


class LockstepError(RuntimeError):
    """The ranks no longer run the same engine: the group must restart."""


class LeaderRunner:
    """The serving rank's runner: ``inner`` as the engine loop sees it, with every
    change recorded and sent to the other ranks before the step that needs it."""

    def __init__(
        self,
        inner: Any,
        broadcast: Callable[[bytes], object],
        clock: TickClock,
        on_step: Callable[[bool], None] | None = None,
    ):
        self.inner = inner
        inner.recoverable = False
        inner.defer_disk_reads = False  # every rank starts a row in the same step
        self._broadcast = broadcast
        self._clock = clock
        self._ops: list[Op] = []
        self._tokens = ""
        self._closed = False
        self.broken = False  # a rank was lost: nothing more is sent
        # the serving rank's engine died: the others stop as failed (they exit 1 and a
        # supervisor restarts them with it), not as in an orderly stop (exit 0)
        self.failure: str | None = None
        self._on_step = on_step  # (running): the rank monitor times steps

    # -- what the engine loop and /stats read ---------------------------------
    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _now(self) -> float:
        self._clock.now = time.monotonic()
        return self._clock.now

    # -- recorded changes -------------------------------------------------------
    def add(self, request: Request) -> RequestOutput | None:
        at = self._now()
        cached: int | None = None  # stays None if the add raises: workers must refuse it too
        try:
            first = self.inner.add(request)
            cached = first.cached_tokens if first is not None else 0
            return first
        finally:
            self._ops.append(Op("add", at, request=request, cached=cached))

    def remove(self, request_id: str) -> object:
        self._ops.append(Op("remove", self._now(), request_id=request_id))
        return self.inner.remove(request_id)

    def cut_short(self, request_id: str) -> RequestOutput | None:
        self._ops.append(Op("cut_short", self._now(), request_id=request_id))
        return self.inner.cut_short(request_id)

    def step(self) -> list[RequestOutput]:
        at = self._now()
        plan = self.inner.plan_step()
        if self._on_step:
            self._on_step(True)  # the broadcast is timed too: a hung rank stalls it
        try:
            self._send(Op("step", at, plan=plan))
            outputs = self.inner.step(plan)
        except Exception as exc:
            # every rank ran this step; a fault here is the group's, not a row's
            # (a rank died mid-collective or before the plan's broadcast reached
            # it, or all of them failed alike). Either way no goodbye follows: it
            # would wait on a rank that is gone or leaving too.
            self.broken = True
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise LockstepError(
                "a rank of the distributed group was lost or failed: "
                f"{type(cause).__name__}: {cause}"
            ) from exc
        finally:
            if self._on_step:
                self._on_step(False)
        self._tokens = token_digest(outputs)
        return outputs

    def _send(self, last: Op) -> None:
        ops, self._ops = (*self._ops, last), []
        self._broadcast(encode(Tick(ops, self._tokens)))

    # -- not distributable --------------------------------------------------------
    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> AdapterInfo:
        raise AdapterError("run-time LoRA adapters are not available on a distributed group")

    def unmount_adapter(self, adapter_id: str) -> AdapterInfo:
        raise AdapterError("run-time LoRA adapters are not available on a distributed group")

    def close(self, notify: bool = True) -> None:
        """Tell the other ranks to stop (``notify`` False: the group is broken,
        a broadcast would hang), then close this rank's runner."""
        if not self._closed:
            self._closed = True
            if notify and not self.broken:
                try:
                    if self.failure is not None:
                        self._send(Op("fail", self._now(), reason=self.failure))
                    else:
                        self._send(Op("stop", self._now()))
                except Exception as exc:  # noqa: BLE001 - closing either way
                    log.warning("could not tell the other ranks to stop: %s", exc)
            self.inner.close()


@dataclass
class Follower:
    """A worker rank's side: replay the serving rank's ops on this rank's runner."""

    runner: Any
    receive: Callable[[], bytes]
    clock: TickClock
    ticks: int = 0
    _tokens: str = field(default="", init=False)

    def run(self) -> None:
        """Follow until the serving rank says stop; LockstepError if the ranks drift."""
        self.runner.recoverable = False
        self.runner.defer_disk_reads = False
        while True:
            tick = decode(self.receive())
            self.ticks += 1
            if tick.tokens != self._tokens:
                raise LockstepError(
                    "this rank's last step produced other tokens than the serving rank's "
                    f"({self._tokens} vs {tick.tokens})"
                )
            for op in tick.ops:
                self.clock.now = op.at
                if op.kind == "stop":
                    return
                if op.kind == "fail":
                    raise LockstepError(f"the serving rank's engine failed: {op.reason}")
                self._apply(op)

    def _apply(self, op: Op) -> None:
        runner = self.runner
        if op.kind == "add":
            assert op.request is not None
            try:
                first = runner.add(op.request)
            except Exception as exc:  # noqa: BLE001 - the serving rank failed it too
                if op.cached is not None:
                    raise LockstepError(
                        f"{op.request.request_id} joined on the serving rank but not here: {exc}"
                    ) from exc
                return
            if op.cached is None:
                raise LockstepError(
                    f"{op.request.request_id} failed to join on the serving rank but joined here"
                )
            cached = first.cached_tokens if first is not None else 0
            if op.cached != cached:
                raise LockstepError(
                    f"{op.request.request_id}: the prefix caches disagree (serving rank "
                    f"reused {op.cached} tokens, this rank {cached})"
                )
        elif op.kind == "remove":
            runner.remove(op.request_id)
        elif op.kind == "cut_short":
            runner.cut_short(op.request_id)
        elif op.kind == "step":
            self._tokens = token_digest(runner.step(op.plan))
        else:
            raise LockstepError(f"unknown op {op.kind!r}")
