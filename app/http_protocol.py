"""uvicorn's h11 protocol with a deadline on request heads.

uvicorn never times out a request whose headers never finish (nor a connection
that sends nothing): its keep-alive timer stops at the first byte. A client
opening connections and trickling a header line now and then held each one,
and a file descriptor, for ever; enough of them and every agent is refused.
Here each connection gets ``--header-timeout`` seconds to deliver a complete
request head, counted from when it opened or its last response ended; past
that it is closed, as nginx's client_header_timeout does. The same deadline
covers the rest of a body the app answered without reading. Bodies being read
are bounded apart (``--body-timeout``, app/middleware.py).

The other direction too: a client that stops reading its responses fills the
send buffer, and the response's write waited for room for ever (its connection,
task and megabytes of buffer held). A write that makes no progress for the same
deadline aborts the connection, as nginx's send_timeout does.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import termios

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvwarm")
SO_NWRITE = 0x1024  # macOS: bytes in a socket's send queue
# each connection's kernel send buffer: autotuned it grew to megabytes, and a
# streaming client that stopped reading was seen stalled only once they were full
# (6,000 tokens generated for nobody, its batch slot and KV held all along);
# token streams need little, and a large reply still goes through, paced by the client
SEND_BUFFER = 64 * 1024


class HeadTimeoutProtocol(H11Protocol):
    head_timeout: float = 30.0

    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _unsent = 0  # bytes waiting in the send buffer when the write timer was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:  # not a socket that has one
                pass
        transport.set_write_buffer_limits(high=SEND_BUFFER // 4)  # and asyncio's own
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()  # the send buffer is full: the client must read
        self._arm_write_timer()

    def _arm_write_timer(self) -> None:
        self._cancel_write_timer()
        self._unsent = _unsent_bytes(self.transport)
        self._write_timer = self.loop.call_later(self.head_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        if _unsent_bytes(self.transport) < self._unsent:
            self._arm_write_timer()  # it reads, slowly: a slow reader is no stalled one
            return
        log.info(
            "aborting a connection from %s: it read nothing of its response in %g s",
            self._peer,
            self.head_timeout,
        )
        self.transport.abort()  # close() would wait for the buffer the client never reads

    def handle_events(self) -> None:
        super().handle_events()
        if self._serving():  # a whole head arrived: the request's own limits apply now
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # waiting for the next head (a pipelined one may already be served), or for the
        # rest of a body the app answered without reading: both are the client's to finish
        if not self._serving() and not self.transport.is_closing():
            self._arm_head_timer()

    @property
    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._serving():
            return
        log.debug(
            "closing a connection from %s: nothing complete from it in %g s (--header-timeout)",
            self._peer,
            self.head_timeout,
        )
        self.transport.close()


def _unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes of responses the client has not taken yet: the transport's buffer plus
    the socket's send queue (megabytes on loopback: a client reading slowly drains
    it long before the transport's buffer moves)."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is None:
        return unsent
    try:
        if sys.platform == "darwin":
            unsent += sock.getsockopt(socket.SOL_SOCKET, SO_NWRITE)
        else:
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            unsent += struct.unpack("i", raw)[0]
    except OSError:  # not a TCP socket, or a platform without either
        pass
    return unsent


def with_head_timeout(seconds: float) -> type[HeadTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=``: it builds each connection's instance."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": seconds})
