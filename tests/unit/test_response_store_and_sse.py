"""The Responses store (TTL, byte cap, LRU) and the SSE keep-alive helper."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from app.images import ImageSource
from app.response_store import ResponseStore, StoredResponse, shared_bytes
from app.server import create_app
from app.settings import Settings
from app.sse import FrameTemplate, sse_data, sse_event, with_heartbeat
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app


def _resp(rid: str, pad: int = 0) -> dict:
    return {"id": rid, "pad": "x" * pad}


def test_entries_expire_after_the_ttl():
    now = [0.0]
    store = ResponseStore(ttl_s=10, clock=lambda: now[0])
    store.put(_resp("a"), [{"role": "user", "content": "hi"}])
    now[0] = 9.9
    assert store.get("a") is not None
    now[0] = 10.1
    assert store.get("a") is None and len(store) == 0 and store.nbytes == 0


def test_byte_cap_evicts_least_recently_used():
    one = StoredResponse.of(_resp("a", 900), [])
    assert one is not None
    cap = 3 * one.nbytes + one.nbytes // 2
    store = ResponseStore(max_bytes=cap)
    for rid in "abc":
        store.put(_resp(rid, 900), [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_resp("d", 900), [])
    assert store.get("b") is None
    assert {r for r in "acd" if store.get(r)} == {"a", "c", "d"}
    assert store.nbytes <= cap
    store.put(_resp("huge", cap), [])  # larger than the cap: not stored, nothing evicted
    assert store.get("huge") is None and len(store) == 3


def test_evicted_and_deleted_responses_leave_no_bookkeeping_behind():
    """Each response's expiry entry was dropped only at its TTL: a 64 KiB store
    given 200,000 small responses in an hour held 200,000 entries (32 MiB)."""
    store = ResponseStore(max_bytes=3000)
    for i in range(20_000):
        store.put(_resp(f"r{i}", 100), [])
        if i % 2:
            store.delete(f"r{i}")
    assert 0 < len(store) < 30
    assert len(store._deadlines) <= 2 * len(store._items) + 65  # noqa: SLF001
    assert store.get("r19998") is not None  # what is kept still expires and reads


def test_the_byte_cap_counts_what_is_held():
    """Kept as JSON bytes: many small values weighed ~7x their JSON as objects."""
    store = ResponseStore(max_bytes=200_000)
    meta = {f"k{i}": i for i in range(30_000)}  # ~350 KB of JSON: over the cap
    store.put({"id": "big", "metadata": meta}, [])
    assert store.get("big") is None and store.nbytes == 0
    store.put({"id": "a", "metadata": {"k": "v"}}, [{"role": "user", "content": "é"}])
    stored = store.get("a")
    assert stored is not None and store.nbytes == stored.nbytes
    # the JSON and what Python holds around it (test_response_store_memory: how much)
    (message,) = stored.messages
    assert stored.nbytes == stored.own_bytes + shared_bytes(message)
    assert stored.own_bytes > len(stored.response_json) and shared_bytes(message) > len(message)
    assert stored.conversation() == [{"role": "user", "content": "é"}]
    assert stored.conversation() is not stored.conversation()  # a fresh copy each time


def test_a_conversations_turns_hold_what_they_share_once():
    """Each turn stored the whole conversation again: 13 turns beside a 5 MiB
    image held 60 MiB, and evicted every other client's responses."""
    store = ResponseStore(max_bytes=8 * 2**20)
    image = {"role": "user", "content": "i" * 2**20}  # one large message, sent first
    store.put({"id": "other"}, [{"role": "user", "content": "another client"}])
    conversation = [image]
    for turn in range(40):
        conversation = conversation + [
            {"role": "assistant", "content": f"reply {turn}"},
            {"role": "user", "content": f"question {turn}"},
        ]
        store.put({"id": f"t{turn}"}, conversation)
    assert store.get("other") is not None  # nothing evicted: about 1 MiB held
    assert 2**20 < store.nbytes < 2**20 + 200_000
    assert store.get("t39").conversation() == conversation
    for turn in range(40):  # each one released: the shared messages go with the last
        assert store.delete(f"t{turn}")
    assert store.delete("other") and store.nbytes == 0


def test_the_ttl_runs_from_the_store_and_an_entry_stored_again_keeps_its_new_one():
    now = [0.0]
    store = ResponseStore(ttl_s=10, clock=lambda: now[0])
    store.put({"id": "a"}, [{"role": "user", "content": "x"}])
    now[0] = 5.0
    store.put({"id": "a"}, [{"role": "user", "content": "y"}])  # replaced: a new TTL
    now[0] = 12.0
    stored = store.get("a")
    assert stored is not None and stored.conversation()[0]["content"] == "y"
    now[0] = 15.0
    assert not store.delete("a")  # past its TTL: nothing to delete (a 404)
    assert store.get("a") is None and store.nbytes == 0


def test_a_stored_conversation_keeps_its_image_sources():
    store = ResponseStore()
    source = ImageSource(url="data:image/png;base64,AAAA")
    part = {"type": "image", "source": source}
    store.put({"id": "a"}, [{"role": "user", "content": [part]}])
    stored = store.get("a")
    assert stored is not None
    assert stored.conversation() == [{"role": "user", "content": [part]}]


def test_a_response_json_cannot_hold_is_not_stored_and_nothing_raises():
    store = ResponseStore()
    store.put({"id": "a", "x": object()}, [])
    store.put({"id": "b", "x": float("nan")}, [])
    assert store.get("a") is None and store.get("b") is None and store.nbytes == 0


def follow_up(url: str, first: dict) -> httpx.Response:
    """A stored turn, then the next one naming it by previous_response_id."""
    r = httpx.post(url + "/v1/responses", json=first, timeout=30)
    assert r.status_code == 200, r.text
    body = {"previous_response_id": r.json()["id"], "input": "and now?"}
    return httpx.post(url + "/v1/responses", json=body, timeout=30)


def test_previous_response_id_after_an_image_turn():
    """The stored conversation of a turn with an image is read back whole (its
    image source was stored as its repr, and the next turn failed with a 500)."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, "PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    app = create_app(
        Settings(_env_file=None, images="placeholder"), lambda s, r: FakeEngine(s, r, eos_after=3)
    )
    content = [{"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": image}]
    with serve_app(app) as url:
        second = follow_up(url, {"store": True, "input": [{"role": "user", "content": content}]})
        assert second.status_code == 200, second.text


@given(
    st.dictionaries(
        st.sampled_from(["url", "base64", "video", "__kvwarm_image_source__", "type", "source"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda inner: st.dictionaries(st.text(max_size=25), inner, max_size=3),
            max_leaves=6,
        ),
        max_size=3,
    )
)
@settings(max_examples=200, deadline=None)
def test_a_clients_json_is_read_back_as_it_was_sent(arguments):
    """Whatever a client put in a tool call's arguments comes back as that JSON:
    an image source is only ever rebuilt where an image part keeps one (a marker
    key in the arguments turned them into an ImageSource, and the next turn 500'd)."""
    store = ResponseStore()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
    ]
    store.put({"id": "a"}, conversation)
    stored = store.get("a")
    assert stored is not None
    assert stored.conversation() == conversation


def test_previous_response_id_after_a_tool_call_with_any_arguments():
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=3))
    forged = '{"__kvwarm_image_source__": {"url": "http://x"}}'
    calls = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": forged},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    with serve_app(app) as url:
        second = follow_up(
            url, {"input": [{"role": "user", "content": "hi"}, *calls], "max_output_tokens": 3}
        )
        assert second.status_code == 200, second.text


def test_delete():
    store = ResponseStore()
    store.put(_resp("a"), [])
    assert store.delete("a") and not store.delete("a") and store.nbytes == 0


async def test_heartbeat_fills_idle_gaps_and_closing_closes_the_source():
    closed = asyncio.Event()

    async def slow():
        try:
            yield 1
            await asyncio.sleep(0.3)
            yield 2
            await asyncio.sleep(10)
            yield 3
        finally:
            closed.set()

    seen = []
    stream = with_heartbeat(slow(), 0.05)
    async for batch in stream:
        seen.append(batch)
        if batch == [2]:
            break
    await stream.aclose()
    assert [b for b in seen if b is not None] == [[1], [2]]
    assert None in seen[1:-1]  # keep-alives while the source was idle
    await asyncio.wait_for(closed.wait(), 1)


async def test_heartbeat_passes_errors_through():
    async def failing():
        yield 1
        raise ValueError("boom")

    seen = []
    try:
        async for batch in with_heartbeat(failing(), 1):
            seen += batch
    except ValueError as exc:
        assert str(exc) == "boom"
    else:
        raise AssertionError("the error was swallowed")
    assert seen == [1]  # what came before the error is delivered first


async def test_heartbeat_loses_and_reorders_nothing_around_keepalives():
    """Items arriving at every phase of the reader's idle wait (before it, during
    it, as its timer fires) all come through, once, in order."""

    async def bursty():
        for i in range(300):
            if i % 7 == 0:
                await asyncio.sleep(0.003)  # about the keep-alive interval
            elif i % 3 == 0:
                await asyncio.sleep(0)
            yield i

    batches = [batch async for batch in with_heartbeat(bursty(), 0.002)]
    assert [i for batch in batches if batch for i in batch] == list(range(300))
    assert all(batch is None or batch for batch in batches)  # no empty batch


async def test_a_reader_that_fell_behind_takes_what_is_waiting_in_one_batch():
    """The stream then catches up in one write instead of one per token."""
    release = asyncio.Event()

    async def fast():
        yield 0
        await release.wait()
        for i in range(1, 50):
            yield i

    stream = with_heartbeat(fast(), 10)
    assert await anext(stream) == [0]
    release.set()
    await asyncio.sleep(0.05)  # the reader is busy elsewhere while 49 arrive
    assert await anext(stream) == list(range(1, 50))
    await stream.aclose()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(meta=st.dictionaries(st.text(), _json, max_size=4), value=_json, usage=st.booleans())
@example(meta={FrameTemplate.HOLE: None}, value=None, usage=False)  # failed CI once
def test_a_frame_template_gives_sse_datas_bytes(meta, value, usage):
    """What a stream's chunk template writes equals encoding the whole payload."""
    meta = {k: v for k, v in meta.items() if k not in ("choices", "usage")}
    # the server writes the chunk's constant fields (id, model, created): never the
    # hole's own marker, which hypothesis draws from the source's constants
    assume(json.dumps(FrameTemplate.HOLE)[1:-1] not in json.dumps(meta))

    def payload(delta):
        chunk = {**meta, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        return {**chunk, "usage": None} if usage else chunk

    assert FrameTemplate(payload(FrameTemplate.HOLE))(value) == sse_data(payload(value))


# what str.splitlines (httpx's iter_lines, Python SSE clients) also ends a line at
_LINE_BREAKS_JSON_ALLOWS = "\u2028\u2029\u0085"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from('ab \u2028\u2029\u0085\u00e9\\"')))
@example(text="line one\u2028line two\u2029three\u0085four")
def test_a_frame_has_no_line_break_but_its_own_and_decodes_to_the_same_text(text):
    """U+2028, U+2029 and U+0085 went out raw: a client splitting lines as
    str.splitlines does cut the data line and the turn failed ("unreadable stream
    chunk"). Escaped, the JSON reads back the same."""
    payload = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    frames = [
        sse_data(payload),
        FrameTemplate({"choices": [{"index": 0, "delta": FrameTemplate.HOLE}]})({"content": text}),
        sse_event("content_block_delta", {"delta": {"text": text}}),
    ]
    for frame in frames:
        assert not set(frame) & set(_LINE_BREAKS_JSON_ALLOWS)
        assert frame.splitlines() == frame.split("\n")[:-1]  # lines end at \n alone
    assert json.loads(frames[0][6:])["choices"][0]["delta"]["content"] == text
    assert json.loads(frames[1][6:])["choices"][0]["delta"]["content"] == text
    assert json.loads(frames[2].splitlines()[1][6:])["delta"]["text"] == text
