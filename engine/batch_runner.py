"""Continuous batching on mlx-lm's BatchGenerator.

Why BatchGenerator rather than our own loop over BatchKVCache: it already does
what a continuous batch needs and is maintained with the model classes: rows
join between decode steps (prompt batch -> generation batch), finished rows
leave without disturbing the others (``filter``), prompts are prefilled in
``prefill_step_size`` chunks interleaved with decode steps, each row takes its
own sampler / logits processors / stop tokens, and per-sequence prompt caches go
in (``insert(caches=...)``) and out (``extract_cache``), which is what prefix
reuse builds on. What it lacks, and this module adds, is the request view:
text deltas, stop *strings*, aborts, per-request bookkeeping, and fault
isolation: a row whose sampler, logits processor, detokeniser or cache raises
fails alone while the step goes on for the others (``engine.row_faults``); a
step that raises without saying whose fault it was rebuilds the batch and
replays its rows, and if the fault comes back then, tries each alone first, so
only the faulty ones fail.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from engine import row_kv
from engine.adapters import AdapterSet
from engine.batch_rows import Row, Waiting
from engine.fast_detok import detokenizer_factory
from engine.lora import AdapterTag
from engine.mrope import positioned
from engine.penalties import OutputPenalties
from engine.row_faults import FaultLedger, GuardedProcessor
from engine.sampling import SamplerFactory, rewind
from engine.text_output import TextOutput
from engine.token_logprobs import Asked, token_logprobs, token_pieces
from engine.vision import VisionPrefill
from kvcache.manager import TieredKVManager
from kvcache.payloads import plain_kv_only
from scheduler.contracts import AdapterFiles, AdapterInfo, AdapterInUse
from scheduler.cost_model import StepShape, padded_depth
from scheduler.request import CacheReport, FinishReason, Request, RequestOutput
from scheduler.step_budget import SlicePlan, StepBudget
from scheduler.step_timings import StepTimings

log = logging.getLogger("kvwarm.engine")
# rebuilds of the batch for one step fault nobody owned before the engine gives up
# (the first replays every row, the next ones try rows alone first): a fault that
# keeps coming back with every row replayed or tried alone is not a row's
MAX_RECOVERIES = 3
READ_WAIT_S = 0.05  # an idle step's wait for a disk-tier hit's read


class EngineFault(RuntimeError):
    """A fault that is no row's: the engine cannot go on."""


class BatchRunner:
    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int,
        prefill_step_size: int,
        prefill_batch: int,
        prefix_cache: TieredKVManager | None = None,
        max_step_s: float = 0.0,
        vision: VisionPrefill | None = None,
    ):
        self.model = model
        self.vision = vision  # a vision model's image prefill (engine.vision)
        if vision is not None:
            vision.chunk = prefill_step_size
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self._detokenizer = detokenizer_factory(tokenizer)
        self._pieces = token_pieces(tokenizer)
        self._logprob_stream = mx.new_stream(mx.cpu)  # see engine.token_logprobs
        self._asked: list[tuple[RequestOutput, Asked]] = []  # this step's rows asking
        # a step fault nobody owned is recovered from by re-running rows alone; a
        # sharded model cannot (the other ranks would have to probe the same rows)
        self.recoverable = True
        # called as a recovery moves on (each row probed, each replayed): the engine
        # thread's note that its step still progresses, not a hung one (--stall-timeout)
        self.progress: Callable[[], None] = lambda: None
        # whether every layer can be cut back to any depth (sliding windows and
        # recurrent states cannot once filled): entries then hit only whole
        self._trimmable = plain_kv_only(make_prompt_cache(model))
        # prompt tokens one step may prefill, shared by all rows joining at once
        self.prefill_budget = prefill_step_size
        self._max_batch = max_batch
        self._prefill_rows = min(prefill_batch, max_batch)
        # each step's prefill slice: within --max-step-ms by a learned cost model
        self.budget = StepBudget(max_step_s, prefill_step_size, self._prefill_rows)
        self.timings = StepTimings(self.budget)
        self._waiting: dict[str, Waiting] = {}  # admitted, prefill not started
        # a disk-tier hit is read off this thread, its row waiting meanwhile (a
        # distributed group's ranks must start rows in the same step: they read inline)
        self.defer_disk_reads = True
        self._last_prefilled = False  # the step before prefilled (see _observe)
        self.faults = FaultLedger()
        # LoRA adapters mounted at run time; the generator runs the routed model
        self.adapters = AdapterSet(model)
        self._samplers = SamplerFactory(vocab_size=len(tokenizer), ledger=self.faults)
        self._eos = [[t] for t in sorted(tokenizer.eos_token_ids)]
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        self._generator = self._new_generator(max_batch, self._prefill_rows)
        self._no_stop = StopSequences()
        self._rows: dict[int, Row] = {}
        self._uids: dict[str, int] = {}
        self._prefilled: dict[int, int] = {}  # uid -> prompt tokens processed so far
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.last_step_prefill = 0
        self.row_faults = 0  # rows failed alone (a fault of their own)
        self.recoveries = 0  # step faults nobody owned that rebuilt the batch
        self._recovering = 0  # rebuilds since the batch last decoded as a whole
        # rows the last recovery re-admitted -> the tokens each must reach before the
        # batch counts as decoding again (their prefills alone prove nothing)
        self._readmitted: dict[int, int] = {}
        # decode steps by rows decoding together: index = batch size
        self.batch_sizes = [0] * (max_batch + 1)
        # the last step() only waited on disk-tier reads: no model step ran, and the
        # engine loop does not count it (it counted ~20 a second while reads ran)
        self.waited_on_reads = False

    def _new_generator(self, rows: int, prefill_rows: int) -> BatchGenerator:
        return BatchGenerator(
            self.adapters.routed,
            stop_tokens=self._eos,
            completion_batch_size=rows,
            prefill_batch_size=prefill_rows,
            prefill_step_size=self.prefill_budget,
        )

    @property
    def active(self) -> int:
        return len(self._rows) + len(self._waiting)

    def row(self, request_id: str) -> Row | None:
        """A request's row, prefilling, decoding or still waiting to start."""
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            return waiting.row
        uid = self._uids.get(request_id)
        return self._rows.get(uid) if uid is not None else None

    def add(self, request: Request) -> RequestOutput | None:
        """Admit a request; its first output says what the cache did (None: its
        disk-tier hit is being read, and a later step's outputs say it)."""
        params = request.sampling
        rid = request.request_id
        slot = self.adapters.slot(request.adapter)  # AdapterNotFound: unmounted meanwhile
        if request.cache is not None:  # its KV lives in its adapter's namespace
            request.cache = replace(request.cache, adapter=self.adapters.namespace(request.adapter))
        made = self._samplers.logits_processors(
            params, len(request.prompt_tokens), request.logprobs is not None
        )
        processors = [GuardedProcessor(p, rid, self.faults) for p in made]
        row = Row(
            request,
            TextOutput(
                self._detokenizer(), request.stop, request.trim_leading_space, request.reasoning
            ),
            self._samplers.sampler(params),
            processors,
            slot=slot,
        )
        prompt = request.prompt_tokens
        if request.images:
            if self.vision is None:
                raise ValueError("images sent to a text model")  # the HTTP layer refuses these
            self.vision.remember(request.images)
        cache, reused = None, None
        hints = request.cache if self.prefix_cache is not None else None
        try:
            if hints is not None:
                cache, reused = row_kv.start_from_cache(
                    self.prefix_cache, row, self.defer_disk_reads
                )
            if row.disk_read is not None:  # started once read (``_finish_reads``)
                if not prompt or request.max_tokens <= 0:
                    raise ValueError("nothing to generate: an empty prompt or max_tokens <= 0")
                self._waiting[request.request_id] = Waiting(row, [], None, None)
                return None
            waiting = self._prepared(row, cache, reused)
        except Exception:
            self._release(row)  # a hit's entry stayed held for ever: never evicted again
            raise
        # prefill starts when the step budget has room for it (``step``)
        self._waiting[request.request_id] = waiting
        if hints is None:
            row.report = CacheReport(tier="disabled")
        return self._first_output(row)

    def _prepared(self, row: Row, cache, reused) -> Waiting:
        """The row ready to start from ``cache`` (KV of ``reused``; None: cold)."""
        request = row.request
        cached_tokens = None
        if reused is not None:
            self._know_images(row)
            cached_tokens = self._model_ids(reused)
            if self.vision is not None:
                row.rope_delta = self.vision.rope_delta(reused)
        rest = request.prompt_tokens[row.cached :]
        if not rest or request.max_tokens - row.generated <= 0:
            raise ValueError("nothing to generate: an empty prompt or max_tokens <= 0")
        segments = self._segments(row, rest, row.cached)
        return Waiting(row, segments, cache, cached_tokens)

    def _first_output(self, row: Row) -> RequestOutput:
        """What the cache did, before any token: the HTTP layer's X-Conv-* headers."""
        return RequestOutput(
            row.request.request_id,
            prompt_tokens=len(row.request.prompt_tokens),
            cached_tokens=row.cached,
            cache=row.report,
        )

    def _finish_reads(self) -> list[RequestOutput]:
        """Rows whose disk-tier hit has been read: their KV becomes MLX arrays here
        and they wait for the step plan like any row (a failed read: a cold start)."""
        outputs: list[RequestOutput] = []
        for request_id, w in list(self._waiting.items()):
            row = w.row
            if row.disk_read is None or not row.disk_read.done:
                continue
            try:
                cache, reused = row_kv.finish_from_cache(self.prefix_cache, row)
                self._waiting[request_id] = self._prepared(row, cache, reused)
            except Exception as exc:  # noqa: BLE001 - this row's own
                del self._waiting[request_id]
                self._release(row)
                self.row_faults += 1
                log.error("%s: could not start from its cached KV: %s", request_id, exc)
                outputs.append(row.failure(time.monotonic(), f"{type(exc).__name__}: {exc}"))
                continue
            outputs.append(self._first_output(row))
        return outputs

    def _only_reading(self) -> bool:
        """Nothing to run but rows whose disk reads are in flight."""
        return not self._rows and all(w.row.disk_read for w in self._waiting.values())

    def _know_images(self, row: Row) -> None:
        """The row's images known again before its key is read back to model ids:
        the engine keeps the expansions of the 4096 images admitted last, and a
        row waiting on a disk read, or decoding a long reply, may outlive its own."""
        if row.request.images and self.vision is not None:
            self.vision.remember(row.request.images)

    def _model_ids(self, tokens) -> list[int]:
        """A cached key's tokens as the model's ids (image identities expanded)."""
        return self.vision.model_ids(tokens) if self.vision is not None else list(tokens)

    def _vision_prefill(self, w: Waiting, budget: int) -> bool:
        """Run the row's prompt through its next uncached image (engine.vision), at
        most one image a step and ``budget`` tokens of it and the text before it
        (this step's prefill slice; a large image's tokens span steps, its tower
        runs once), so that neither many images, a long history before one nor one
        image's thousands of tokens stall the running rows; True once past its last
        image: it then joins the batch like a prefix hit, with the text after it."""
        row, request = w.row, w.row.request
        start = w.vision_at if w.vision_at is not None else row.cached
        if self.vision is None or all(i.end <= start for i in request.images):
            return True
        cache = list(w.cache) if w.cache is not None else make_prompt_cache(self.model)
        skew = row.kv_offset - start  # KV positions stepped over (volatile spans)
        done, delta = self._read_images(
            row,
            cache,
            start,
            row.rope_delta + skew,
            max_images=1,
            max_tokens=budget,
            resume=w.vision_at is not None,
            owner=request.request_id,  # its image's features kept until its last slice
        )
        row.rope_delta = delta - skew
        gained = done - start
        rest = request.prompt_tokens[done:]
        w.vision_at = done
        w.cache = cache
        w.cached_tokens = (w.cached_tokens or []) + list(request.prompt_tokens[start:done])
        row.kv_offset += gained
        w.segments = self._segments(row, rest, done)  # checkpoints after its images
        self.prefill_tokens += gained
        return all(i.end <= done for i in request.images)

    def _read_images(
        self,
        row: Row,
        cache: list,
        start: int,
        delta: int,
        max_images: int | None = None,
        max_tokens: int | None = None,
        resume: bool = False,
        owner: str | None = None,
    ) -> tuple[int, int]:
        """The row's prompt from ``start`` through its images into ``cache``
        (engine.vision), through the routed model with the row's adapter tag, as
        the generator runs the rest of its prompt."""
        assert self.vision is not None
        request = row.request
        return self.vision.run(
            request.prompt_tokens,
            request.images,
            start,
            cache,
            delta,
            max_images=max_images,
            model=self.adapters.routed,
            tag=AdapterTag(row.slot),
            max_tokens=max_tokens,
            resume=resume,
            owner=owner,
        )

    def _insert(self, row: Row, segments, cache, cached_tokens, generator=None) -> int:
        request = row.request
        # the generator's token context: what the cache holds, then these segments;
        # the row's generated tokens (replayed after a recovery) are its last ones
        context = len(cached_tokens or ()) + sum(len(s) for s in segments)
        for processor in row.processors:
            inner = getattr(processor, "inner", processor)
            if isinstance(inner, OutputPenalties):
                inner.rebase(context - row.generated)
        # the row's caches end with its adapter tag: it follows the row through the batch
        kv = list(cache) if cache is not None else make_prompt_cache(self.model)
        if self.vision is not None and self.vision.merge is not None:
            kv = positioned(kv, row.rope_delta)
        (uid,) = (generator or self._generator).insert_segments(
            [segments],
            max_tokens=[request.max_tokens - row.generated],
            caches=[[*kv, AdapterTag(row.slot)]],
            all_tokens=[cached_tokens] if cached_tokens is not None else None,
            samplers=[row.sampler],
            logits_processors=[row.processors],
            stop_sequences=[self._no_stop] if request.ignore_eos else None,
        )
        if generator is None:
            self._rows[uid] = row
            self._uids[request.request_id] = uid
        return uid

    def remove(self, request_id: str) -> Row | None:
        """Take a request out of the batch (client gone, watchdog); its KV is not kept."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            self._release(waiting.row)
            return waiting.row
        uid = self._uids.get(request_id)
        if uid is None:
            return None
        row = self._forget_row(uid, request_id)
        self._generator.remove([uid])
        return row

    def _forget_row(self, uid: int, request_id: str) -> Row | None:
        """The runner's own record of a batch row gone (the generator's is the caller's)."""
        self._uids.pop(request_id, None)
        row = self._rows.pop(uid, None)
        if row is not None:
            self._release(row)
        self._prefilled.pop(uid, None)
        return row

    def cut_short(self, request_id: str) -> RequestOutput | None:
        """End a running request as if it hit max_tokens (the watchdog): what it
        generated is delivered, nothing of it is stored. Text the detokeniser still
        held may complete a stop string: then it stopped, as it would have anyway.
        One the step budget never started is still queued to its client: 503."""
        waiting = self._waiting.get(request_id)
        if waiting is not None and not waiting.started:
            self.remove(request_id)
            return RequestOutput.queue_timeout(request_id)
        row = self.remove(request_id)
        if row is None:
            return None
        now = time.monotonic()
        try:
            text = row.text.finish()
        except Exception:  # noqa: BLE001 - the row ends either way
            text = ""
        stopped = row.text.stopped
        return row.output(
            text=text,
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            stop_sequence=row.text.matched_stop,
            timed_out=True,
            stats=row.stats(now),
        )

    def _release(self, row: Row) -> None:
        if self.vision is not None:  # gone mid-image: its features no longer pinned
            self.vision.release(row.request.request_id)
        if row.disk_read is not None:  # gone mid-read: the entry let go, the bytes dropped
            self.prefix_cache.cancel_read(row.disk_read)
            row.disk_read = None
        if row.entry_id is not None:
            self.prefix_cache.release(row.entry_id)
            row.entry_id = None

    def _segments(self, row: Row, rest: list[int], start: int) -> list[list[int]]:
        """The prompt after ``start`` as the generator prefills it: cut at the
        checkpoints where its KV is stored on the way."""
        hints = row.request.cache if self.prefix_cache is not None else None
        row.checkpoints = (
            row_kv.checkpoints(self.prefix_cache, hints, self._trimmable, start, len(rest))
            if hints
            else []
        )
        bounds = [0, *row.checkpoints, len(rest)]
        row.prefill_len = len(rest)
        row.stops = tuple(bounds[1:-1]) + (len(rest) - 1,)
        return [rest[a:b] for a, b in zip(bounds, bounds[1:])]

    def _plan(self) -> SlicePlan:
        """This step's prefill slice, and which waiting rows start prefilling."""
        decoding: list[int] = []  # the decoding rows' KV depths
        prefills = []
        for uid, row in self._rows.items():
            done = self._prefilled.get(uid)
            if done is None:
                decoding.append(row.kv_depth(row.prefill_len))
            else:
                prefills.append(row.prefill(done, running=True))
        for w in self._waiting.values():
            if w.row.disk_read is None:  # one being read cannot start yet
                prefills.append(w.row.prefill(0, running=False, waited=w.waited))
        # the decoding rows share one left-padded cache: each attends over the deepest
        return self.budget.plan(len(decoding), padded_depth(decoding), prefills)

    def _start_waiting(self, plan: SlicePlan, failed: list[RequestOutput]) -> float:
        """Start the rows the plan starts; returns the seconds their images took."""
        vision_s = 0.0
        for request_id in plan.start:
            w = self._waiting.pop(request_id)
            if not w.started:  # its time in the queue ends here, not at admission
                w.started, w.row.joined_at = True, time.monotonic()
            try:
                if w.row.request.images:
                    began = time.perf_counter()
                    past_images = self._vision_prefill(w, plan.slice_tokens)
                    vision_s += time.perf_counter() - began
                    if not past_images:
                        self._waiting[request_id] = w  # its next image next step
                        continue
                uid = self._insert(w.row, w.segments, w.cache, w.cached_tokens)
            except Exception as exc:  # noqa: BLE001 - this row's own inputs
                self._release(w.row)
                self.row_faults += 1
                log.error("%s: could not start prefill: %s", request_id, exc)
                failed.append(w.row.failure(time.monotonic(), f"{type(exc).__name__}: {exc}"))
                continue
            self._prefilled[uid] = 0
        for w in self._waiting.values():
            w.waited += 1
        return vision_s

    def _account_prefill(self, prompt_responses, failed: dict[int, str]) -> StepShape:
        """Record prefill progress; returns the prefill the step really ran."""
        self.last_step_prefill = 0
        ran: list[tuple[int, int]] = []  # (tokens, depth before) per row the model ran
        for resp in prompt_responses:
            if resp.uid not in self._prefilled:
                continue
            done = resp.progress[0]
            before = self._prefilled[resp.uid]
            row = self._rows[resp.uid]
            if not resp.end_of_prompt:  # the last token runs as a decode step instead
                ran.append((done - before, row.kv_depth(before)))
            self.last_step_prefill += done - before
            self._prefilled[resp.uid] = done
            if row.checkpoints and done == row.checkpoints[0] and resp.end_of_segment:
                self._store_checkpoint(resp.uid, row, failed)
            if resp.end_of_prompt:
                del self._prefilled[resp.uid]
                self._release(row)
        self.prefill_tokens += self.last_step_prefill
        # rows are right-padded to the longest slice and left-padded to the deepest
        width = max((n for n, _ in ran), default=0)
        return StepShape.padded(width, [d for _, d in ran])

    def _faulted_rows(self) -> dict[int, str]:
        """Rows whose guarded sampler or logits processors raised this step."""
        if not self.faults:
            return {}
        failed: dict[int, str] = {}
        for uid, row in self._rows.items():
            error = self.faults.by_row.get(row.request.request_id) or self.faults.by_sampler.get(
                id(row.sampler)
            )
            if error is not None:
                failed[uid] = error
        self.faults.clear()
        return failed

    def plan_step(self) -> SlicePlan:
        """What the next step will prefill (the step budget's choice): a
        distributed group's serving rank sends it to the others (engine.lockstep)."""
        return self._plan()

    def step(self, plan: SlicePlan | None = None) -> list[RequestOutput]:
        """One decode step for running rows plus one prefill slice for joiners,
        the slice sized by the step budget (or ``plan``, decided elsewhere)."""
        started = time.perf_counter()
        outputs: list[RequestOutput] = self._finish_reads() if self._waiting else []
        self.waited_on_reads = plan is None and bool(self._waiting) and self._only_reading()
        if self.waited_on_reads:
            self.prefix_cache.wait_reads(READ_WAIT_S)  # no busy loop while the disk reads
            return outputs + self._finish_reads()
        if plan is None:
            plan = self._plan()
        vision_s = self._start_waiting(plan, outputs)
        self._generator.prefill_step_size = plan.slice_tokens
        try:
            prompt_responses, responses = self._generator.next()
        except Exception as exc:  # noqa: BLE001 - nobody owned it: find out who
            return outputs + self._unowned_fault(exc)
        # the cost model learns the generator's step; an image's prefill is not one
        ran = time.perf_counter() - started - vision_s
        failed = self._faulted_rows()
        prefill = self._account_prefill(prompt_responses, failed)
        self._observe(plan, prefill, ran)
        now = time.monotonic()
        stopped_by_text: dict[int, Row] = {}
        if responses:
            self.batch_sizes[min(len(responses), len(self.batch_sizes) - 1)] += 1
        rows, advance, emit = self._rows, self._advance, outputs.append  # per row: kept lean
        for resp in responses:
            row = rows.get(resp.uid)
            if row is None or resp.uid in failed:
                continue
            try:
                out = advance(row, resp, now)
            except Exception as exc:  # noqa: BLE001 - its detokeniser, stop matcher or cache
                failed[resp.uid] = f"{type(exc).__name__}: {exc}"
                continue
            emit(out)
            if out.finish_reason is not None:
                self._uids.pop(row.request.request_id, None)
                del self._rows[resp.uid]
                self._release(row)
                if resp.finish_reason is not None:
                    self._store_quietly(row, resp.prompt_cache, resp.all_tokens)
                    # its own copy of the row's KV, counted nowhere: gone now, not
                    # when the step ends (rows finishing together piled them up)
                    resp.prompt_cache = None
                else:
                    stopped_by_text[resp.uid] = row
        self._read_logprobs(failed)
        if stopped_by_text:
            try:
                self._remove_stopped(stopped_by_text)
            except Exception as exc:  # noqa: BLE001 - the batch still holds answered rows
                # the rows that faulted this step fail now: the rebuild would re-admit them
                outputs += self._fail_rows(failed, now, detached=True)
                return outputs + self._unowned_fault(exc)
        outputs += self._fail_rows(failed, now)
        self._count_recovered()
        self.timings.record(
            time.perf_counter() - started, self.last_step_prefill, plan.slice_tokens, plan.budgeted
        )
        return outputs

    def _observe(self, plan: SlicePlan, prefill: StepShape, seconds: float) -> None:
        """Teach the cost model what this step cost. A decode step right after a
        prefill is not a sample: its token was computed during that prefill
        (mlx-lm evaluates decode steps one ahead), so it takes almost no time."""
        shape = StepShape(
            plan.shape.decode_rows,
            plan.shape.decode_depth,
            prefill.prefill_tokens,
            prefill.prefill_depth,
        )
        if shape.prefill_tokens or not self._last_prefilled:
            self.budget.observe(shape, seconds)
        self._last_prefilled = shape.prefill_tokens > 0

    def _advance(self, row: Row, resp, now: float) -> RequestOutput:
        """This row's share of a step: its token as text, and whether it finished.
        Runs once per row per step on the host's critical path: kept lean."""
        token = resp.token
        row.generated += 1
        row.tokens.append(token)
        self.generated_tokens += 1
        # only EOS tokens are token-level stops; with ignore_eos one is generated
        # past, and its text ("<|im_end|>") is no part of the reply either
        eos = resp.finish_reason == "stop" or token in self._eos_ids
        # its text may differ mid-reply (token_pieces): where the reply drops the
        # space before its first word, as a completion does not
        first = not row.text.started and row.request.trim_leading_space
        text = "" if eos else row.text.add_token(token)
        out = row.output(text, (token,), at=now)
        top = row.request.logprobs
        if top is not None and not eos:  # an EOS adds no text: it has no entry
            self._asked.append((out, Asked(resp.logprobs, token, top, first)))
        if row.first_token_at is None:
            row.first_token_at = now
            out.ttft = now - row.request.started_at
            out.cache = row.report
        if row.text.stopped:
            out.finish_reason = FinishReason.STOP
        elif resp.finish_reason is not None:
            out.text += row.text.finish()  # held text may complete a stop string here
            # with ignore_eos an EOS is just a token: only a stop string stops it
            stopped = (eos and not row.request.ignore_eos) or row.text.stopped
            out.finish_reason = FinishReason.STOP if stopped else FinishReason.LENGTH
        if out.finish_reason is not None:
            out.stop_sequence = row.text.matched_stop
            out.stats = row.stats(now)
        return out

    def _read_logprobs(self, failed: dict[int, str]) -> None:
        """The log probabilities of this step's rows that asked, read together."""
        asked, self._asked = self._asked, []
        if not asked:
            return
        try:
            entries = token_logprobs([a for _, a in asked], self._pieces, self._logprob_stream)
        except Exception:  # noqa: BLE001 - whose? each row is read again on its own
            self._read_logprobs_alone(asked, failed)
            return
        for (out, _), entry in zip(asked, entries):
            out.logprobs = (entry,)

    def _read_logprobs_alone(
        self, asked: list[tuple[RequestOutput, Asked]], failed: dict[int, str]
    ) -> None:
        """The step's read failed: row by row, only the rows whose own read fails
        fail (one token without a piece failed every row asking in that step)."""
        for out, one in asked:
            try:
                (entry,) = token_logprobs([one], self._pieces, self._logprob_stream)
            except Exception as exc:  # noqa: BLE001 - this row's own
                uid = self._uids.get(out.request_id)
                if uid is not None:
                    failed[uid] = f"log probabilities: {type(exc).__name__}: {exc}"
                continue
            out.logprobs = (entry,)

    def _store_checkpoint(self, uid: int, row: Row, failed: dict[int, str]) -> None:
        """The prompt's KV so far, kept: reading it out of the batch is the row's
        (a fault there fails it); keeping it is the cache's, and a store that fails
        costs a later hit, never this request (it failed every request that reached
        a checkpoint)."""
        try:
            ((caches, _),) = self._generator.extract_cache([uid]).values()
        except Exception as exc:  # noqa: BLE001 - the row's own cache
            failed.setdefault(uid, f"{type(exc).__name__}: {exc}")
            return
        try:
            row_kv.store_checkpoint(self.prefix_cache, row, caches)
        except Exception:  # noqa: BLE001
            log.exception("%s: checkpoint KV not stored", row.request.request_id)

    def _remove_stopped(self, rows: dict[int, Row]) -> None:
        """Rows a stop string ended leave the batch, their KV stored. Their replies
        are delivered: a copy of their KV that fails (out of memory) keeps nothing,
        and they leave all the same (it escaped the step: the engine went down)."""
        uids = list(rows)
        caches = {}
        if self.prefix_cache is not None:
            try:
                caches = self._generator.extract_cache(uids)
            except Exception:  # noqa: BLE001 - delivered already; only the KV is lost
                log.exception("rows ended by a stop string: their KV is not kept")
        self._generator.remove(uids)  # a failure here is the batch's: the caller rebuilds it
        for uid in list(caches):
            cache, tokens = caches.pop(uid)  # each copy goes once stored
            self._store_quietly(rows[uid], cache, tokens)
            del cache

    def _store_quietly(self, row: Row, caches, all_tokens) -> None:
        """A reply already delivered must not fail because its KV could not be kept."""
        if self.prefix_cache is None:
            return
        try:
            self._know_images(row)
            row_kv.store_final(self.prefix_cache, row, caches, all_tokens, self._model_ids)
        except Exception:  # noqa: BLE001
            log.exception("%s: prompt KV not stored", row.request.request_id)

    def _fail_rows(
        self, failed: dict[int, str], now: float, detached: bool = False
    ) -> list[RequestOutput]:
        """``detached``: the batch is about to be rebuilt; its generator is left alone."""
        outputs = []
        for uid, error in failed.items():
            row = self._rows.get(uid)
            if row is None:
                continue
            log.error("%s: failed alone in the engine: %s", row.request.request_id, error)
            if detached:
                self._forget_row(uid, row.request.request_id)
            else:
                self.remove(row.request.request_id)
            self.row_faults += 1
            outputs.append(row.failure(now, error))
        return outputs

    # -- a step fault nobody owned ---------------------------------------------
    def _count_recovered(self) -> None:
        """A recovery ends once every row it re-admitted has decoded past its
        prefill (or left): reset after any good step, a fault that comes only when
        rows decode together (their prefills pass) rebuilt the batch for ever, no
        token out and no row failed."""
        if not self._recovering:
            return
        rows = self._rows
        self._readmitted = {
            uid: target
            for uid, target in self._readmitted.items()
            if uid in rows and rows[uid].generated < target
        }
        if not self._readmitted:
            self._recovering = 0

    def _unowned_fault(self, exc: Exception) -> list[RequestOutput]:
        """A step fault no row owns: the batch is rebuilt, where it may be (a rank
        group's batches must stay alike: there it ends the engine)."""
        if not self.recoverable:
            raise EngineFault(f"engine step failed: {type(exc).__name__}: {exc}") from exc
        return self._recover(exc)

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """The batch's state is no longer trustworthy: rebuild it and replay every
        row from its prompt and what it generated so far, together (one batched
        prefill: a transient fault costs that and no more). Only a fault that comes
        back before the replay has decoded is looked for: rows are tried alone,
        newest first, until one faults; it fails and the others are replayed."""
        looking = self._recovering > 0  # it came back during the last one's replay
        if not looking:
            self.recoveries += 1  # one per fault, however many rebuilds it takes
        self._recovering += 1
        rows = list(self._rows.values())
        log.error(
            "engine step failed (%s: %s); rebuilding the batch and replaying %d rows%s",
            type(exc).__name__,
            exc,
            len(rows),
            ", each tried alone first" if looking else "",
            exc_info=exc,
        )
        if self._recovering > MAX_RECOVERIES:
            raise EngineFault(f"the batch keeps failing: {type(exc).__name__}: {exc}") from exc
        self._drop_generator(exc)
        self._generator = self._new_generator(self._max_batch, self._prefill_rows)
        self._rows.clear()
        self._uids.clear()
        self._prefilled.clear()
        self._readmitted.clear()
        self.faults.clear()
        for row in rows:
            self._release(row)
            row.checkpoints = []
        culprit = self._culprit(rows, exc) if looking else None
        outputs = []
        if culprit is not None:
            row, error = culprit
            rows.remove(row)
            self.row_faults += 1
            log.error("%s: failed alone in the engine: %s", row.request.request_id, error)
            outputs.append(row.failure(time.monotonic(), error))
        for row in rows:
            self.progress()  # a vision row runs its images through the tower again
            self._readmit(row)
        if outputs:
            # the fault has its owner: no endless rebuild, whatever comes next (a
            # client retrying a bad request during a long replay took the engine down)
            self._recovering = 0
            self._readmitted.clear()
        return outputs

    def _culprit(self, rows: list[Row], exc: Exception) -> tuple[Row, str] | None:
        """The first of ``rows``, newest first (the likeliest), that faults alone,
        with its fault; None if none does. Once one is found the others go back
        unprobed (a probe prefills a row's whole context, and the replay does it
        again): should another fault, the next recovery finds it. Not bisected:
        probing halves together runs up to twice the batch's context where this
        stops at the first culprit (the newest, usually, and short)."""
        for row in reversed(rows):
            self.progress()
            error = self._probe(row)
            if error is None:
                continue
            if not self._model_healthy():  # not this row's: no row would run
                raise EngineFault(f"the model no longer runs: {type(exc).__name__}: {exc}") from exc
            return row, error
        return None

    def _readmit(self, row: Row) -> None:
        """The row back in the rebuilt batch, from its prompt and what it generated."""
        # the KV is rebuilt from the request's own tokens, whatever a hit had reused
        row.kv_key = row.request.cache.key if row.request.cache else None
        replay, cache, cached_tokens = self._replay(row)
        row.prefill_len, row.stops, row.replayed = len(replay), (len(replay) - 1,), row.generated
        # its next draw is its next token's, whatever a probe and the lost step drew
        rewind(row.sampler, row.generated, row.processors)
        uid = self._insert(row, [replay], cache, cached_tokens)
        self._prefilled[uid] = 0
        # the token its prefill yields, then one decoded with the batch
        self._readmitted[uid] = row.generated + 2

    def _drop_generator(self, exc: Exception) -> None:
        """Free the failed batch before its rows are probed and replayed: the
        fault's traceback still held its generator (every row's KV) through the
        probes, the whole batch's memory beside the rebuilt one's; and closed,
        it no longer resets Metal's wired limit when collected later."""
        old = self._generator
        try:
            old.close()
        except Exception:  # noqa: BLE001 - it failed already; what matters is its memory
            log.debug("closing the failed batch raised", exc_info=True)
        del old
        traceback.clear_frames(exc.__traceback__)
        mx.clear_cache()

    def _replay(self, row: Row) -> tuple[list[int], list | None, list[int] | None]:
        """The row from scratch: what to prefill (its prompt and what it generated
        so far), its images run through the vision prefill again into a new cache."""
        tokens = list(row.request.prompt_tokens) + row.tokens
        row.kv_offset = row.rope_delta = 0
        if not row.request.images or self.vision is None:
            return tokens, None, None
        cache = make_prompt_cache(self.model)
        done, row.rope_delta = self._read_images(row, cache, 0, 0)
        row.kv_offset = done
        return tokens[done:], cache, tokens[:done]

    def _probe(self, row: Row) -> str | None:
        """Run ``row`` alone in a throwaway batch up to its next token: its fault, or None."""
        probe = self._new_generator(1, 1)
        try:
            replay, cache, cached_tokens = self._replay(row)
            self._insert(row, [replay], cache, cached_tokens, generator=probe)
            while not probe.next()[1]:
                pass
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        finally:
            probe.close()
        errors = list(self.faults.by_row.values()) + list(self.faults.by_sampler.values())
        self.faults.clear()
        return errors[0] if errors else None

    def _model_healthy(self) -> bool:
        try:
            cache = make_prompt_cache(self.model)
            mx.eval(self.model(mx.array([[0]]), cache=cache))
        except Exception:  # noqa: BLE001
            log.exception("the model fails a one-token forward pass")
            return False
        return True

    # -- adapters (mounted between steps: never during a forward pass) ---------
    def adapter_users(self, adapter_id: str) -> int:
        """Rows prefilling, decoding or waiting to start that use ``adapter_id``."""
        rows = [*self._rows.values(), *(w.row for w in self._waiting.values())]
        return sum(1 for r in rows if r.request.adapter == adapter_id)

    def mount_adapter(
        self, adapter_id: str, files: AdapterFiles, scale: float = 1.0
    ) -> AdapterInfo:
        return self.adapters.mount(adapter_id, files, scale)

    def unmount_adapter(self, adapter_id: str) -> AdapterInfo:
        users = self.adapter_users(adapter_id)
        if users:
            raise AdapterInUse(
                f"adapter {adapter_id!r} is in use by {users} running request(s); "
                "unmount it when they finish"
            )
        return self.adapters.unmount(adapter_id)

    def adapter_infos(self) -> list[AdapterInfo]:
        return self.adapters.infos()

    def adapter_bytes(self) -> int:
        return self.adapters.nbytes

    def close(self) -> None:
        self._generator.close()
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # queued KV writes reach the disk
