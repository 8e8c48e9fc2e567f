"""Noticing a lost rank within a bounded time, outside the collectives.

A collective blocks until every rank joins it, so a rank that hangs (or a
serving rank idle between requests while a worker died) is invisible to
mlx.distributed itself. Each worker therefore keeps a TCP connection to the
serving rank, and each side writes a byte on it every ``timeout / 5`` seconds.
The serving rank declares a rank lost when its connection closes, when it stays
silent for ``timeout`` seconds, or when a step has not finished after ``stall_s``
(a rank alive but stuck in its engine). A worker declares the serving rank lost
the same way (closed, or silent for ``timeout``: a serving rank that hangs, or
whose machine left the network, closes nothing) and exits non-zero: a
supervisor then restarts the whole group.
"""

from __future__ import annotations

import errno
import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("kvwarm.distributed")
BYE = b"!"  # the serving rank stops in order: not a loss
BEAT = b"."


def beat_interval(timeout_s: float) -> float:
    """How often each side of a heartbeat connection writes: five beats a timeout."""
    return max(0.05, timeout_s / 5)


def stall_limit(timeout_s: float) -> float:
    """How long one engine step may run before the group counts as hung: steps
    are sized to about a second (--max-step-ms), a first full prefill chunk of
    a large model takes several; a minute is far beyond either."""
    return max(60.0, 6 * timeout_s)


class RankMonitor:
    """The serving rank's side: one heartbeat connection per worker rank."""

    def __init__(self, ranks: list[int], timeout_s: float, bind: str = "0.0.0.0", port: int = 0):
        self._ranks = ranks
        # said back to each worker's hello: the worker knows it reached this monitor,
        # not whatever else listens on that port at an address it tried
        self.token = secrets.token_hex(8)
        self.timeout_s = timeout_s
        self.stall_s = stall_limit(timeout_s)
        # how long a worker may take to open its connection once the port is sent
        self.connect_s = max(3 * timeout_s, 60.0)
        self._server = _listen(bind, port)
        self.port = self._server.getsockname()[1]
        self._seen: dict[int, float] = {}
        self._conns: dict[int, socket.socket] = {}
        self._gone: dict[int, str] = {}
        self._step_since: float | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._lost: Callable[[str], None] | None = None
        self._fired = False
        self._lock = threading.Lock()

    def listen(self) -> None:
        """Accept the workers' heartbeat connections (before the group is ready) and
        beat on each from then on, through model loading too."""
        threading.Thread(target=self._accept, name="kvwarm-ranks-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="kvwarm-ranks-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(beat_interval(self.timeout_s)):
            with self._lock:
                conns = list(self._conns.values())
            for conn in conns:
                try:
                    conn.sendall(BEAT)
                except OSError:
                    pass  # its reader notices the closed connection

    def start(self, on_lost: Callable[[str], None]) -> None:
        """Watch them: ``on_lost`` once, the moment one is lost."""
        self._lost = on_lost
        threading.Thread(target=self._watch, name="kvwarm-ranks-watch", daemon=True).start()

    def wait_connected(self) -> None:
        """Block until every worker's heartbeat connection is open: the group is
        ready only when each rank is. RuntimeError naming the missing ranks."""
        deadline = time.monotonic() + self.connect_s
        while time.monotonic() < deadline:
            if all(r in self._seen for r in self._ranks):
                return
            time.sleep(0.05)
        missing = [r for r in self._ranks if r not in self._seen]
        raise RuntimeError(
            f"rank(s) {missing} did not open a heartbeat connection in {self.connect_s:.0f}s"
        )

    def step_running(self, running: bool) -> None:
        self._step_since = time.monotonic() if running else None

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            # its first line; a beat may follow it in the same read
            words = _first_line(conn, self.timeout_s).decode(errors="replace").split()
            rank = int(words[1]) if len(words) == 3 and words[0] == "rank" else -1
        except (OSError, ValueError):
            conn.close()
            return
        # "rank N TOKEN": the token reached the workers through the group itself, so a
        # stray connection (a probe, a stale process) cannot take over a rank's slot,
        # and its closing declare that rank lost
        if rank not in self._ranks or words[2] != self.token:
            conn.close()
            return
        try:
            conn.settimeout(self.timeout_s)  # the hello's read left what remained of it
            conn.sendall(f"kvwarm {self.token}\n".encode())
        except OSError:
            conn.close()
            return
        with self._lock:
            self._conns[rank] = conn
            self._seen[rank] = time.monotonic()
        conn.settimeout(None)
        while not self._stop.is_set():
            try:
                data = conn.recv(256)
            except OSError:
                data = b""
            if not data:
                with self._lock:
                    current = self._conns.get(rank) is conn
                if current and not self._stop.is_set():
                    self._gone[rank] = "its connection closed (the process exited or crashed)"
                return
            self._seen[rank] = time.monotonic()

    def problem(self, now: float) -> str | None:
        """Why the group is broken (None: every rank is alive and keeping up)."""
        for rank in self._ranks:
            if rank in self._gone:
                return f"rank {rank} is lost: {self._gone[rank]}"
            seen = self._seen.get(rank)
            if seen is None:
                if now - self._started > self.connect_s:
                    return f"rank {rank} never opened its heartbeat connection"
            elif now - seen > self.timeout_s:
                return f"rank {rank} is lost: no heartbeat for {now - seen:.1f}s"
        since = self._step_since
        if since is not None and now - since > self.stall_s:
            return f"an engine step has not finished in {now - since:.0f}s: a rank hangs"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(min(0.25, self.timeout_s / 4)):
            reason = self.problem(time.monotonic())
            if reason is not None and not self._fired:
                self._fired = True
                log.error("distributed group broken: %s", reason)
                if self._lost is not None:
                    self._lost(reason)
                return

    def close(self) -> None:
        """An orderly stop: tell the workers it is not a loss."""
        self._stop.set()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.sendall(BYE)
                conn.close()
            except OSError:
                pass
        self._server.close()


def _listen(bind: str, port: int) -> socket.socket:
    """The monitor's socket on ``port`` (0: any free one), or OSError saying which
    port is taken and how to move it: a fixed port lets a firewall open it."""
    try:
        return socket.create_server((bind, port))
    except OSError as exc:
        why = (
            "is already in use (another group's, or another program's)"
            if exc.errno == errno.EADDRINUSE
            else f"cannot be listened on ({exc.strerror or exc})"
        )
        raise OSError(
            exc.errno,
            f"the heartbeat port {port} {why}: the serving rank listens on the port after "
            "the ring's (--distributed-port + world size); give each group its own ports",
        ) from exc


def _first_line(conn: socket.socket, timeout_s: float, limit: int = 128) -> bytes:
    """The bytes before the first newline, read until it comes, ``limit`` bytes or
    ``timeout_s`` in all (socket.timeout, an OSError): a hello split over two TCP
    segments read as nothing when one recv was all it got. The monitor reads a
    worker's hello so, and a worker the monitor's answer; the caller sets the
    socket's timeout again after it."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data and len(data) < limit:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = conn.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data.partition(b"\n")[0]


def own_addresses() -> list[str]:
    """This machine's addresses for the workers to try, loopback last: the serving
    rank cannot know which of its interfaces a worker's machine reaches."""
    import psutil

    found: list[str] = []
    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses if name in up else ():
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                found.append(a.address)
    return [*found, "127.0.0.1"]


class Heartbeat:
    """A worker's side: beat to the serving rank; notice when it is gone."""

    def __init__(
        self,
        hosts: str | Sequence[str],
        port: int,
        rank: int,
        timeout_s: float,
        on_lost: Callable[[str], None],
        token: str,
    ):
        self._hosts = [hosts] if isinstance(hosts, str) else list(dict.fromkeys(hosts))
        self._port = port
        self._token = token  # the serving monitor's: sent with the hello, and answered
        self._rank = rank
        self._interval = beat_interval(timeout_s)
        self._timeout_s = timeout_s
        self._on_lost = on_lost
        self._stop = threading.Event()
        self.orderly = False  # the serving rank said bye

    def start(self) -> None:
        """Connect to the first of the hosts where the serving rank's monitor answers
        (OSError naming them all if none does), then beat from a thread."""
        problems = []
        for host in self._hosts:
            try:
                sock = self._connect(host)
            except OSError as exc:
                problems.append(f"{host}: {exc}")
                continue
            threading.Thread(
                target=self._run, args=(sock,), name="kvwarm-heartbeat", daemon=True
            ).start()
            return
        raise OSError(
            f"no serving rank's monitor answered on port {self._port}: {'; '.join(problems)}"
        )

    def _connect(self, host: str) -> socket.socket:
        wait = max(self._timeout_s, 5.0)
        sock = socket.create_connection((host, self._port), timeout=wait)
        try:
            sock.sendall(f"rank {self._rank} {self._token}\n".encode())
            # one line within ``wait`` in all; the monitor's beats may follow it
            line = _first_line(sock, wait, 64)
            word, _, token = line.decode(errors="replace").strip().partition(" ")
            if word != "kvwarm" or token != self._token:
                raise OSError("something else listens there")
            sock.settimeout(wait)  # the answer's read left what remained of it
        except OSError:
            sock.close()
            raise
        return sock

    def _run(self, sock: socket.socket) -> None:
        heard = time.monotonic()
        reason = "the serving rank is gone (its heartbeat connection closed)"
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([sock], [], [], self._interval)
                if readable:
                    data = sock.recv(64)
                    if BYE in data:
                        self.orderly = True
                        reason = "the serving rank stopped"
                        break
                    if not data:
                        break
                    heard = time.monotonic()
                elif time.monotonic() - heard > self._timeout_s:
                    reason = (
                        f"the serving rank went silent for {time.monotonic() - heard:.1f}s "
                        "(it hangs, or its machine left the network)"
                    )
                    break
                sock.sendall(BEAT)
        except OSError:
            pass
        finally:
            sock.close()
        if not self._stop.is_set():
            self._on_lost(reason)

    def stop(self) -> None:
        self._stop.set()
