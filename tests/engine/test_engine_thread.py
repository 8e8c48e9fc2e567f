"""The engine thread behind the scheduler, on a tiny random llama."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.engine_thread import EngineConfig, EngineThread
from engine.model_source import ModelSource
from kvcache.layout import GROWTH_SLACK
from scheduler.admission import EngineUnavailable
from scheduler.request import FinishReason, Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.service import GenerationService
from scheduler.streams import OutputRouter


class Harness:
    def __init__(self, model_dir, batch=4, budget=None):
        self.model_dir = model_dir
        self.batch = batch
        self.budget = budget

    async def __aenter__(self):
        router = OutputRouter(asyncio.get_running_loop())
        self.scheduler = Scheduler(None, max_running=self.batch, max_queue=16)
        config = EngineConfig(
            source=ModelSource("mlx", self.model_dir, "tiny"),
            max_batch=self.batch,
            prefill_step_size=32,
            memory_budget_bytes=self.budget,
        )
        self.engine = EngineThread(config, self.scheduler, router)
        self.engine.start()
        while not self.engine.ready and self.engine.alive:
            await asyncio.sleep(0.02)
        assert self.engine.ready, self.engine.failure
        self.service = GenerationService(self.scheduler, router, self.engine)
        self.formatter = self.engine.model_info.formatter
        return self

    async def __aexit__(self, *exc):
        self.engine.stop()
        self.engine.join(10)

    def request(self, text, max_tokens=16, **kw) -> Request:
        kw.setdefault("sampling", SamplingParams(temperature=0.0))
        return Request(
            self.formatter.render_chat([{"role": "user", "content": text}]).tokens, max_tokens, **kw
        )

    async def run(self, req: Request):
        outs = [o async for o in self.service.submit(req)]
        return "".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1]


async def test_greedy_generation_is_deterministic_and_stops_at_length(tiny_llama_dir):
    async with Harness(tiny_llama_dir) as h:
        a = await h.run(h.request("hello", max_tokens=12, ignore_eos=True))
        b = await h.run(h.request("hello", max_tokens=12, ignore_eos=True))
    assert a[1] == b[1] and len(a[1]) == 12
    assert a[2].finish_reason == FinishReason.LENGTH
    assert a[2].completion_tokens == 12 and a[2].prompt_tokens > 0


async def test_stop_string_ends_generation_and_is_excluded(tiny_llama_dir):
    async with Harness(tiny_llama_dir) as h:
        text, _, _ = await h.run(h.request("abc", max_tokens=30, ignore_eos=True))
        assert len(text) >= 6
        stop = text[3:5]
        cut, tokens, last = await h.run(
            h.request("abc", max_tokens=30, ignore_eos=True, stop=(stop,))
        )
    assert cut == text[: text.find(stop)]
    assert last.finish_reason == FinishReason.STOP
    assert len(tokens) < 30


async def test_a_stop_string_completed_by_the_last_flush_is_a_stop(tiny_llama_dir):
    """The detokenizer holds lone spaces until a token that is not one; on the
    max_tokens step the flush of what it held ("   ", less the reply's leading
    space) completes the stop string: a stop, not length."""
    async with Harness(tiny_llama_dir) as h:
        (space,) = h.formatter.encode(" ")
        spaces = SamplingParams(temperature=0.0, logit_bias=((space, 100.0),))
        text, tokens, last = await h.run(
            h.request("abc", max_tokens=3, ignore_eos=True, sampling=spaces, stop=("  ",))
        )
    assert tokens == [space] * 3 and text == ""
    assert last.finish_reason == FinishReason.STOP and last.stop_sequence == "  "


async def test_seeded_sampling_is_reproducible_and_seed_sensitive(tiny_llama_dir):
    def params(seed):
        return SamplingParams(temperature=1.0, top_p=0.9, seed=seed)

    async with Harness(tiny_llama_dir) as h:
        runs = await asyncio.gather(
            *(h.run(h.request("x", 24, sampling=params(s), ignore_eos=True)) for s in (1, 1, 2))
        )
    assert runs[0][1] == runs[1][1]
    assert runs[0][1] != runs[2][1]


async def test_abort_frees_the_batch_slot_within_a_step(tiny_llama_dir):
    async with Harness(tiny_llama_dir, batch=1) as h:
        long = h.request("long", max_tokens=5000, ignore_eos=True)
        stream = h.service.submit(long)
        await stream.__anext__()  # generating now
        assert h.engine.engine_stats().active_rows == 1
        steps_before = h.engine.engine_stats().steps
        await stream.aclose()  # the client went away
        deadline = time.monotonic() + 5
        while h.engine.engine_stats().active_rows and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert h.engine.engine_stats().active_rows == 0
        assert h.engine.engine_stats().steps - steps_before <= 2
        assert h.scheduler.stats().aborted_total == 1
        # the single slot serves the next request
        _, tokens, last = await h.run(h.request("next", 4, ignore_eos=True))
        assert len(tokens) == 4 and last.finish_reason == FinishReason.LENGTH


async def test_engine_death_fails_in_flight_requests_and_refuses_new_ones(tiny_llama_dir):
    async with Harness(tiny_llama_dir, batch=1) as h:
        running = h.service.submit(h.request("a", 5000, ignore_eos=True))
        waiting = h.service.submit(h.request("b", 10, ignore_eos=True))
        await running.__anext__()
        h.engine.inject_fault(RuntimeError("simulated Metal failure"))

        async def last(stream):
            return [o async for o in stream][-1]

        tails = await asyncio.wait_for(asyncio.gather(last(running), last(waiting)), 5)
        assert all(t.finish_reason == FinishReason.ERROR for t in tails)
        assert all("simulated Metal failure" in t.error for t in tails)
        assert not h.engine.alive and not h.engine.ready
        with pytest.raises(EngineUnavailable):
            h.service.submit(h.request("c", 4))


async def test_memory_budget_holds_back_requests_that_do_not_fit_together(tiny_llama_dir):
    async with Harness(tiny_llama_dir, batch=4) as h:
        budget = h.engine.model_info.budget
        per_token = budget.kv_bytes_per_token
        # shrink the KV budget to exactly one 512-position row (and its growth slack)
        h.scheduler.admission.budget = type(budget)(
            total_bytes=budget.weights_bytes
            + budget.reserve_bytes
            + (512 + GROWTH_SLACK) * per_token,
            weights_bytes=budget.weights_bytes,
            reserve_bytes=budget.reserve_bytes,
            kv_bytes_per_token=per_token,
        )
        first = h.service.submit(h.request("one", 400, ignore_eos=True))
        second = h.service.submit(h.request("two", 400, ignore_eos=True))
        await first.__anext__()
        await asyncio.sleep(0.2)
        stats = h.scheduler.stats()
        assert (stats.running, stats.waiting) == (1, 1)  # waits for memory, not a batch slot
        await first.aclose()
        out = [o async for o in second]
        assert out[-1].finish_reason == FinishReason.LENGTH


async def test_logit_bias_bans_a_token(tiny_llama_dir):
    async with Harness(tiny_llama_dir) as h:
        _, tokens, _ = await h.run(h.request("q", 12, ignore_eos=True))
        banned = tokens[0]
        biased = SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),))
        _, again, _ = await h.run(h.request("q", 12, ignore_eos=True, sampling=biased))
    assert banned not in again


async def test_a_request_that_fails_to_start_fails_alone(tiny_llama_dir):
    async with Harness(tiny_llama_dir) as h:
        bad = h.request("x", 4, sampling=SamplingParams(temperature=1.0, seed=-5))  # not a uint64
        outs = [o async for o in h.service.submit(bad)]
        assert outs[-1].finish_reason == FinishReason.ERROR and "TypeError" in outs[-1].error
        assert h.engine.alive
        # counted as a row fault, as the same failure one stage later in the runner is
        assert h.engine.engine_stats().row_faults == 1
        _, tokens, _ = await h.run(h.request("y", 3, ignore_eos=True))
        assert len(tokens) == 3


async def test_an_adapter_unmounted_before_its_request_starts_is_no_engine_fault(
    tiny_llama_dir,
):
    """The client's 400 (adapter_not_found), not a fault of the engine's: uncounted."""
    async with Harness(tiny_llama_dir) as h:
        outs = [o async for o in h.service.submit(h.request("x", 4, adapter="gone"))]
        assert outs[-1].error_code == "adapter_not_found"
        assert h.engine.engine_stats().row_faults == 0


async def test_shutdown_ends_open_streams(tiny_llama_dir):
    h = Harness(tiny_llama_dir, batch=1)
    await h.__aenter__()
    stream = h.service.submit(h.request("a", 5000, ignore_eos=True))
    await stream.__anext__()
    await h.__aexit__(None, None, None)
    tail = [o async for o in stream][-1]
    assert tail.finish_reason == FinishReason.ERROR and "shutting down" in tail.error


async def test_an_adapter_past_the_budget_is_refused_before_it_is_read(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Loaded first, a large one took the memory the budget keeps before the 400."""
    import engine.adapters as adapters_module
    from engine.adapter_files import read_adapter_files
    from scheduler.contracts import AdapterTooLarge
    from tests.helpers.adapters import write_adapter

    files = read_adapter_files(write_adapter(tiny_llama_dir, tmp_path / "a", seed=1))
    loads = []
    load = adapters_module._load_weights  # noqa: SLF001
    monkeypatch.setattr(adapters_module, "_load_weights", lambda f: loads.append(f) or load(f))
    async with Harness(tiny_llama_dir) as h:
        budget = h.engine.model_info.budget
        roomy = h.scheduler.admission.budget
        h.scheduler.admission.budget = type(budget)(  # less KV room than the adapter's file
            total_bytes=budget.weights_bytes + budget.reserve_bytes + files.weights_size // 2,
            weights_bytes=budget.weights_bytes,
            reserve_bytes=budget.reserve_bytes,
            kv_bytes_per_token=budget.kv_bytes_per_token,
        )
        with pytest.raises(AdapterTooLarge, match="no KV budget"):
            await asyncio.wrap_future(h.engine.mount_adapter("big", files))
        assert loads == []  # never read
        h.scheduler.admission.budget = roomy
        info = await asyncio.wrap_future(h.engine.mount_adapter("big", files))
        assert info.id == "big" and len(loads) == 1


async def test_the_model_info_bounds_an_adapters_tensors_by_its_linear_layers(tiny_llama_dir):
    """An adapter file's tensor count is checked off the engine thread against the
    model's own bound: 2 blocks of 7 projections (the tied head is no Linear)."""
    from engine.adapter_files import tensor_cap

    async with Harness(tiny_llama_dir) as h:
        assert h.engine.model_info.adapter_layers == 14
        assert tensor_cap(h.engine.model_info.adapter_layers) == 42


async def test_a_mount_is_priced_at_its_peak_the_bytes_read_beside_the_arrays_built(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """While an adapter mounts, the bytes read from its file and MLX's arrays made
    of them are both held: priced at the file once, one with room for less than
    twice it mounted, past the memory the budget keeps."""
    from dataclasses import replace

    import engine.adapters as adapters_module
    from engine.adapter_files import read_adapter_files
    from kvcache.layout import KV_ALLOCATION_STEP
    from scheduler.contracts import AdapterTooLarge
    from tests.helpers.adapters import write_adapter

    files = read_adapter_files(write_adapter(tiny_llama_dir, tmp_path / "a", seed=1))
    loads = []
    load = adapters_module._load_weights  # noqa: SLF001
    monkeypatch.setattr(adapters_module, "_load_weights", lambda f: loads.append(f) or load(f))
    async with Harness(tiny_llama_dir) as h:
        roomy = h.scheduler.admission.budget
        kv_now = roomy.kv_budget_bytes
        # room for the file once and a request beside it, not for it twice
        room = files.weights_size * 3 // 2 + roomy.sequence_bytes(KV_ALLOCATION_STEP)
        h.scheduler.admission.budget = replace(roomy, total_bytes=roomy.total_bytes - kv_now + room)
        with pytest.raises(AdapterTooLarge, match="no KV budget"):
            await asyncio.wrap_future(h.engine.mount_adapter("big", files))
        assert loads == []  # refused before its tensors were built
        h.scheduler.admission.budget = roomy
        assert (await asyncio.wrap_future(h.engine.mount_adapter("big", files))).id == "big"


@pytest.mark.parametrize("budget_mib", [1024, 322])  # 322: KV for less than the 8192 context
def test_the_ready_line_gives_what_one_request_may_use(
    tiny_llama_dir, budget_mib, monkeypatch, caplog
):
    """It said "context 8192 ... KV ceiling 274432 tokens/request": the budget's
    figure, past anything a request could use. It gives the smaller of the two,
    as /v1/models does, and says which one limits."""
    import logging

    from engine import device_memory
    from engine.boot import boot_mlx

    monkeypatch.setattr(device_memory, "measure_bandwidth", lambda: 1e10)
    config = EngineConfig(
        ModelSource("mlx", tiny_llama_dir, "tiny"), memory_budget_bytes=budget_mib * 2**20
    )
    with caplog.at_level(logging.INFO, logger="kvwarm.engine"):
        booted = boot_mlx(config)
    context, ceiling = booted.info.context_length, booted.info.budget.ceiling_tokens
    assert (ceiling < context) == (budget_mib == 322)  # both cases are met
    (ready,) = [r.getMessage() for r in caplog.records if " ready in " in r.getMessage()]
    usable = min(context, ceiling)
    assert f"up to {usable} tokens/request" in ready, ready
    assert ("(the memory budget's KV" in ready) == (ceiling < context), ready
    assert ("(the model's context" in ready) == (ceiling >= context), ready
