"""`kvwarm chat`'s turn bookkeeping and display, without a terminal or a server."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.chat_client import ChatClient, ChatError, Delta, Usage, sse_lines
from app.chat_repl import ChatRepl, ReplyPrinter, TurnStats, build_content


class _Client:
    base = "http://fake/v1"

    def __init__(self, events: list[Any], lookups: list[BaseException] | None = None) -> None:
        self.events = events
        self.lookups = lookups or []  # what each model lookup raises, in turn
        self.bodies: list[dict[str, Any]] = []

    def first_model(self) -> str:
        if self.lookups:
            raise self.lookups.pop(0)
        return "m"

    def stream(self, body: dict[str, Any]):
        self.bodies.append(body)
        yield from self.events


def test_a_reply_that_only_reasoned_keeps_the_question_in_the_history():
    """A thinking model cut off while reasoning (or Ctrl-C then) answered nothing:
    the question was dropped, and the next turn's "continue" had no context."""
    client = _Client([Delta(reasoning="thinking about France"), Usage(5, 0)])
    repl = ChatRepl(client, "m", 8, None, out=io.StringIO())  # type: ignore[arg-type]
    repl.turn("What is the capital of France?")
    assert repl.history == [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": ""},
    ]
    repl.turn("continue")
    assert [m["content"] for m in client.bodies[-1]["messages"]][0].startswith("What is")


def test_ctrl_c_while_the_model_is_looked_up_stays_in_the_repl(monkeypatch):
    """It escaped run(): the REPL exited 130 and the conversation was lost."""
    lines = iter(["hello", "/quit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    out = io.StringIO()
    client = _Client([], lookups=[ChatError("not up yet"), KeyboardInterrupt()])
    repl = ChatRepl(client, None, 8, None, out=out)  # type: ignore[arg-type]
    assert repl.run() == 0
    assert "[interrupted]" in out.getvalue()


def test_reasoning_ending_a_line_leaves_one_blank_line_in_colour_too():
    def screen(colour: bool) -> str:
        out = io.StringIO()
        printer = ReplyPrinter(out, colour)
        printer.write(Delta(reasoning="step 1\n"))
        printer.write(Delta(content="Answer"))
        printer.finish()
        return out.getvalue()

    coloured = screen(True)
    assert "step 1\n\x1b[0m\nAnswer" in coloured  # was "\n\x1b[0m\n\nAnswer"
    assert "step 1\n\nanswer: Answer" in screen(False)


def test_the_rate_counts_the_intervals_between_tokens():
    stats = TurnStats(start=0.0, first=1.0, last=2.0, chunks=2)
    assert "1.0 tok/s" in stats.line()  # two tokens one second apart (was 2.0)


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(301, headers={"location": "https://elsewhere/v1/chat/completions"}),
        httpx.Response(200, json={"choices": []}),
    ],
)
def test_a_redirect_or_a_reply_that_is_no_stream_is_an_error_not_an_empty_turn(response):
    client = ChatClient("localhost:1")
    client._http = httpx.Client(  # noqa: SLF001 - the transport is the seam here
        base_url=client.base, transport=httpx.MockTransport(lambda _request: response)
    )
    with pytest.raises(ChatError, match="not an event stream"):
        list(client.stream({"messages": []}))
    client.close()


class _CutStream(httpx.SyncByteStream):
    """A body that breaks off after its first event, as a dropped connection does."""

    def __iter__(self):
        yield b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


def _mock_client(response: httpx.Response) -> ChatClient:
    client = ChatClient("localhost:1")
    client._http = httpx.Client(  # noqa: SLF001 - the transport is the seam here
        base_url=client.base, transport=httpx.MockTransport(lambda _request: response)
    )
    return client


SSE = {"content-type": "text/event-stream"}


def test_a_connection_dropped_mid_reply_is_not_said_to_be_unreachable():
    """A Content-Length body cut short read "cannot reach http://...": the server
    had been reached and had started answering."""
    client = _mock_client(httpx.Response(200, headers=SSE, stream=_CutStream()))
    with pytest.raises(ChatError, match=r"^the connection closed mid-reply") as caught:
        list(client.stream({"messages": []}))
    assert "cannot reach" not in str(caught.value)
    client.close()


@pytest.mark.parametrize(
    ("body", "complete"),
    [
        (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n', False),
        (b'data: {"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]}\n\n', True),
        (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\ndata: [DONE]\n\n', True),
    ],
)
def test_a_stream_without_done_or_a_finish_reason_is_incomplete(body: bytes, complete: bool):
    client = _mock_client(httpx.Response(200, headers=SSE, content=body))
    if complete:  # a finish_reason is the end, even from a server that sends no [DONE]
        assert list(client.stream({"messages": []})) == [Delta(content="Hi")]
    else:
        with pytest.raises(ChatError, match="the stream ended before the reply was complete"):
            list(client.stream({"messages": []}))
    client.close()


@pytest.mark.parametrize(
    "chunk",
    [
        '{"choices": [null]}',
        '{"choices": [{"delta": "Hi"}]}',
        '{"choices": 5}',
        '{"choices": [], "usage": {"completion_tokens": "7", "prompt_tokens_details": 3}}',
        '{"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": "many"}}}',
    ],
)
def test_a_malformed_chunk_is_passed_over_not_a_traceback(chunk: str):
    """`{"choices": [null]}` was an AttributeError out of the REPL: exit 1, the
    conversation lost."""
    body = f'data: {chunk}\n\ndata: {{"choices": [{{"delta": {{"content": "Hi"}}}}]}}\n\n'
    client = _mock_client(httpx.Response(200, headers=SSE, content=body + "data: [DONE]\n\n"))
    events = list(client.stream({"messages": []}))
    assert Delta(content="Hi") in events
    for usage in (e for e in events if isinstance(e, Usage)):
        assert usage == Usage(completion_tokens=None, cached_tokens=0)
    client.close()


def test_a_line_input_could_not_decode_is_one_error_and_the_repl_stays(monkeypatch, capsys):
    lines: list[Any] = [UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "invalid"), "/quit"]

    def typed(_prompt: str) -> str:
        line = lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    monkeypatch.setattr("builtins.input", typed)
    repl = ChatRepl(_Client([]), "m", 8, None, out=io.StringIO())  # type: ignore[arg-type]
    assert repl.run() == 0
    assert "error: that line is not utf-8 text; nothing was sent" in capsys.readouterr().err


class _Chunks(httpx.SyncByteStream):
    """A body arriving in the given pieces, as a network delivers it."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks


def _chunk(content: str, finish: str | None = None) -> bytes:
    delta = {"choices": [{"delta": {"content": content}, "finish_reason": finish}]}
    return json.dumps(delta, ensure_ascii=False).encode()


def test_raw_unicode_line_separators_in_a_chunk_do_not_cut_it():
    """A server that sends U+2028, U+2029 or U+0085 unescaped (JSON allows it):
    iter_lines split the data line there, and the turn failed with "unreadable
    stream chunk". Only CR, LF and CRLF end an SSE line."""
    text = "one\u2028two\u2029three\u0085four"
    body = b"data: " + _chunk(text) + b"\n\ndata: " + _chunk("", "stop") + b"\n\n"
    client = _mock_client(httpx.Response(200, headers=SSE, content=body))
    assert list(client.stream({"messages": []})) == [Delta(content=text)]
    client.close()


def test_sse_lines_end_at_cr_lf_or_crlf_wherever_the_chunks_break():
    """A CRLF split between two reads is one line end, and a character's UTF-8
    bytes split between two reads are one character."""
    first, second = _chunk("h\u00e9\u2028"), _chunk("!", "stop")
    whole = b"data: " + first + b"\r\n\r\ndata: " + second + b"\r\rdata: [DONE]\n\n"
    cut = whole.index("\u00e9".encode()) + 1  # inside é
    crlf = whole.index(b"\r\n") + 1  # between CR and LF
    stream = _Chunks(whole[:cut], whole[cut:crlf], whole[crlf:])
    client = _mock_client(httpx.Response(200, headers=SSE, stream=stream))
    assert list(client.stream({"messages": []})) == [
        Delta(content="h\u00e9\u2028"),
        Delta(content="!"),
    ]
    client.close()


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("a \r\n\u2028\u0085\u00e9\U0001f600")),
    cuts=st.lists(st.integers(min_value=0), max_size=6),
)
def test_sse_lines_do_not_depend_on_where_the_body_is_cut(text: str, cuts: list[int]):
    body = text.encode()
    at = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    pieces = [body[a:b] for a, b in zip(at, at[1:])] + [b""]  # an empty read too
    expected = re.split(r"\r\n|\r|\n", text)
    if expected[-1] == "":  # a body ending in a line end has no line after it
        expected.pop()
    assert list(sse_lines(pieces)) == expected


def _typing(monkeypatch, typed: list[Any]) -> list[str]:
    """input() gives ``typed`` in turn (an exception is raised, as Ctrl-C or
    Ctrl-D would); returns the prompts shown."""
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        item = typed.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    monkeypatch.setattr("builtins.input", read)
    return prompts


def _sent(client: _Client) -> list[list[Any]]:
    return [[m["content"] for m in b["messages"] if m["role"] == "user"] for b in client.bodies]


def test_a_triple_quoted_block_is_one_message_kept_as_typed(monkeypatch):
    """A pasted snippet was one request per line, each stripped of its indentation."""
    typed = ['"""', "Review this:", "def f(x):", '    """Doc."""', "    return x+1", ""]
    typed += ["/reset", '    """', '"""', "/quit"]
    prompts = _typing(monkeypatch, typed)
    client = _Client([Delta(content="ok"), Usage(1, 0)])
    assert ChatRepl(client, "m", 8, None, out=io.StringIO()).run() == 0  # type: ignore[arg-type]
    block = 'Review this:\ndef f(x):\n    """Doc."""\n    return x+1\n\n/reset\n    """'
    assert _sent(client) == [[block]]
    assert prompts == ["> "] + ["... "] * 8 + ["> "]


def test_a_line_ending_in_a_backslash_goes_on_to_the_next(monkeypatch):
    _typing(monkeypatch, ["  first \\", "  second\\", "third  ", "/reset\\", "x", "/quit"])
    client = _Client([Delta(content="ok"), Usage(1, 0)])
    assert ChatRepl(client, "m", 8, None, out=io.StringIO()).run() == 0  # type: ignore[arg-type]
    assert _sent(client) == [
        ["  first \n  second\nthird  "],
        ["  first \n  second\nthird  ", "/reset\nx"],
    ]


def test_ctrl_c_at_the_prompt_drops_the_line_or_block_and_keeps_the_conversation(monkeypatch):
    """Ctrl-C at the prompt left the REPL, and the conversation with it."""
    typed = ["hello", KeyboardInterrupt(), '"""', "a draft", KeyboardInterrupt(), "more \\"]
    typed += [KeyboardInterrupt(), "again", "/quit"]
    prompts = _typing(monkeypatch, typed)
    client = _Client([Delta(content="ok"), Usage(1, 0)])
    repl = ChatRepl(client, "m", 8, None, out=io.StringIO())  # type: ignore[arg-type]
    assert repl.run() == 0
    assert _sent(client) == [["hello"], ["hello", "again"]]
    assert prompts == ["> ", "> ", "> ", "... ", "... ", "> ", "... ", "> ", "> "]


@pytest.mark.parametrize("typed", [["hi", EOFError()], ["hi", '"""', "unfinished", EOFError()]])
def test_ctrl_d_leaves_even_in_an_open_block(monkeypatch, typed: list[Any]):
    _typing(monkeypatch, typed)
    client = _Client([Delta(content="ok"), Usage(1, 0)])
    assert ChatRepl(client, "m", 8, None, out=io.StringIO()).run() == 0  # type: ignore[arg-type]
    assert _sent(client) == [["hi"]]


def test_image_words_leave_the_rest_of_a_message_as_typed(tmp_path):
    (tmp_path / "x.png").write_bytes(b"\x89PNG")
    text = f"look at  image:{tmp_path}/x.png this\n    def f():\n        pass  \n"
    assert build_content(text) == [
        {"type": "text", "text": "look at this\n    def f():\n        pass  "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}},
    ]
    assert build_content("  as typed  \n") == "  as typed  \n"
