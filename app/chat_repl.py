"""`kvwarm chat`: a terminal REPL against any OpenAI-compatible server.

Replies stream as they arrive, reasoning apart from the answer, and each turn ends
with one stats line (TTFT, tokens/s, cached prompt tokens), which is what you want
to watch when you are checking a server's prefix cache by hand.
"""

from __future__ import annotations

import argparse
import base64
import io
import mimetypes
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
from dotenv import dotenv_values

from app.chat_client import ChatClient, ChatError, Delta, Usage
from app.chat_input import read_typed

HELP = (
    '""" alone on a line opens or closes a message of several lines, \\ ending a line goes on · '
    "image:PATH attaches an image · /reset or Ctrl-N: new conversation · "
    "/quit, /exit or Ctrl-D: leave · Ctrl-C drops the line or stops a reply"
)
CTRL_N = "\x0e"
# SGR codes: reasoning dim cyan, stats dim, errors red
REASONING_STYLE, STATS_STYLE, ERROR_STYLE = "2;36", "2", "31"

Content = str | list[dict[str, Any]]


IMAGE_WORD = re.compile(r"(?<!\S)image:(\S+)")


def build_content(text: str) -> Content:
    """The user message for typed text, kept as typed: `image:PATH` words become
    image parts (a line that held one keeps its indentation, its other words
    joined by single spaces).

    Raises ChatError for an image that cannot be read, so the turn is not sent.
    """
    paths = IMAGE_WORD.findall(text)
    if not paths:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if IMAGE_WORD.search(line):
            indent = line[: len(line) - len(line.lstrip())]
            words = IMAGE_WORD.sub("", line).split()
            lines[i] = indent + " ".join(words) if words else ""
    text = "\n".join(lines).strip("\n")
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text.strip() else []
    for path in paths:
        parts.append({"type": "image_url", "image_url": {"url": image_data_url(path)}})
    return parts


def image_data_url(path: str) -> str:
    file = Path(path).expanduser()
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ChatError(f"cannot read image {file}: {exc.strerror or exc}") from exc
    mime = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def clean_text(text: str) -> str:
    """``text`` as UTF-8 can carry it: bytes that were not UTF-8 (held as surrogates
    by surrogateescape) become U+FFFD; httpx cannot encode surrogates into a body."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def style(text: str, code: str, enabled: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if enabled else text


class ReplyPrinter:
    """Prints a streamed reply: a `thinking:` block (coloured on a TTY), then the answer."""

    def __init__(self, out: TextIO, colour: bool) -> None:
        self.out, self.colour = out, colour
        self.mode: str | None = None  # "reasoning" or "content": the block being written
        self.answer = ""
        self._line_open = False

    def write(self, delta: Delta) -> None:
        if delta.reasoning:
            if self.mode != "reasoning":
                self._start_block("reasoning", style("thinking: ", REASONING_STYLE, self.colour))
            # Each fragment carries its own reset, so an interrupted reply leaves no colour on.
            self._emit(style(delta.reasoning, REASONING_STYLE, self.colour), delta.reasoning)
        if delta.content:
            if self.mode != "content":
                # Without colour a label is what keeps the answer apart from the reasoning.
                label = "answer: " if self.mode and not self.colour else ""
                self._start_block("content", label)
            self.answer += delta.content
            self._emit(delta.content)

    def finish(self) -> None:
        if self._line_open:
            self._emit("\n")

    def _start_block(self, mode: str, label: str) -> None:
        if self.mode is not None:
            self.finish()
            self._emit("\n")  # a blank line between the thinking block and the answer
        self.mode = mode
        self._emit(label)

    def _emit(self, text: str, plain: str | None = None) -> None:
        """Write ``text``; ``plain``: it without its colour codes (whether a line
        is left open is read there: the reset code ends every coloured text)."""
        if text:
            self.out.write(text)
            self.out.flush()
            self._line_open = not (plain if plain is not None else text).endswith("\n")


@dataclass
class TurnStats:
    start: float
    first: float | None = None  # first reasoning or content token
    last: float | None = None
    chunks: int = 0
    usage: Usage | None = None

    def token(self) -> None:
        now = time.perf_counter()
        self.first = self.first if self.first is not None else now
        self.last = now
        self.chunks += 1

    def line(self) -> str:
        usage = self.usage
        tokens = self.chunks
        if usage is not None and usage.completion_tokens is not None:
            tokens = usage.completion_tokens
        ttft = "–"
        rate = "–"
        if self.first is not None and self.last is not None:
            ttft = f"{self.first - self.start:.2f}"
            if self.last > self.first and tokens > 1:  # the intervals after the first token
                rate = f"{(tokens - 1) / (self.last - self.first):.1f}"
        cached = usage.cached_tokens if usage is not None else 0
        return f"[ttft {ttft} s · {rate} tok/s · {tokens} tokens · cached {cached}]"


def setup_readline() -> None:
    """Line editing and history; Ctrl-N types `/reset` and submits it."""
    try:
        import readline
    except ImportError:  # no readline (Windows): `/reset` still works
        return
    if "libedit" in (readline.__doc__ or ""):  # macOS's system Python uses editline
        readline.parse_and_bind("bind -s ^N ^A^K/reset^J")
    else:
        # A macro: go to the line start, kill the line, type /reset, press Enter.
        readline.parse_and_bind(r'"\C-n": "\C-a\C-k/reset\n"')


class ChatRepl:
    def __init__(
        self,
        client: ChatClient,
        model: str | None,
        max_tokens: int,
        system: str | None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.client, self.model = client, model
        self.max_tokens, self.system = max_tokens, system
        self.out = out
        self.colour = out.isatty() and "NO_COLOR" not in os.environ
        self.history: list[dict[str, Any]] = []

    def run(self) -> int:
        if sys.stdin.isatty():
            setup_readline()
        if isinstance(sys.stdin, io.TextIOWrapper):
            # a line that is not UTF-8 (a Latin-1 terminal, a file) is kept as
            # surrogates for clean_text, not a UnicodeDecodeError that loses the buffer
            sys.stdin.reconfigure(errors="surrogateescape")
        if self.model is None:
            try:
                self.model = self.client.first_model()
            except ChatError as exc:  # the server may come up later: retried each turn
                self.error(f"{exc} (will retry on the next message)")
        self.print(f"kvwarm chat · {self.client.base} · model {self.model or '?'}")
        self.print(style(HELP, STATS_STYLE, self.colour))
        while True:
            try:
                typed = read_typed(lambda prompt: clean_text(input(prompt)))
            except EOFError:  # Ctrl-D
                self.print("")
                return 0
            except KeyboardInterrupt:  # Ctrl-C drops the line or block, as Python's REPL does
                self.print("")
                continue
            except UnicodeDecodeError as exc:  # a stdin that could not be reconfigured
                self.error(f"that line is not {exc.encoding} text; nothing was sent")
                continue
            # stripped only to be recognised: a message is sent as typed
            command = typed.text.strip() if typed.one_line else ""
            if command in ("/quit", "/exit"):
                return 0
            if command == "/reset" or CTRL_N in typed.text:  # raw ^N: no readline
                self.history.clear()
                self.print(style("(new conversation)", STATS_STYLE, self.colour))
            elif command == "/help":
                self.print(HELP)
            elif command.startswith("/") and " " not in command:
                self.error(f"unknown command {command}; {HELP}")
            elif typed.text.strip():
                try:
                    self.turn(typed.text)
                except KeyboardInterrupt:  # while it looked the model up or read an image
                    self.print(style("[interrupted]", STATS_STYLE, self.colour))

    def turn(self, text: str) -> None:
        try:
            user = {"role": "user", "content": build_content(text)}
            self.model = model = self.model or self.client.first_model()
        except ChatError as exc:
            self.error(str(exc))
            return
        system = [{"role": "system", "content": self.system}] if self.system else []
        body = {
            "model": model,
            "messages": system + self.history + [user],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = self._stream_reply(body)
        # a failed turn is forgotten; an interrupted one, or one that only reasoned
        # (its answer cut off), keeps the question and what was answered
        if answer is not None:
            self.history += [user, {"role": "assistant", "content": answer}]

    def _stream_reply(self, body: dict[str, Any]) -> str | None:
        printer = ReplyPrinter(self.out, self.colour)
        stats = TurnStats(start=time.perf_counter())
        stream = self.client.stream(body)
        try:
            for event in stream:
                if isinstance(event, Usage):
                    stats.usage = event
                else:
                    stats.token()
                    printer.write(event)
        except ChatError as exc:
            printer.finish()
            self.error(str(exc))
            return None
        except KeyboardInterrupt:
            printer.finish()
            self.print(style("[interrupted]", STATS_STYLE, self.colour))
        finally:
            stream.close()  # drops the connection, so the server stops generating
        printer.finish()
        self.print(style(stats.line(), STATS_STYLE, self.colour))
        return printer.answer

    def print(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def error(self, message: str) -> None:
        self.out.flush()  # keep the order the two streams were written in
        colour = sys.stderr.isatty() and "NO_COLOR" not in os.environ
        print(style(f"error: {message}", ERROR_STYLE, colour), file=sys.stderr, flush=True)


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
# a server bound to every interface is reached over loopback
BIND_ALL = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def _dotenv() -> dict[str, str | None]:
    """./.env, where the server reads its settings; one this user may not read (the
    server's, mode 600) is passed over: flags and the environment still work."""
    try:
        return dotenv_values(".env")
    except OSError:
        return {}


def _setting(name: str, dotenv: dict[str, str | None]) -> tuple[str, str] | None:
    """A KVWARM_* value as the server reads it (environment over ./.env, blank is
    unset) and where it was found."""
    if value := os.environ.get(name, "").strip():
        return value, "the environment"
    if value := (dotenv.get(name) or "").strip():
        return value, "./.env"
    return None


def server_address(flag: str | None) -> tuple[str, str]:
    """The server to talk to, and where that came from ("" for --host): --host, else
    the KVWARM_HOST/KVWARM_PORT the server beside it reads, else 127.0.0.1:8080."""
    if flag:
        return flag, ""
    dotenv = _dotenv()
    host, port = _setting("KVWARM_HOST", dotenv), _setting("KVWARM_PORT", dotenv)
    if port and "://" in port[0]:  # Kubernetes' service link, which the server ignores
        port = None
    name = (host[0] if host else DEFAULT_HOST).removeprefix("[").removesuffix("]")
    name = BIND_ALL.get(name, name)
    name = f"[{name}]" if ":" in name else name  # an IPv6 address, as a URL writes it
    found = {n: v[1] for n, v in (("KVWARM_HOST", host), ("KVWARM_PORT", port)) if v}
    places = set(found.values())
    if not found:
        origin = "the default; --host names another"
    elif len(places) == 1:  # "from KVWARM_HOST and KVWARM_PORT in ./.env"
        origin = f"from {' and '.join(found)} in {places.pop()}"
    else:
        origin = "from " + " and ".join(f"{n} in {where}" for n, where in found.items())
    return f"{name}:{port[0] if port else DEFAULT_PORT}", origin


def run_chat(args: argparse.Namespace) -> int:
    """Entry point of `kvwarm chat` (flags defined in app/cli.py)."""
    # the server's own .env holds the key it requires: read where the server reads it
    api_key = (
        args.api_key
        or os.environ.get("KVWARM_API_KEY")
        or _dotenv().get("KVWARM_API_KEY")
        or os.environ.get("OPENAI_API_KEY")
    )
    host, origin = server_address(args.host)
    try:
        client = ChatClient(host, api_key, origin)
    except (httpx.InvalidURL, ValueError) as exc:  # "localhost:80a": a usage error
        named = f"{host!r} ({origin})" if origin else f"--host {host!r}"
        print(f"kvwarm: error: {named}: {exc}", file=sys.stderr)
        return 2
    try:
        model, system = (clean_text(t) if t else t for t in (args.model, args.system))
        return ChatRepl(client, model, args.max_tokens, system).run()
    except KeyboardInterrupt:  # e.g. while the start-up model lookup waits
        return 130
    finally:
        client.close()
