"""Prefix reuse on a real (tiny, random-weight) llama through BatchRunner.

Greedy decoding makes the output a function of the KV the model reads, so:
strict reuse must give exactly the cache-less output, and volatile reuse must
give exactly the output of a fresh prefill of the prompt the reused KV stands
for (the old volatile values, at the positions they were cached at).
"""

from __future__ import annotations

import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.batch_runner import BatchRunner
from engine.prompt_format import ChatFormatter
from kvcache.index import PromptCacheConfig, VolatilePolicy
from kvcache.manager import TieredKVManager
from kvcache.prompt_key import PromptKey
from scheduler.request import CacheHints, Request, SamplingParams
from tests.helpers.tiny_models import KVSumModel, RecurrentSumModel

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = "You are a careful agent. " * 12 + "\nCurrent time is {time}\nAlways answer briefly."


@pytest.fixture(scope="module", params=["kvsum", "llama"])
def tiny(request, tiny_llama_dir, byte_tokenizer):
    """KVSumModel's next token is an exact function of every token in its KV row
    (an off-by-one cut or a wrong token changes it); the random llama adds real
    attention with RoPE positions."""
    if request.param == "kvsum":
        return KVSumModel(), byte_tokenizer
    model, tokenizer = load(str(tiny_llama_dir))
    return model, tokenizer


class Harness:
    def __init__(
        self,
        tiny,
        policy=VolatilePolicy.REUSE,
        cache=True,
        prefill_step=64,
        disk=None,
        kv_block=16,
        namespace="tiny",
        quant=None,
        max_step_s=0.0,
    ):
        model, tokenizer = tiny
        self.formatter = ChatFormatter(tokenizer)
        self.policy = policy
        self.cache = (
            TieredKVManager(
                PromptCacheConfig(block_size=8, policy=policy, kv_block_size=kv_block),
                64 * 2**20,
                namespace,
                make_prompt_cache(model),
                disk,
                quant,
            )
            if cache
            else None
        )
        self.runner = BatchRunner(
            model,
            tokenizer,
            max_batch=4,
            prefill_step_size=prefill_step,
            prefill_batch=4,
            prefix_cache=self.cache,
            max_step_s=max_step_s,
        )
        self._n = 0

    def request(self, messages, max_tokens=12, session="s1", kv_bits=None):
        rendered = self.formatter.render_chat(
            messages, relocate_volatile=self.policy is VolatilePolicy.RELOCATE
        )
        self._n += 1
        return Request(
            rendered.tokens,
            max_tokens,
            sampling=GREEDY,
            ignore_eos=True,
            request_id=f"r{self._n}",
            cache=CacheHints(rendered.key, session, rendered.message_hashes, kv_bits),
        )

    def run(self, *requests, stagger=0):
        """Run requests to completion; with ``stagger`` each joins that many steps later."""
        tokens = {r.request_id: [] for r in requests}
        cached = {}
        pending = list(requests)
        step = 0
        while pending or self.runner.active:
            if pending and (stagger == 0 or step % stagger == 0):
                for r in pending if stagger == 0 else pending[:1]:
                    self.runner.add(r)
                pending = [] if stagger == 0 else pending[1:]
            for out in self.runner.step():
                tokens[out.request_id].extend(out.token_ids)
                cached[out.request_id] = out.cached_tokens
            step += 1
            assert step < 5000
        return [(tokens[r.request_id], cached[r.request_id]) for r in requests]


def conversation(time="10:00", turns=1, reply="ok."):
    msgs = [{"role": "system", "content": SYSTEM.format(time=time)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question number {t}: what now?"})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": reply})
    return msgs


def decode(h, tokens):
    return h.formatter._tokenizer.decode(tokens)


def test_strict_hit_gives_exactly_the_cacheless_output(tiny):
    h = Harness(tiny, VolatilePolicy.STRICT)
    ((first, cached0),) = h.run(h.request(conversation(turns=1)))
    assert cached0 == 0
    turn2 = conversation(turns=1) + [
        {"role": "assistant", "content": decode(h, first)},
        {"role": "user", "content": "and then?"},
    ]
    ((warm, cached),) = h.run(h.request(turn2))
    assert cached > len(h.request(conversation(turns=1)).prompt_tokens)  # prompt + reply reused
    cold_h = Harness(tiny, VolatilePolicy.STRICT, cache=False)
    ((cold, _),) = cold_h.run(cold_h.request(turn2))
    assert warm == cold
    stats = h.cache.stats()
    assert stats.hits == 1 and stats.exact_key_rejected_by_model_lcp == 0


def test_a_watchdog_cut_delivers_its_text_and_stores_nothing_past_the_prompt(tiny):
    """cut_short ends the row with finish length and the text not yet handed out;
    no entry holds its partial reply, so the next turn reuses at most the prompt."""
    h = Harness(tiny, VolatilePolicy.STRICT)
    req = h.request(conversation(turns=1), max_tokens=50)
    h.runner.add(req)
    generated = []
    while len(generated) < 6:
        for out in h.runner.step():
            generated.extend(out.token_ids)
    entries = {e.uid for e in h.cache.index.entries()}
    out = h.runner.cut_short(req.request_id)
    assert out is not None and out.timed_out and out.finish_reason.value == "length"
    assert h.runner.active == 0 and h.runner.cut_short(req.request_id) is None
    deepest = max((len(e.key.model_tokens) for e in h.cache.index.entries()), default=0)
    assert {e.uid for e in h.cache.index.entries()} == entries  # nothing stored on the cut
    assert deepest < len(req.prompt_tokens)  # only checkpoints inside the prompt
    turn2 = conversation(turns=1) + [
        {"role": "assistant", "content": decode(h, generated)},
        {"role": "user", "content": "and then?"},
    ]
    ((_, cached),) = h.run(h.request(turn2))
    assert cached < len(req.prompt_tokens)


@pytest.mark.parametrize("broken", ["store", "extract"])
def test_a_checkpoint_the_cache_cannot_keep_costs_no_request(tiny, broken):
    """A fault in storing a row's checkpoint (mid-prefill) failed the row: a store
    bug then failed every request that reached a checkpoint. Reading the KV out of
    the batch is the row's: a fault there ends that row alone."""
    rogue_messages = [{"role": "system", "content": "Rogue system prompt. " * 12}]
    rogue_messages.append({"role": "user", "content": "question number 0: what now?"})
    alone_h = Harness(tiny, VolatilePolicy.STRICT)
    ((alone, _),) = alone_h.run(alone_h.request(conversation(turns=1), session="good"))
    h = Harness(tiny, VolatilePolicy.STRICT)
    rogue = h.request(rogue_messages, session="rogue")
    good = h.request(conversation(turns=1), session="good")
    store, generator = h.cache.store, h.runner._generator  # noqa: SLF001
    extract = generator.extract_cache

    def failing_store(key, *args, **kwargs):
        if list(key.model_tokens[:8]) == list(rogue.prompt_tokens[:8]):
            raise OSError("no space left on device")
        return store(key, *args, **kwargs)

    def failing_extract(uids):
        rows = h.runner._rows  # noqa: SLF001
        if any(rows[u].request.request_id == rogue.request_id for u in uids if u in rows):
            raise RuntimeError("cannot read the row's KV")
        return extract(uids)

    if broken == "store":
        h.cache.store = failing_store
    else:
        generator.extract_cache = failing_extract
    h.runner.add(rogue)
    h.runner.add(good)
    outs: dict[str, list] = {rogue.request_id: [], good.request_id: []}
    while h.runner.active:
        for out in h.runner.step():
            outs[out.request_id].append(out)
    last = outs[rogue.request_id][-1]
    if broken == "store":
        assert last.finish_reason.value != "error" and h.runner.row_faults == 0
    else:
        assert last.finish_reason.value == "error" and "cannot read" in last.error
        assert h.runner.row_faults == 1
    assert [t for o in outs[good.request_id] for t in o.token_ids] == alone


def test_a_hit_whose_row_cannot_start_lets_go_of_its_entry(tiny, monkeypatch):
    h = Harness(tiny, VolatilePolicy.STRICT)
    h.run(h.request(conversation(turns=1)))
    (entry,) = h.cache.index.entries()

    def broken(tokens):
        raise RuntimeError("an image identity the vision tower no longer knows")

    monkeypatch.setattr(h.runner, "_model_ids", broken)
    with pytest.raises(RuntimeError):
        h.runner.add(h.request(conversation(turns=1) + [{"role": "user", "content": "more"}]))
    assert entry.refs == 0  # an entry held for ever is never evicted


def test_strict_policy_does_not_reuse_past_a_changed_timestamp(tiny):
    h = Harness(tiny, VolatilePolicy.STRICT)
    old = h.request(conversation("10:00"))
    h.run(old)
    req = h.request(conversation("11:30"))
    ((_, cached),) = h.run(req)
    first_diff = next(
        i for i, (a, b) in enumerate(zip(old.prompt_tokens, req.prompt_tokens)) if a != b
    )
    assert req.cache.key.spans[0].start <= first_diff  # inside the timestamp
    assert cached == first_diff


def test_volatile_reuse_equals_a_fresh_prefill_of_what_the_kv_stands_for(tiny):
    h = Harness(tiny, VolatilePolicy.REUSE)
    h.run(h.request(conversation("10:00", turns=1)))
    new = h.request(conversation("23:59:59", turns=1))
    ((warm, cached),) = h.run(new)
    spans = new.cache.key.spans
    assert cached == len(new.prompt_tokens) - 1  # everything but the last token
    stats = h.cache.stats()
    assert stats.stale_volatile_reuse > 0 and stats.exact_key_rejected_by_model_lcp == 0
    # the KV holds the old timestamp: a fresh prefill of that prompt must agree exactly
    cold_h = Harness(tiny, cache=False)
    stands_for = cold_h.request(conversation("10:00", turns=1))
    ((cold, _),) = cold_h.run(stands_for)
    assert warm == cold
    assert spans and new.prompt_tokens != stands_for.prompt_tokens


def test_relocate_keeps_the_prefix_stable_and_the_values_current(tiny):
    h = Harness(tiny, VolatilePolicy.RELOCATE)
    old = h.request(conversation("10:00"))
    h.run(old)
    req = h.request(conversation("23:59"))
    text = decode(h, req.prompt_tokens)
    assert "23:59" in text and "10:00" not in text  # the model reads the current value
    assert text.index("Current time is 23:59") > text.index("question number 0")
    ((_, cached),) = h.run(req)
    first_diff = next(
        i for i, (a, b) in enumerate(zip(old.prompt_tokens, req.prompt_tokens)) if a != b
    )
    assert cached == first_diff > req.cache.key.stable_prefix_end  # system prompt and question
    assert h.cache.stats().stale_volatile_reuse == 0


def test_a_difference_outside_volatile_spans_ends_reuse(tiny):
    h = Harness(tiny)
    h.run(h.request(conversation(turns=1)))
    changed = conversation(turns=1)
    changed[0]["content"] = changed[0]["content"].replace("careful", "reckless")
    req = h.request(changed)
    ((_, cached),) = h.run(req)
    first_diff = next(
        i
        for i, (a, b) in enumerate(zip(req.prompt_tokens, h.request(conversation()).prompt_tokens))
        if a != b
    )
    assert cached <= first_diff


def test_second_agent_reuses_the_system_prompt_checkpoint_while_the_first_generates(tiny):
    h = Harness(tiny, prefill_step=32)
    a = h.request(conversation(turns=1), max_tokens=40, session="agent-a")
    b_msgs = conversation(turns=1)
    b_msgs[1]["content"] = "a completely different task for the second agent"
    b = h.request(b_msgs, max_tokens=8, session="agent-b")
    results = h.run(a, b, stagger=12)  # b joins while a is still decoding
    stable = b.cache.key.stable_prefix_end
    assert results[1][1] >= stable - 1 and stable > 0
    # and it still decodes exactly what it decodes alone
    cold_h = Harness(tiny, cache=False)
    ((alone, _),) = cold_h.run(cold_h.request(b_msgs, max_tokens=8))
    assert results[1][0] == alone


def test_a_time_budget_changes_neither_outputs_nor_stored_checkpoints(tiny):
    """Prefill sliced as thin as it gets while rows decode (a budget no step can
    meet): the same tokens, the same hits, entries stored at the same depths."""

    def agents(h):
        reqs = []
        for i in range(3):
            msgs = conversation(turns=2)
            msgs[1]["content"] = f"agent {i} has its own task: " + "details " * (5 + 9 * i)
            reqs.append(h.request(msgs, max_tokens=14, session=f"agent-{i}"))
        first = h.run(*reqs, stagger=5)
        follow = conversation(turns=2)
        follow[-1]["content"] = "and one more question for agent 0"
        return first + h.run(h.request(follow, session="agent-0"))

    def stored(h):
        return sorted(e.key.model_tokens for e in h.cache.index.entries())

    tokens_h, sliced_h = (
        Harness(tiny, prefill_step=64),
        Harness(tiny, prefill_step=64, max_step_s=1e-9),
    )
    assert agents(sliced_h) == agents(tokens_h)
    assert stored(sliced_h) == stored(tokens_h)
    steps = sliced_h.runner.timings.snapshot()
    assert steps.budgeted_steps > 0 and steps.prefill_tokens.quantile(0.5) < 64


def test_cache_stays_inside_its_byte_budget(tiny):
    h = Harness(tiny)
    budget = None
    for i in range(8):
        msgs = conversation(turns=1)
        msgs[0]["content"] = f"agent {i} " + msgs[0]["content"]
        h.run(h.request(msgs, session=f"s{i}"))
        if budget is None:  # room for one conversation and a bit
            budget = h.cache.index.max_bytes = int(h.cache.index.nbytes * 1.25)
        assert h.cache.index.nbytes <= budget
    assert h.cache.stats().evictions > 0
    assert set(h.cache._private) == {e.entry_id for e in h.cache.index.entries()}


# -- caches that cannot be cut back (recurrent / hybrid layers) ----------------
def _raw_request(tokens, ends, stable, rid, max_tokens=10):
    key = PromptKey.build(tokens, (), ends, stable)
    return Request(
        list(tokens),
        max_tokens,
        sampling=GREEDY,
        ignore_eos=True,
        request_id=rid,
        cache=CacheHints(key, "s"),
    )


def _recurrent_harness(byte_tokenizer, cache=True):
    h = Harness((RecurrentSumModel(), byte_tokenizer), cache=cache)
    assert not h.runner._trimmable
    return h


def test_recurrent_cache_reuses_whole_entries(byte_tokenizer):
    h = _recurrent_harness(byte_tokenizer)
    system, user = list(range(1, 41)), list(range(50, 70))
    first = system + user + [200]
    ((gen, _),) = h.run(_raw_request(first, (40, 60), 40, "a"))
    second = first + gen + [201, 202, 203]
    ((warm, cached),) = h.run(_raw_request(second, (40, 60, 60 + len(gen) + 1), 40, "b"))
    assert cached == len(first) + len(gen)
    cold = _recurrent_harness(byte_tokenizer, cache=False)
    ((expected, _),) = cold.run(_raw_request(second, (), 0, "c"))
    assert warm == expected
    assert h.cache.stats().hybrid_trim_miss == 0


def test_recurrent_cache_falls_back_to_a_message_boundary_checkpoint(byte_tokenizer):
    """The reply came back edited: the whole-turn entry would need cutting, which a
    recurrent state cannot do; the checkpoint at the last message's end still hits."""
    h = _recurrent_harness(byte_tokenizer)
    system, user = list(range(1, 41)), list(range(50, 70))
    first = system + user + [200]
    h.run(_raw_request(first, (40, 60), 40, "a"))
    second = first + [99, 98, 97] + [201, 202]
    ((warm, cached),) = h.run(_raw_request(second, (40, 60, 64), 40, "b"))
    assert cached == 60  # end of the user message: the checkpoint taken mid-prefill
    assert h.cache.stats().hybrid_trim_miss >= 1
    cold = _recurrent_harness(byte_tokenizer, cache=False)
    ((expected, _),) = cold.run(_raw_request(second, (), 0, "c"))
    assert warm == expected


def test_rows_finishing_together_do_not_pile_up_copies_of_their_kv(tiny):
    """Storing a finished row reads mlx-lm's extracted copy of its KV, counted in
    no budget: each copy must go once stored, not stay alive until the step ends
    (eight rows finishing together held 0.83x the batch's KV past the budget)."""
    import weakref

    h = Harness(tiny, VolatilePolicy.STRICT)
    alive_at_store: list[int] = []
    earlier: list[weakref.ref] = []
    store = h.runner._store_quietly

    def watching(row, caches, all_tokens):
        alive_at_store.append(sum(1 for ref in earlier if ref() is not None))
        store(row, caches, all_tokens)
        earlier.extend(weakref.ref(c) for c in caches)

    h.runner._store_quietly = watching
    requests = [
        h.request(conversation(turns=1) + [{"role": "user", "content": f"q{i}"}], session=f"s{i}")
        for i in range(4)
    ]
    h.run(*requests)
    assert len(alive_at_store) == 4 and alive_at_store == [0, 0, 0, 0]
