"""`kvwarm chat` driven the way a person uses it: typed into a pseudo-terminal.

A small fake OpenAI-compatible server (http.server in a thread) streams a reasoning
delta, content deltas and a usage chunk, and records every request body; the REPL
runs as `python -m app.cli chat` on a pty, and the tests read its screen.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.chat_client import base_url
from tests.helpers.http_server import free_port

ROOT = Path(__file__).resolve().parents[2]
STATS = re.compile(r"\[ttft \d+\.\d\d s · \d+\.\d tok/s · 7 tokens · cached 1024\]")
REASONING = "pondering the question"


# --- the fake server ---------------------------------------------------------------------


@dataclass
class FakeOpenAI:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)


def _last_user_text(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAI  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.fake.bodies.append(body)
        self.fake.auth.append(self.headers.get("Authorization"))
        text = _last_user_text(body)
        if "fail" in text:
            error = {
                "message": "prompt is too long for this model",
                "type": "invalid_request_error",
                "code": "context_over_budget",
            }
            self._json(400, {"error": error})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        turn = sum(1 for m in body["messages"] if m["role"] == "user")

        def delta(**d: str) -> dict[str, Any]:
            return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}

        try:
            if "slow" in text:  # streams until the client hangs up
                self._event(delta(role="assistant", content="starting"))
                for _ in range(300):
                    time.sleep(0.1)
                    self._event(delta(content="."))
                return
            if "cut" in text:  # the connection closes before [DONE]: a crashed server
                self._event(delta(role="assistant", content="a partial"))
                return
            time.sleep(0.05)  # a measurable TTFT
            # both spellings servers use: `reasoning_content`, and `reasoning` on even turns
            key = "reasoning" if turn % 2 == 0 else "reasoning_content"
            self._event(delta(role="assistant", **{key: REASONING}))
            for piece in ["Hello", ", this is", f" reply {turn}"]:
                time.sleep(0.02)
                self._event(delta(content=piece))
            usage = {
                "prompt_tokens": 1100,
                "completion_tokens": 7,
                "total_tokens": 1107,
                "prompt_tokens_details": {"cached_tokens": 1024},
            }
            if "no usage" not in text:
                self._event({"object": "chat.completion.chunk", "choices": [], "usage": usage})
            self._event("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            self.fake.disconnected.set()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    handler = type("Handler", (_Handler,), {"fake": fake})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield fake
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def fake(fake_server: FakeOpenAI) -> FakeOpenAI:
    fake_server.bodies.clear()
    fake_server.auth.clear()
    fake_server.disconnected.clear()
    return fake_server


# --- the terminal ------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


KVWARM_CLIENT_VARIABLES = ("KVWARM_API_KEY", "OPENAI_API_KEY", "KVWARM_HOST", "KVWARM_PORT")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KVWARM_CLIENT_VARIABLES}
    env.pop("NO_COLOR", None)
    # INPUTRC=/dev/null: the tester's own ~/.inputrc must not change the key bindings
    env.update(TERM="xterm", INPUTRC="/dev/null", PYTHONUTF8="1", **extra)
    return env


class Terminal:
    """`kvwarm chat` on a pseudo-terminal: type keys, wait for text on the screen."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "app.cli", "chat", *args]
        pid, fd = pty.fork()
        if pid == 0:  # the child: nothing but exec
            try:
                os.chdir(ROOT)
                os.execve(sys.executable, argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.raw = b""
        self.pos = 0  # expect() searches the screen from here
        self.status: int | None = None

    @property
    def screen(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child has exited and the pty is closed
            data = b""
        self.raw += data
        return bool(data)

    def expect(self, text: str, timeout: float = 20) -> str:
        """Wait until `text` appears after the previous match; return the screen."""
        deadline = time.monotonic() + timeout
        while (found := self.screen.find(text, self.pos)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{text!r} not on the screen:\n{self.screen[-3000:]}")
        self.pos = found + len(text)
        return self.screen

    def expect_re(self, pattern: re.Pattern[str], timeout: float = 20) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (match := pattern.search(self.screen, self.pos)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{pattern.pattern!r} not on screen:\n{self.screen[-3000:]}")
        self.pos = match.end()
        return match

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def line(self, text: str) -> None:
        """Wait for the prompt, then type a line and press Enter."""
        self.expect("> ")
        self.type(text + "\r")

    def exited(self, within: float) -> bool:
        """Whether the program ends within ``within`` seconds (its status kept)."""
        deadline = time.monotonic() + within
        while self.status is None and time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                break
            self._read(0.05)
        return self.status is not None

    def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                break
            assert time.monotonic() < deadline, f"did not exit:\n{self.screen[-3000:]}"
            self._read(0.05)  # keep draining so the child never blocks on a full pty
        return self.status

    def close(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture
def chat(fake: FakeOpenAI) -> Iterator[Any]:
    """Start `kvwarm chat` against the fake server: chat("--model", "m", env=...)."""
    terminals: list[Terminal] = []

    def start(*args: str, host: str | None = None, **env: str) -> Terminal:
        term = Terminal(["--host", host or fake.url, *args], child_env(**env))
        terminals.append(term)
        return term

    yield start
    for term in terminals:
        term.close()


def user_turns(body: dict[str, Any]) -> list[Any]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


# --- the tests ---------------------------------------------------------------------------


def test_a_turn_streams_reasoning_apart_then_the_answer_and_a_stats_line(chat, fake) -> None:
    term = chat("--model", "m")
    term.line("hello there")
    stats = term.expect_re(STATS)
    screen = term.screen

    assert (
        "> hello there\nthinking: pondering the question\n\nHello, this is reply 1\n[ttft" in screen
    )
    # On a terminal the reasoning is coloured (dim cyan), the answer is not.
    assert f"\x1b[2;36m{REASONING}\x1b[0m" in term.raw.decode()
    assert "\x1b[2;36mHello" not in term.raw.decode()
    assert float(stats.group(0).split()[1]) >= 0.04  # the fake server waits 50 ms
    assert fake.bodies == [
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 1024,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]
    term.line("/quit")
    assert term.wait() == 0


def test_the_second_turn_sends_the_history(chat, fake) -> None:
    term = chat("--model", "m", "--system", "be brief", "--max-tokens", "64")
    term.line("first question")
    term.expect_re(STATS)
    term.line("second question")
    term.expect_re(STATS)
    assert "thinking: pondering the question\n\nHello, this is reply 2\n" in term.screen

    assert [b["max_tokens"] for b in fake.bodies] == [64, 64]
    assert fake.bodies[1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        # the answer only: reasoning is shown, not sent back
        {"role": "assistant", "content": "Hello, this is reply 1"},
        {"role": "user", "content": "second question"},
    ]


def test_image_words_become_image_parts(chat, fake, tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n not really an image"
    jpg = b"\xff\xd8\xff another one"
    (tmp_path / "x.png").write_bytes(png)
    (tmp_path / "y.jpg").write_bytes(jpg)
    term = chat("--model", "m", HOME=str(tmp_path))
    term.line(f"image:{tmp_path}/x.png describe this image:~/y.jpg please")
    term.expect_re(STATS)

    (content,) = user_turns(fake.bodies[0])
    assert content == [
        {"type": "text", "text": "describe this please"},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()},
        },
        {
            "type": "image_url",
            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpg).decode()},
        },
    ]


def test_a_missing_image_is_an_error_and_nothing_is_sent(chat, fake) -> None:
    term = chat("--model", "m")
    term.line("image:/nonexistent/nope.png what is this")
    term.expect("error: cannot read image /nonexistent/nope.png: No such file or directory")
    term.line("hello")
    term.expect_re(STATS)

    assert [user_turns(b) for b in fake.bodies] == [["hello"]]


def test_reset_and_ctrl_n_start_a_new_conversation(chat, fake) -> None:
    term = chat("--model", "m")
    term.line("one")
    term.expect_re(STATS)
    term.line("/reset")
    term.expect("(new conversation)")
    term.line("two")
    term.expect_re(STATS)
    term.line("three")
    term.expect_re(STATS)
    term.expect("> ")
    term.type("half typed\x0e")  # Ctrl-N drops the half-typed line and resets
    term.expect("(new conversation)")
    term.line("four")
    term.expect_re(STATS)

    assert [user_turns(b) for b in fake.bodies] == [["one"], ["two"], ["two", "three"], ["four"]]


def test_an_http_error_is_printed_and_the_repl_goes_on(chat, fake) -> None:
    term = chat("--model", "m")
    term.line("please fail")
    term.expect("error: HTTP 400 Bad Request: prompt is too long for this model\n")
    term.line("hello")
    term.expect("reply 1")  # the failed turn is not part of the conversation
    term.expect_re(STATS)

    assert [user_turns(b) for b in fake.bodies] == [["please fail"], ["hello"]]


def test_ctrl_c_stops_a_streaming_reply(chat, fake) -> None:
    term = chat("--model", "m")
    term.line("go slow")
    term.expect("starting")
    term.type("\x03")
    term.expect("[interrupted]")
    term.expect_re(re.compile(r"\[ttft \d+\.\d\d s"))
    assert fake.disconnected.wait(10), "the server kept streaming to a closed connection"
    term.line("and now?")
    term.expect_re(STATS)

    history = fake.bodies[1]["messages"]
    assert history[0] == {"role": "user", "content": "go slow"}
    assert history[1]["role"] == "assistant" and history[1]["content"].startswith("starting")
    term.line("/exit")
    assert term.wait() == 0


@pytest.mark.parametrize("keys", ["/quit\r", "/exit\r", "\x04"], ids=repr)
def test_quit_exit_and_ctrl_d_at_the_prompt_exit_0(chat, fake, keys: str) -> None:
    term = chat("--model", "m")
    term.expect("> ")
    term.type(keys)
    assert term.wait() == 0
    assert "Traceback" not in term.screen


def test_ctrl_c_at_the_prompt_drops_the_line_and_the_repl_stays(chat, fake) -> None:
    """Ctrl-C at the prompt left the REPL, and the conversation was lost."""
    term = chat("--model", "m")
    term.line("one")
    term.expect_re(STATS)
    term.expect("> ")
    # the SIGINT goes once readline waits for keys: "half" echoed says it does
    term.type("half")
    term.expect("half")
    term.type("\x03")
    term.line('"""')  # a fresh prompt; then the same in an open block
    term.expect("... ")
    term.type("draft\r")
    term.expect("... ")
    term.type("more")
    term.expect("more")
    term.type("\x03")
    term.line("two")
    term.expect_re(STATS)
    term.line("/quit")
    assert term.wait() == 0
    assert [user_turns(b) for b in fake.bodies] == [["one"], ["one", "two"]]


def test_model_from_the_server_and_api_key_from_the_environment(chat, fake) -> None:
    host = fake.url.removeprefix("http://")  # host:port, no scheme, no /v1
    term = chat(host=host, KVWARM_API_KEY="sekrit")
    term.expect("model fake-model")
    term.line("hi")
    term.expect_re(STATS)

    assert fake.bodies[0]["model"] == "fake-model"
    assert fake.auth == ["Bearer sekrit"]


def test_the_api_key_from_the_servers_dotenv_file(fake, tmp_path) -> None:
    """`kvwarm serve` reads KVWARM_API_KEY from ./.env: `kvwarm chat` run beside
    it got 401 for a key it was told it would find there."""
    (tmp_path / ".env").write_text("KVWARM_API_KEY=from-dotenv\n")
    result = piped_chat(fake, "hello\n/quit\n", cwd=tmp_path, PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert fake.auth == ["Bearer from-dotenv"]


def test_an_unreachable_server_is_one_line_and_the_repl_stays(chat, fake) -> None:
    port = free_port()  # nothing listens there
    term = chat("--model", "m", host=f"127.0.0.1:{port}")
    term.line("hello")
    term.expect(f"error: cannot reach http://127.0.0.1:{port}/v1:")
    term.line("/quit")
    assert term.wait() == 0


def piped_chat(fake: FakeOpenAI, typed: str, cwd: Path = ROOT, host: str | None = None, **env: str):
    """`kvwarm chat` with its input from a pipe, not a terminal; host "": no --host."""
    host = fake.url if host is None else host
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", *(["--host", host] if host else []), "--model"]
        + ["m"],
        input=typed,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=child_env(**env),
        timeout=60,
    )


def test_without_a_terminal_the_blocks_are_labelled_and_uncoloured(fake) -> None:
    result = piped_chat(fake, "hello\nno usage please\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert "thinking: pondering the question\n\nanswer: Hello, this is reply 1\n" in result.stdout
    assert STATS.search(result.stdout)
    # no usage chunk: the stats count the streamed chunks (1 reasoning + 3 answer)
    assert re.search(r"reply 2\n\[ttft \S+ s · \S+ tok/s · 4 tokens · cached 0\]", result.stdout)
    assert "\x1b" not in result.stdout


def test_a_pasted_snippet_is_one_message_with_its_indentation(fake) -> None:
    """Each line of a paste was its own request, stripped of its indentation."""
    typed = '"""\nReview:\ndef f(x):\n    return x + 1\n"""\nand this \\\n  two\n/quit\n'
    result = piped_chat(fake, typed)
    assert result.returncode == 0, result.stderr
    first = "Review:\ndef f(x):\n    return x + 1"
    assert [user_turns(b) for b in fake.bodies] == [[first], [first, "and this \n  two"]]


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1:8080", "http://127.0.0.1:8080/v1"),
        ("http://box:9000/", "http://box:9000/v1"),
        ("https://api.openai.com/v1", "https://api.openai.com/v1"),
        ("http://proxy/openai/v1/", "http://proxy/openai/v1"),
    ],
)
def test_host_forms(host: str, url: str) -> None:
    assert base_url(host) == url


def test_a_dotenv_it_may_not_read_is_passed_over(monkeypatch) -> None:
    """The server's .env (mode 600, another user's) made `kvwarm chat` a traceback:
    the key can still come from --api-key or the environment."""
    from app import chat_repl

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(chat_repl, "dotenv_values", unreadable)
    assert chat_repl._dotenv() == {}


@pytest.mark.parametrize("host", ["localhost:80a", "http://[::1"])
def test_a_malformed_host_is_a_usage_error_not_a_traceback(host: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", "--host", host],
        input="/quit\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("kvwarm: error: --host")


def test_a_stream_cut_short_is_an_error_and_no_part_of_the_conversation(fake) -> None:
    """A server that closed the stream without `data: [DONE]` (it crashed, a proxy
    timed out) looked like a finished turn: a normal stats line, and the partial
    answer went into the history sent with every later turn."""
    result = piped_chat(fake, "cut short\nhello\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert "error: the stream ended before the reply was complete" in result.stderr
    assert "a partial\n[ttft" not in result.stdout
    assert fake.bodies[1]["messages"] == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("io_encoding", ["", "utf-8:strict"], ids=["utf8-mode", "strict"])
def test_a_line_that_is_no_utf8_is_sent_with_replacement_characters(fake, io_encoding) -> None:
    """`printf 'h\\xe9llo'` (a Latin-1 terminal, a file) was a traceback and exit 1,
    the conversation lost: surrogates httpx could not encode (UTF-8 mode), or a
    UnicodeDecodeError out of input() (a strict stdin)."""
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "chat", "--host", fake.url, "--model", "m"]
        + ["--system", os.fsdecode(b"be br\xe9f")],
        input=b"h\xe9llo\nsecond\n/quit\n",
        capture_output=True,
        cwd=ROOT,
        env=child_env(PYTHONIOENCODING=io_encoding),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert b"Traceback" not in result.stderr
    assert [user_turns(b) for b in fake.bodies] == [["h\ufffdllo"], ["h\ufffdllo", "second"]]
    assert fake.bodies[0]["messages"][0] == {"role": "system", "content": "be br\ufffdf"}


def test_the_servers_address_from_its_dotenv_file(fake, tmp_path) -> None:
    """`kvwarm chat` read the key from the server's ./.env but not its port: a server
    on KVWARM_PORT=9000 there gave "cannot reach 127.0.0.1:8080"."""
    port = fake.url.rsplit(":", 1)[1]
    (tmp_path / ".env").write_text(f"KVWARM_HOST=0.0.0.0\nKVWARM_PORT={port}\n")
    result = piped_chat(fake, "hello\n/quit\n", cwd=tmp_path, host="", PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert f"kvwarm chat · http://127.0.0.1:{port}/v1 ·" in result.stdout
    assert [user_turns(b) for b in fake.bodies] == [["hello"]]


def test_an_unreachable_server_says_where_its_address_came_from(fake, tmp_path) -> None:
    port = free_port()  # nothing listens there
    (tmp_path / ".env").write_text(f"KVWARM_PORT={port}\n")
    result = piped_chat(fake, "hello\n/quit\n", cwd=tmp_path, host="", PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    where = f"cannot reach http://127.0.0.1:{port}/v1 (from KVWARM_PORT in ./.env):"
    assert f"error: {where}" in result.stderr


@pytest.mark.parametrize(
    ("environ", "dotenv", "address", "origin"),
    [
        ({}, "", "127.0.0.1:8080", "the default"),
        ({}, "KVWARM_HOST=::\nKVWARM_PORT=9000", "[::1]:9000", "from KVWARM_HOST and KVWARM_PORT"),
        ({}, "KVWARM_HOST=[::1]\nKVWARM_PORT=", "[::1]:8080", "from KVWARM_HOST in ./.env"),
        ({"KVWARM_PORT": "9001"}, "KVWARM_PORT=9000", "127.0.0.1:9001", "in the environment"),
        ({"KVWARM_HOST": "box.lan"}, "", "box.lan:8080", "from KVWARM_HOST in the environment"),
        # Kubernetes' service link, which the server passes over as well
        ({"KVWARM_PORT": "tcp://10.0.0.5:8080"}, "", "127.0.0.1:8080", "the default"),
    ],
)
def test_the_address_as_the_server_reads_it(
    environ, dotenv, address, origin, tmp_path, monkeypatch
) -> None:
    from app.chat_repl import server_address

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(dotenv)
    for name in KVWARM_CLIENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    found = server_address(None)
    assert found[0] == address and origin in found[1]
    assert server_address("http://elsewhere:1") == ("http://elsewhere:1", "")
