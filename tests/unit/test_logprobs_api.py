"""Token log probabilities over HTTP in OpenAI's two shapes (model-free engine:
each token is a word, its alternatives made up): every generated token has one
entry, streamed chunks add up to the whole answer, and requests that do not ask
get none."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest

from app.server import create_app
from app.settings import Settings
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.http_server import serve_app

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    app = create_app(Settings(_env_file=None), lambda s, r: FakeEngine(s, r, eos_after=10_000))
    with serve_app(app) as url:
        yield url


def stream(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_logprobs_cover_every_token_with_their_alternatives(base):
    body = {"messages": USER, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}
    choice = httpx.post(base + "/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == ["w0 ", "w1 ", "w2 ", "w3 ", "w4 "]
    assert "".join(e["token"] for e in content).strip() == choice["message"]["content"].strip()
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] == -0.25
        assert [t["token"] for t in e["top_logprobs"]] == [e["token"], "alt0", "alt1"]
        assert [t["logprob"] for t in e["top_logprobs"]] == [-0.25, -1.0, -2.0]


def test_streamed_chat_logprobs_add_up_to_the_whole_answer(base):
    body = {"messages": USER, "max_tokens": 6, "logprobs": True, "top_logprobs": 1}
    whole = httpx.post(base + "/v1/chat/completions", json=body).json()["choices"][0]
    chunks = stream(base, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role's chunk: no token yet
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole["logprobs"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_frame_takes_the_tokens_up_to_its_own_event_when_frames_lag():
    """A stream that fell behind frames many waiting events in one write: the first
    frame must not take the entries of the tokens behind the later ones."""
    from app.generation import Outcome
    from app.protocol.output_parser import Content
    from scheduler.request import RequestOutput, TokenChoice, TokenLogprob

    def entry(i: int) -> TokenLogprob:
        return TokenLogprob(TokenChoice(i, -0.5, f"t{i}".encode()))

    done = Outcome()
    for i in range(3):  # what events() does per output, all before any frame
        done.add_output(RequestOutput("r", f"t{i}", (i,), logprobs=(entry(i),)))
        done.add_event(Content(f"t{i}"))
        done.event_marks.append(len(done.logprobs))
    first = RequestOutput("r", "t3", (3,), logprobs=(entry(3),))
    done.add_output(first)
    done.add_output(first)  # start() and events() both add the first output
    assert [e.chosen.token_id for e in done.frame_logprobs()] == [0]
    assert [e.chosen.token_id for e in done.frame_logprobs()] == [1]
    assert [e.chosen.token_id for e in done.frame_logprobs()] == [2]
    assert [e.chosen.token_id for e in done.frame_logprobs(last=True)] == [3]  # the last's
    assert done.frame_logprobs(last=True) == []


class LaggingGeneration:
    """A generation whose events all exist before the stream frames any of them,
    as when a stream fell behind: the stream frames them in one write."""

    request_id = "r"
    prepared = SimpleNamespace(short_call_ids=False)  # what the stream reads of it

    def __init__(self) -> None:
        from app.generation import Outcome

        self.outcome = Outcome()

    def broke(self, exc: Exception) -> None:
        raise exc  # nothing here fails: a fault is the test's own

    async def events(self):
        from app.protocol.output_parser import Content
        from scheduler.request import FinishReason, RequestOutput, TokenChoice, TokenLogprob

        for i in range(4):
            finish = FinishReason.LENGTH if i == 3 else None
            entry = TokenLogprob(TokenChoice(i, -0.5, f"t{i} ".encode()))
            self.outcome.add_output(RequestOutput("r", f"t{i} ", (i,), finish, logprobs=(entry,)))
            self.outcome.add_event(Content(f"t{i} "))
            self.outcome.event_marks.append(len(self.outcome.logprobs))
            yield Content(f"t{i} ")


@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_each_streamed_chunk_carries_the_tokens_of_its_own_text(dialect):
    """Frames lag events: the first frame of a batch took every waiting entry."""
    import asyncio

    from app import openai_chat, openai_completions

    async def frames() -> list[str]:
        gen = LaggingGeneration()
        if dialect == "chat":
            stream = openai_chat._stream_chunks(gen, {"id": "x"}, False, True)
        else:
            stream = openai_completions._stream(gen, {"id": "x"}, "", False, True)
        # framed batches come as bytes (encoded inside its error guard), the rest as text
        return [f.decode() if isinstance(f, bytes) else f async for f in stream]

    events = [
        json.loads(line[6:])
        for frame in asyncio.run(frames())
        for line in frame.split("\n")
        if line.startswith("data: {")
    ]
    texted = 0
    for choice in (e["choices"][0] for e in events if e["choices"]):
        lp = choice["logprobs"]
        if lp is None:  # chat's role chunk
            continue
        text = choice["delta"].get("content", "") if dialect == "chat" else choice["text"]
        entries = lp["content"] if dialect == "chat" else lp["tokens"]
        tokens = [e["token"] for e in entries] if dialect == "chat" else entries
        assert "".join(tokens) == text
        texted += bool(text)
    assert texted == 4


def test_no_logprobs_unless_asked(base):
    r = httpx.post(base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None
    chunks = stream(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.json()["choices"][0]["logprobs"] is None


def test_the_openai_sdk_reads_them(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    r = client.chat.completions.create(
        model="m", messages=USER, max_tokens=2, logprobs=True, top_logprobs=2
    )
    first = r.choices[0].logprobs.content[0]
    assert first.token == "w0 " and first.top_logprobs[1].token == "alt0"


def test_completion_logprobs_arrays_and_text_offsets(base):
    body = {"prompt": "x", "max_tokens": 4, "logprobs": 2}
    choice = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["w0 ", "w1 ", "w2 ", "w3 "]
    assert lp["token_logprobs"] == [-0.25] * 4
    assert lp["top_logprobs"][0] == {"w0 ": -0.25, "alt0": -1.0}
    assert lp["text_offset"] == [0, 3, 6, 9]
    assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    chunks = stream(base, "/v1/completions", body)
    joined: dict[str, list] = {k: [] for k in lp}
    for c in chunks:
        for k in lp:
            joined[k] += c["choices"][0]["logprobs"][k]
    assert joined == lp


def test_completion_logprobs_zero_gives_the_chosen_tokens_only(base):
    body = {"prompt": "x", "max_tokens": 2, "logprobs": 0}
    lp = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.25]
    assert lp["top_logprobs"] == [{"w0 ": -0.25}, {"w1 ": -0.25}]  # the chosen one, as OpenAI


def test_completion_keys_name_partial_characters_by_their_bytes():
    """Tokens inside a UTF-8 character all decoded to one replacement-character key,
    the least likely value winning over the chosen token's."""
    from app.logprobs_format import CompletionLogprobs
    from scheduler.request import TokenChoice, TokenLogprob

    chosen = TokenChoice(1, -0.1, b"\xe2\x80")
    top = (chosen, TokenChoice(2, -0.5, b"\xe2\x81"), TokenChoice(3, -3.0, b"\xe2"))
    lp = CompletionLogprobs().take([TokenLogprob(chosen, top), TokenLogprob(chosen, ())])
    assert lp["tokens"] == ["bytes:\\xe2\\x80", "bytes:\\xe2\\x80"]
    assert lp["top_logprobs"][0] == {
        "bytes:\\xe2\\x80": -0.1,
        "bytes:\\xe2\\x81": -0.5,
        "bytes:\\xe2": -3.0,
    }
    assert lp["top_logprobs"][1] == {"bytes:\\xe2\\x80": -0.1}
    nan = TokenChoice(4, float("nan"), b"a")
    assert CompletionLogprobs().take([TokenLogprob(nan)])["token_logprobs"] == [-9999.0]


def test_text_offsets_count_a_broken_character_before_the_token_that_breaks_it():
    """A byte that began no complete character became its replacement character
    while the next token decoded: that token was given the replacement's offset."""
    from app.logprobs_format import CompletionLogprobs
    from scheduler.request import TokenChoice, TokenLogprob

    pieces = [b"a", b"\xe4", b"b", b"\xe6\x97", b"\xa5", b"", b"c"]
    lp = CompletionLogprobs().take(
        [TokenLogprob(TokenChoice(i, -0.1, p)) for i, p in enumerate(pieces)]
    )
    text = "a\ufffdb\u65e5c"  # what the choice's text holds
    assert lp["text_offset"] == [0, 1, 2, 3, 3, 4, 4]
    assert text[lp["text_offset"][2]] == "b" and text[lp["text_offset"][6]] == "c"


CAP = 256  # app.logprobs_format.FRAME_LOGPROBS: the most entries one frame carries


class WithheldGeneration:
    """A reply whose text the parser withholds for a long stretch (a tool call until
    its end tag, bare JSON until the end), one event for it all, then tokens no
    event frames (reasoning that strip_thinking drops) before the end."""

    request_id = "r"
    prepared = SimpleNamespace(short_call_ids=False)  # what the stream reads of it

    def __init__(self, dialect: str, withheld: int = 1000, after: int = 600) -> None:
        from app.generation import Outcome

        self.dialect, self.withheld, self.total = dialect, withheld, withheld + after
        self.outcome = Outcome()

    def broke(self, exc: Exception) -> None:
        raise exc

    async def events(self):
        from app.protocol.output_parser import Content
        from app.protocol.tool_formats import ToolCall
        from scheduler.request import FinishReason, RequestOutput, TokenChoice, TokenLogprob

        done = self.outcome
        for i in range(self.total):
            finish = FinishReason.LENGTH if i == self.total - 1 else None
            top = tuple(TokenChoice(900 + k, -2.0, b"alt%d" % k) for k in range(3))
            entry = TokenLogprob(TokenChoice(i, -0.5, f"t{i} ".encode()), top)
            done.add_output(RequestOutput("r", f"t{i} ", (i,), finish, logprobs=(entry,)))
            if i == self.withheld - 1:  # the withheld text's one event
                event = ToolCall("f", "{}") if self.dialect == "chat" else Content("t" * 9)
                done.add_event(event)
                done.event_marks.append(len(done.logprobs))
                yield event
        done.completion_tokens = self.total


@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_a_long_withheld_stretch_streams_its_logprobs_in_bounded_frames(dialect):
    """A frame carried every token since the last one: a tool call withheld to its
    end tag (or reasoning dropped) built thousands of tokens' logprobs into one
    frame in one event-loop step (8,000 with 20 alternatives: 0.42 s, 10 MB)."""
    import asyncio

    from app import openai_chat, openai_completions

    async def writes() -> list[tuple[int, str]]:
        gen = WithheldGeneration(dialect)
        if dialect == "chat":
            stream = openai_chat._stream_chunks(gen, {"id": "x"}, True, True)
        else:
            stream = openai_completions._stream(gen, {"id": "x"}, "", True, True)
        ticks = 0

        async def ticker() -> None:  # counts the event loop's turns
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        try:
            return [(ticks, f.decode() if isinstance(f, bytes) else f) async for f in stream]
        finally:
            task.cancel()

    out = asyncio.run(writes())
    choices, entries_per_write, turns = [], [], []
    for tick, text in out:
        frames = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
        counted = 0
        for frame in frames:
            if not frame["choices"]:
                assert frame["usage"]["completion_tokens"] == 1600  # usage: the very last
                assert frame is frames[-1] and text is out[-2][1]
                continue
            choice = frame["choices"][0]
            lp = choice["logprobs"]
            if lp is None:  # chat's role chunk
                continue
            tokens = [e["token"] for e in lp["content"]] if dialect == "chat" else lp["tokens"]
            assert len(tokens) <= CAP
            counted += len(tokens)
            choices.append((choice, tokens))
        if counted:
            entries_per_write.append(counted)
            turns.append(tick)
    streamed = [t for _, tokens in choices for t in tokens]
    assert streamed == [f"t{i} " for i in range(1600)]  # each token once, in order
    finishes = [c["finish_reason"] for c, _ in choices]
    assert finishes == [None] * (len(choices) - 1) + ["length"]
    if dialect == "chat":
        calls = [c["delta"]["tool_calls"] for c, _ in choices if "tool_calls" in c["delta"]]
        assert len(calls) == 1 and calls[0][0]["function"]["name"] == "f"
        # the call's frame carries the last of the tokens that wrote it
        assert next(t for c, t in choices if "tool_calls" in c["delta"])[-1] == "t999 "
    else:
        assert "".join(c["text"] for c, _ in choices) == "t" * 9
    # each write a bounded part, built in an event-loop turn of its own
    assert max(entries_per_write) <= CAP
    assert all(a < b for a, b in zip(turns, turns[1:], strict=False))
