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
from dataclasses import dataclass

from mlx_lm.generate import BatchGenerator, StopSequences

from engine.sampling import SamplerFactory
from engine.text_output import TextOutput
from scheduler.request import FinishReason, Request, RequestOutput


@dataclass
class _Row:
    request: Request
    text: TextOutput
    generated: int = 0
    first_token_at: float | None = None


class BatchRunner:
    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int,
        prefill_step_size: int,
        prefill_batch: int,
    ):
        self.tokenizer = tokenizer
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

    @property
    def active(self) -> int:
        return len(self._rows)

    def add(self, request: Request) -> None:
        params = request.sampling
        (uid,) = self._generator.insert(
            [request.prompt_tokens],
            max_tokens=[request.max_tokens],
            samplers=[self._samplers.sampler(params)],
            logits_processors=[self._samplers.logits_processors(params)],
            stop_sequences=[self._no_stop] if request.ignore_eos else None,
        )
        self._rows[uid] = _Row(request, TextOutput(self.tokenizer.detokenizer, request.stop))
        self._uids[request.request_id] = uid
        self._prefilled[uid] = 0

    def remove(self, request_id: str) -> None:
        uid = self._uids.pop(request_id, None)
        if uid is not None:
            self._rows.pop(uid, None)
            self._prefilled.pop(uid, None)
            self._generator.remove([uid])

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
            if resp.end_of_prompt:
                del self._prefilled[resp.uid]
        self.prefill_tokens += self.last_step_prefill

    def step(self) -> list[RequestOutput]:
        """One decode step for running rows plus one prefill chunk for joiners."""
        self._generator.prefill_step_size = self._chunk_per_row()
        prompt_responses, responses = self._generator.next()
        self._account_prefill(prompt_responses)
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped_by_text: list[int] = []
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
                if resp.finish_reason is None:
                    stopped_by_text.append(resp.uid)
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
                    ttft=ttft,
                )
            )
            if finish is not None:
                self._uids.pop(row.request.request_id, None)
                del self._rows[resp.uid]
        if stopped_by_text:
            self._generator.remove(stopped_by_text)
        return outputs

    def close(self) -> None:
        self._generator.close()
