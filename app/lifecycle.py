"""Running the server until it is told to stop, and stopping without cutting streams.

The first SIGTERM/SIGINT starts a drain: new requests get 503 + Retry-After and
/health turns 503, running ones get ``--shutdown-timeout`` seconds to finish,
whatever is left is then ended with its dialect's terminal error event, and the
process exits 0 once the streams have been written (1 if the engine thread was
then still busy in the step those requests were cut from). A second signal exits
at once, with 130 (SIGINT) or 143 (SIGTERM). If the engine thread dies, open
streams get their terminal event the same way and the process exits 1, so a
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from types import FrameType
from typing import NamedTuple

import uvicorn
from fastapi import FastAPI

from app.http_protocol import with_head_timeout
from app.settings import Settings
from scheduler.request import RequestOutput

log = logging.getLogger("kvwarm")

FLUSH_S = 5.0  # how long ended streams get to write their last event
GRACEFUL_CLOSE_S = 5  # then uvicorn's wait for open connections to close
POLL_S = 0.05


class Unbindable(NamedTuple):
    message: str
    lasting: bool  # a retry cannot help (no permission): a settings error, not a bad moment


def unbindable(host: str, port: int, flag: str = "--port") -> Unbindable | None:
    """Why the server could not listen on host:port, tried before the model loads
    (uvicorn binds only after the application's start-up, which loads it: a port
    in use was found minutes into a large model's load). None: it can. ``flag``:
    the setting that moves the port."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:  # the network may not be up yet at boot
        return Unbindable(f"cannot resolve --host {host!r}: {exc.strerror}", lasting=False)
    except UnicodeError:  # a name IDNA cannot encode: no later start encodes it either
        return Unbindable(f"--host {host!r} is no address or host name", lasting=True)
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return Unbindable(
                        f"port {port} on {host} is already in use (another kvwarm?): "
                        f"stop it or pick another {flag}",
                        lasting=False,
                    )
                return Unbindable(
                    f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                    lasting=exc.errno == errno.EACCES,  # a port < 1024 without the right
                )
    return None


def server_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """uvicorn's settings for ``kvwarm serve``: logging stays kvwarm's, and request
    heads get ``--header-timeout`` (app/http_protocol.py)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        http=with_head_timeout(settings.header_timeout),
    )


def stopping_s(shutdown_timeout: float) -> float:
    """The longest the server takes from a stop signal until its engine stops: the
    drain, the streams' last flush, then uvicorn's close of connections (a client
    that stopped reading holds the last two to their limits); a step in flight then
    ends. A distributed group's workers follow its stop signal this long."""
    return shutdown_timeout + FLUSH_S + GRACEFUL_CLOSE_S


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self.cut = False  # the drain ended requests before they finished
        self._failure: str | None = None  # why the engine died
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not uvicorn's: it re-raises the signal after shutdown (the process then
        # dies by SIGTERM, which a service manager reports as a crash)
        if self._stopping:
            # uvicorn's forced exit cancelled every connection (a traceback each),
            # still waited for the engine thread, and exited 0 as if stopped cleanly
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            from engine.engine_thread import exit_now

            exit_now(128 + sig)  # the shell's status for a process the signal ended
        if self._loop is None:  # not started yet: nothing is served, nothing to drain
            self.should_exit = self.force_exit = True
            return
        log.info(
            "%s: draining (new requests get 503; running ones have %.0fs to finish)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
        )
        self._begin(lambda: self._drain(self.shutdown_timeout))

    def engine_died(self, reason: str) -> None:
        """Called from the engine thread: end the process once streams are flushed."""
        self.exit_code = 1
        self._failure = reason
        if self._loop is None:  # died while loading: nothing is being served yet
            self.should_exit = True
            return
        try:
            self._loop.call_soon_threadsafe(self._begin, self._flush_and_exit)
        except RuntimeError:  # the loop closed meanwhile: the server is gone already
            self.should_exit = True

    def _begin(self, job) -> None:
        if self._stopping:
            return
        self._stopping = True
        assert self._loop is not None
        self._loop.create_task(job())

    async def _drain(self, timeout: float) -> None:
        state = getattr(self.app.state, "kvwarm", None)
        if state is not None:
            scheduler = state.service.scheduler
            scheduler.drain()
            # requests still arriving or being prepared too: they are answered (a 503
            # once they reach the draining scheduler), never cancelled mid-way
            http = getattr(self.app.state, "http_requests", None)
            deadline = time.monotonic() + timeout
            while (scheduler.in_flight() or (http is not None and http.open)) and (
                time.monotonic() < deadline
            ):
                await asyncio.sleep(POLL_S)
            left = scheduler.in_flight()
            if left:
                log.warning("shutdown: ending %d unfinished requests", left)
                self.cut = True
                scheduler.end_all()
        await self._flush_and_exit()

    async def _flush_and_exit(self) -> None:
        state = getattr(self.app.state, "kvwarm", None)
        if state is not None:
            router = state.service.router
            deadline = time.monotonic() + FLUSH_S
            while len(router) and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
            # the engine ends them only between two steps: one still in a long step
            # (a large prefill) would leave them to be cut by uvicorn's close, with
            # no terminal event; they get the engine's own end from here instead
            failure = self._failure
            ended = router.end_open(
                RequestOutput.shutdown
                if failure is None
                else lambda request_id: RequestOutput.failure(request_id, failure)
            )
            if ended:
                log.warning("shutdown: %d streams the engine has not ended: ended here", ended)
                self.cut = True
        self.should_exit = True

    def leave(self) -> int:
        """The exit status once ``run`` returned, or no return: with the engine thread
        still busy past the exit's wait for it (a model load, a long step), the
        interpreter's teardown waits on the C libraries' busy worker threads
        (OpenBLAS joins them, then std::terminate: SIGABRT, 134), so the process
        leaves at once; with 1 if the drain cut requests (queued KV writes are lost
        with the step: no clean stop), 0 if every request had ended by itself."""
        busy = getattr(self.app.state, "engine_left_busy", False)
        code = self.exit_code or (1 if busy and self.cut else 0)
        if self.exit_code:
            log.error("exiting with status %d: the engine died", code)
        elif code:
            log.error("exiting with status %d: requests were cut, the engine left in a step", code)
        if busy:
            from engine.engine_thread import exit_now

            exit_now(code)
        return code


def raise_open_files_limit(wanted: int = 65536) -> tuple[int, int]:
    """The soft limit on open files raised toward the hard one (old, new). Each
    connection is a file: at a service manager's default (256 under launchd,
    1024 on Linux) a client holding that many idle connections leaves none for
    other agents, and accept() fails."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= top:
        return (soft, soft)
    # macOS refuses more than kern.maxfilesperproc (61440 on small Macs) even under
    # an "unlimited" hard limit, and 10240 (OPEN_MAX) under some launchd setups
    for target in (top, 61440, 24576, 10240):
        if soft < target <= top:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                continue
            return (soft, target)
    return (soft, soft)
