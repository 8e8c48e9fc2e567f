"""A disk-tier hit is read off the engine thread: the running rows go on
decoding while its files are read, and the row starts once its bytes are in.
The disk read is held on an Event (as a slow SSD holds a multi-GB entry)."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from kvcache.safetensors_io import CorruptFile
from scheduler.request import FinishReason
from tests.engine.test_kv_store import (
    cold_output,
    conversation,
    disk_harness,
    llama,  # noqa: F401 - the fixture
    second_turn,
)

GATE_S = 3.0  # how long a held read waits at most (the old inline read blocked add())


class HeldRead:
    """The disk tier's entry read, held until ``gate`` opens; then it reads, or raises."""

    def __init__(self, disk, fail: BaseException | None = None):
        self.gate, self.reading, self.done = threading.Event(), threading.Event(), threading.Event()
        self._read, self._fail = disk.read_entry, fail

    def __call__(self, *args, **kw):
        self.reading.set()
        try:
            self.gate.wait(GATE_S)
            if self._fail is not None:
                raise self._fail
            return self._read(*args, **kw)
        finally:
            self.done.set()


def on_disk_only(model, tmp_path):
    """A harness whose cache holds turn 1 on disk only (a restart), and turn 2."""
    h = disk_harness(model, tmp_path)
    ((first, _),) = h.run(h.request(conversation(turns=1)))
    h.cache.close()
    again = disk_harness(model, tmp_path)
    (entry,) = again.cache.index.entries()
    assert entry.on_disk and not entry.in_ram
    return again, entry, second_turn(h, first)


def busy_row(h, max_tokens=40):
    """A cache-less row that keeps decoding meanwhile."""
    other = conversation(turns=1)
    other[0]["content"] = "Someone else entirely. " + other[0]["content"]
    req = h.request(other, max_tokens=max_tokens, session="s2")
    req.cache = None
    return req


def add_quickly(runner, request):
    began = time.monotonic()
    first = runner.add(request)
    assert time.monotonic() - began < 1.0, "admission waited for the disk read"
    return first


def drain(runner, tokens, firsts, limit=2000):
    for _ in range(limit):
        if not runner.active:
            return
        for out in runner.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.cache is not None and out.request_id not in firsts:
                firsts[out.request_id] = out
    raise AssertionError("the runner never finished")


def test_running_rows_decode_while_a_disk_hit_is_read(llama, tmp_path, monkeypatch):  # noqa: F811
    h, entry, turn2 = on_disk_only(llama, tmp_path)
    held = HeldRead(h.cache.disk)
    monkeypatch.setattr(h.cache.disk, "read_entry", held)
    runner = h.runner
    busy, hit = busy_row(h), h.request(turn2)
    runner.add(busy)
    assert add_quickly(runner, hit) is None  # its cache report comes once read
    tokens: dict[str, list[int]] = {}
    firsts: dict = {}
    for _ in range(16):  # its ~400-token prompt, then decoding
        began = time.monotonic()
        for out in runner.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        assert time.monotonic() - began < 1.0  # the step did not wait for the read
    assert held.reading.is_set() and not held.done.is_set()
    assert len(tokens[busy.request_id]) >= 3 and not tokens.get(hit.request_id)
    assert entry.refs == 1  # held while read: nothing evicts or deletes its files
    assert runner.row(hit.request_id) is not None
    held.gate.set()
    drain(runner, tokens, firsts)
    assert tokens[hit.request_id] == cold_output(llama, turn2)
    report = firsts[hit.request_id]
    assert report.cached_tokens > 0 and report.cache.tier == "disk"
    st = h.cache.stats()
    assert st.disk_hits == 1 and st.disk_loads == 1 and entry.refs == 0


@pytest.mark.parametrize("fail", ["transient", "corrupt"])
def test_a_failed_disk_read_starts_cold_and_claims_no_reuse(
    llama,  # noqa: F811
    tmp_path,
    monkeypatch,
    fail,
):
    h, entry, turn2 = on_disk_only(llama, tmp_path)
    exc = OSError(errno.EIO, "I/O error") if fail == "transient" else CorruptFile("bad CRC")
    held = HeldRead(h.cache.disk, exc)
    monkeypatch.setattr(h.cache.disk, "read_entry", held)
    hit = h.request(turn2)
    assert add_quickly(h.runner, hit) is None
    h.runner.step()
    held.gate.set()
    assert held.done.wait(GATE_S)
    time.sleep(0.05)
    tokens: dict[str, list[int]] = {}
    firsts: dict = {}
    for out in h.runner.step():  # the failed read is taken up: the row starts cold
        firsts[out.request_id] = out
    if fail == "transient":  # kept for the next request: a failed read is no damage
        assert h.cache.index.get(entry.entry_id) is entry and entry.refs == 0
        assert entry.on_disk and h.cache.stats().disk_files_discarded == 0
    else:
        assert h.cache.index.get(entry.entry_id) is None
        assert h.cache.stats().disk_files_discarded >= 1
    drain(h.runner, tokens, firsts)
    assert tokens[hit.request_id] == cold_output(llama, turn2)
    first = firsts[hit.request_id]
    assert first.cached_tokens == 0 and first.cache.depth == 0
    assert first.cache.tier == "none" and first.cache.conv_kv in ("none", "fresh")
    st = h.cache.stats()
    assert st.disk_hits == 0 and st.disk_loads == 0 and st.misses >= 1


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_a_row_gone_mid_read_lets_the_entry_go(llama, tmp_path, monkeypatch, how):  # noqa: F811
    h, entry, turn2 = on_disk_only(llama, tmp_path)
    held = HeldRead(h.cache.disk)
    monkeypatch.setattr(h.cache.disk, "read_entry", held)
    runner = h.runner
    hit = h.request(turn2)
    add_quickly(runner, hit)
    runner.step()
    assert held.reading.wait(GATE_S) and entry.refs == 1
    if how == "abort":
        assert runner.remove(hit.request_id) is not None
    else:
        out = runner.cut_short(hit.request_id)
        assert out is not None and out.finish_reason == FinishReason.ERROR
        assert out.error_code == "queue_timeout"
    assert entry.refs == 0 and runner.active == 0  # evictable at once
    held.gate.set()
    assert held.done.wait(GATE_S)
    time.sleep(0.05)
    assert runner.step() == []  # the late result is dropped, nothing crashes
    st = h.cache.stats()
    assert st.disk_loads == 0 and st.promotions == 0 and entry.refs == 0
    assert not entry.in_ram and entry.on_disk
    # the entry serves the next request as before
    tokens: dict[str, list[int]] = {}
    again = h.request(turn2)
    runner.add(again)
    drain(runner, tokens, {})
    assert tokens[again.request_id] == cold_output(llama, turn2)
    assert h.cache.stats().disk_hits == 1


def test_waiting_on_a_disk_read_alone_is_no_engine_step(llama, tmp_path, monkeypatch):  # noqa: F811
    """The engine counted each 50 ms wait on a read as a step (~20 a second in
    /stats while nothing ran): step() says when it only waited."""
    h, entry, turn2 = on_disk_only(llama, tmp_path)
    held = HeldRead(h.cache.disk)
    monkeypatch.setattr(h.cache.disk, "read_entry", held)
    runner = h.runner
    hit = h.request(turn2)
    add_quickly(runner, hit)
    steps = runner.timings.snapshot().step_seconds.count
    for _ in range(3):
        assert runner.step() == []
        assert runner.waited_on_reads  # the engine loop does not count it
    assert runner.timings.snapshot().step_seconds.count == steps
    held.gate.set()
    drain(runner, {}, {})
    assert not runner.waited_on_reads
