"""Continuous batching on mlx-lm's BatchGenerator.

Why BatchGenerator rather than our own loop over BatchKVCache: it already does
what a continuous batch needs and is maintained with the model classes: rows
join between decode steps (prompt batch -> generation batch), finished rows
leave without disturbing the others (``filter``), prompts are prefilled in
``prefill_step_size`` chunks interleaved with decode steps, each row takes its
own sampler / logits processors / stop tokens, and per-sequence prompt caches go
in (``insert(caches=...)``) and out (``extract_cache``), which is what prefix
reuse builds on. What it lacks, and this module adds, is the request view:
text deltas, stop *strings*, aborts, and per-request bookkeeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from engine.prefix_cache import PrefixCache
from engine.sampling import SamplerFactory
from engine.text_output import TextOutput
from scheduler.admission import round_up
from scheduler.prompt_key import PromptKey
from scheduler.request import CacheReport, FinishReason, Request, RequestOutput, RequestStats


@dataclass
class _Row:
    request: Request
    text: TextOutput
    generated: int = 0
    first_token_at: float | None = None
    cached: int = 0  # prompt tokens served from the prefix cache
    kv_offset: int = 0  # KV positions the reused cache holds (differs from ``cached``
    # when a volatile span of another length was stepped over)
    kv_key: PromptKey | None = None  # what this row's KV holds before generation
    entry_id: int | None = None  # prefix-cache entry read (released after prefill)
    # prefill progress values (prompt tokens after ``cached``) at which to store KV
    checkpoints: list[int] = field(default_factory=list)
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


class BatchRunner:
    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int,
        prefill_step_size: int,
        prefill_batch: int,
        prefix_cache: PrefixCache | None = None,
    ):
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache
        self._trimmable = can_trim_prompt_cache(make_prompt_cache(model))
        # prompt tokens one step may prefill, shared by all rows joining at once
        self.prefill_budget = prefill_step_size
        self._prefill_rows = min(prefill_batch, max_batch)
        self._samplers = SamplerFactory(vocab_size=len(tokenizer))
        eos = sorted(tokenizer.eos_token_ids)
        self._generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in eos],
            completion_batch_size=max_batch,
            prefill_batch_size=self._prefill_rows,
            prefill_step_size=prefill_step_size,
        )
        self._no_stop = StopSequences()
        self._rows: dict[int, _Row] = {}
        self._uids: dict[str, int] = {}
        self._prefilled: dict[int, int] = {}  # uid -> prompt tokens processed so far
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.last_step_prefill = 0
        # decode steps by rows decoding together: index = batch size
        self.batch_sizes = [0] * (max_batch + 1)

    @property
    def active(self) -> int:
        return len(self._rows)

    def add(self, request: Request) -> None:
        params = request.sampling
        row = _Row(request, TextOutput(self.tokenizer.detokenizer, request.stop))
        prompt = request.prompt_tokens
        cache, cached_tokens = None, None
        hints = request.cache if self.prefix_cache is not None else None
        if hints is not None:
            # KV positions the admission reservation (rounded up) has to spare
            slack = round_up(request.reserved_tokens) - request.reserved_tokens
            reuse, row.report = self.prefix_cache.lookup(
                request.request_id, hints, max_growth=slack
            )
            row.kv_key = hints.key
            if reuse is not None:
                row.cached, row.kv_offset = reuse.request_depth, reuse.kv_depth
                row.kv_key, row.entry_id = reuse.kv_key, reuse.entry_id
                cache = reuse.caches
                cached_tokens = list(reuse.kv_key.model_tokens[: reuse.kv_depth])
        rest = prompt[row.cached :]
        if hints is not None:
            row.checkpoints = self._checkpoints(hints, row.cached, len(rest))
        bounds = [0, *row.checkpoints, len(rest)]
        segments = [rest[a:b] for a, b in zip(bounds, bounds[1:])]
        try:
            (uid,) = self._generator.insert_segments(
                [segments],
                max_tokens=[request.max_tokens],
                caches=[cache] if cache is not None else None,
                all_tokens=[cached_tokens] if cached_tokens is not None else None,
                samplers=[self._samplers.sampler(params)],
                logits_processors=[self._samplers.logits_processors(params)],
                stop_sequences=[self._no_stop] if request.ignore_eos else None,
            )
        except Exception:
            self._release(row)
            raise
        self._rows[uid] = row
        self._uids[request.request_id] = uid
        self._prefilled[uid] = 0

    def remove(self, request_id: str) -> None:
        uid = self._uids.pop(request_id, None)
        if uid is not None:
            row = self._rows.pop(uid, None)
            if row is not None:
                self._release(row)
            self._prefilled.pop(uid, None)
            self._generator.remove([uid])

    def _release(self, row: _Row) -> None:
        if row.entry_id is not None:
            self.prefix_cache.release(row.entry_id)
            row.entry_id = None

    def _checkpoints(self, hints, cached: int, remaining: int) -> list[int]:
        """Where prefill pauses to store KV (as progress after ``cached``).

        Always the end of the system prompt + tools: an agent arriving while
        this one still generates (a sub-agent) reuses it at once. For caches
        that cannot be cut back (recurrent layers) also the end of the last
        message, which the next turn shares even if the reply re-tokenises
        differently, since such an entry only ever hits whole."""
        points = {hints.key.stable_prefix_end}
        if not self._trimmable and hints.key.message_ends:
            points.add(hints.key.message_ends[-1])
        min_gain = self.prefix_cache.config.block_size
        return sorted(p - cached for p in points if min_gain <= p - cached < remaining)

    def _checkpoint(self, uid: int, row: _Row) -> None:
        """Store the KV of the prompt so far, the moment prefill reaches a checkpoint."""
        ((caches, _tokens),) = self._generator.extract_cache([uid]).values()
        key = row.kv_key.truncated(row.kv_offset + row.checkpoints.pop(0))
        self.prefix_cache.store(key, caches, row.request.cache.session_id)

    def _store_final(self, row: _Row, caches, all_tokens) -> None:
        """Keep prompt + reply KV: the next turn of this conversation starts with it."""
        if row.kv_key is None or not caches:
            return
        base = row.kv_key.model_tokens
        if tuple(all_tokens[: len(base)]) != base:
            return  # should not happen; never store KV under the wrong tokens
        key = row.kv_key.extended(all_tokens[len(base) :])
        hints = row.request.cache
        entry_id = self.prefix_cache.store(key, caches, hints.session_id)
        self.prefix_cache.record_turn(hints, entry_id)

    def _chunk_per_row(self) -> int:
        """Split the step's prefill budget over the rows still prefilling, so a
        burst of joiners (or one long prompt) stalls running decoders for at most
        ``prefill_budget`` tokens of compute per step, not rows x budget."""
        prefilling = min(len(self._prefilled), self._prefill_rows) or 1
        return max(16, self.prefill_budget // prefilling)

    def _account_prefill(self, prompt_responses) -> None:
        self.last_step_prefill = 0
        for resp in prompt_responses:
            if resp.uid not in self._prefilled:
                continue
            done = resp.progress[0]
            self.last_step_prefill += done - self._prefilled[resp.uid]
            self._prefilled[resp.uid] = done
            row = self._rows[resp.uid]
            if row.checkpoints and done == row.checkpoints[0] and resp.end_of_segment:
                self._checkpoint(resp.uid, row)
            if resp.end_of_prompt:
                del self._prefilled[resp.uid]
                self._release(row)
        self.prefill_tokens += self.last_step_prefill

    def step(self) -> list[RequestOutput]:
        """One decode step for running rows plus one prefill chunk for joiners."""
        self._generator.prefill_step_size = self._chunk_per_row()
        prompt_responses, responses = self._generator.next()
        self._account_prefill(prompt_responses)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped_by_text: dict[int, _Row] = {}
        if responses:
            self.batch_sizes[min(len(responses), len(self.batch_sizes) - 1)] += 1
        for resp in responses:
            row = self._rows.get(resp.uid)
            if row is None:
                continue
            row.generated += 1
            self.generated_tokens += 1
            ttft = None
            if row.first_token_at is None:
                row.first_token_at = now
                ttft = now - row.request.arrival_time
            eos = resp.finish_reason == "stop"  # only EOS tokens are token-level stops
            text = "" if eos else row.text.add_token(resp.token)
            finish = None
            if row.text.stopped:
                finish = FinishReason.STOP
            elif resp.finish_reason is not None:
                text += row.text.finish()
                finish = FinishReason.STOP if eos else FinishReason.LENGTH
            outputs.append(
                RequestOutput(
                    request_id=row.request.request_id,
                    text=text,
                    token_ids=(resp.token,),
                    finish_reason=finish,
                    prompt_tokens=len(row.request.prompt_tokens),
                    completion_tokens=row.generated,
                    cached_tokens=row.cached,
                    ttft=ttft,
                    stop_sequence=row.text.matched_stop,
                    stats=row.stats(now) if finish is not None else None,
                )
            )
            if finish is not None:
                self._uids.pop(row.request.request_id, None)
                del self._rows[resp.uid]
                self._release(row)
                if resp.finish_reason is not None:
                    self._store_final(row, resp.prompt_cache, resp.all_tokens)
                else:
                    stopped_by_text[resp.uid] = row
        if stopped_by_text:
            caches = self._generator.remove(
                list(stopped_by_text), return_prompt_caches=self.prefix_cache is not None
            )
            for uid, (cache, tokens) in caches.items():
                self._store_final(stopped_by_text[uid], cache, tokens)
        return outputs

    def close(self) -> None:
        self._generator.close()
