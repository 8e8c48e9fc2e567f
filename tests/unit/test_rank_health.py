"""Noticing a lost rank over loopback sockets: closed, silent, stuck, never there."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from engine.rank_health import Heartbeat, RankMonitor, stall_limit


def wait_for(check, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


@pytest.fixture
def monitor():
    m = RankMonitor([1], timeout_s=0.5, bind="127.0.0.1")
    yield m
    m.close()


def beat(monitor: RankMonitor, lost: list[str]) -> Heartbeat:
    hb = Heartbeat("127.0.0.1", monitor.port, 1, monitor.timeout_s, lost.append, monitor.token)
    hb.start()
    return hb


def test_beating_ranks_are_healthy(monitor):
    worker_lost: list[str] = []
    lost: list[str] = []
    monitor.listen()
    monitor.start(lost.append)
    hb = beat(monitor, worker_lost)
    wait_for(lambda: 1 in monitor._seen)
    time.sleep(1.2)  # more than twice the timeout
    assert monitor.problem(time.monotonic()) is None and not lost
    assert not worker_lost  # the serving rank beats too
    hb.stop()


def test_a_rank_whose_process_exits_is_lost_at_once(monitor):
    lost: list[str] = []
    monitor.listen()
    monitor.start(lost.append)
    conn = socket.create_connection(("127.0.0.1", monitor.port))
    conn.sendall(f"rank 1 {monitor.token}\n.".encode())
    wait_for(lambda: 1 in monitor._seen)
    conn.close()  # what the kernel does when the process dies
    assert "connection closed" in wait_for(lambda: lost)[0]


def test_a_silent_rank_is_lost_after_the_timeout(monitor):
    lost: list[str] = []
    monitor.listen()
    monitor.start(lost.append)
    conn = socket.create_connection(("127.0.0.1", monitor.port))
    conn.sendall(f"rank 1 {monitor.token}\n".encode())  # then nothing: stopped (SIGSTOP) or wedged
    started = time.monotonic()
    reason = wait_for(lambda: lost)[0]
    assert "no heartbeat" in reason and "rank 1" in reason
    assert 0.4 < time.monotonic() - started < 2.0
    conn.close()


def test_a_step_that_never_finishes_counts_as_a_hang():
    monitor = RankMonitor([1], timeout_s=100, bind="127.0.0.1")
    monitor.stall_s = 5.0
    conn = socket.create_connection(("127.0.0.1", monitor.port))
    conn.sendall(f"rank 1 {monitor.token}\n".encode())
    monitor.listen()
    wait_for(lambda: 1 in monitor._seen)
    now = monitor._seen[1]
    monitor.step_running(True)
    since = monitor._step_since
    assert monitor.problem(since + 1) is None
    assert "has not finished" in monitor.problem(since + monitor.stall_s + 1)
    monitor.step_running(False)
    assert monitor.problem(now + monitor.stall_s + 1) is None
    conn.close()
    monitor.close()


def test_a_rank_that_never_connects_is_lost(monitor):
    assert monitor.problem(monitor._started + 1) is None
    assert monitor.problem(monitor._started + monitor.connect_s - 1) is None
    assert "never opened" in monitor.problem(monitor._started + monitor.connect_s + 1)


def test_strangers_are_turned_away(monitor):
    conn = socket.create_connection(("127.0.0.1", monitor.port))
    conn.sendall(f"rank 7 {monitor.token}\n".encode())
    monitor.listen()
    assert conn.recv(10) == b""  # closed on it
    assert 7 not in monitor._seen


def test_a_stray_hello_neither_takes_a_ranks_slot_nor_loses_it(monitor):
    """Any connection naming a rank took over its slot, and its closing declared
    the rank lost while the real worker still beat: the whole group went down."""
    lost: list[str] = []
    monitor.listen()
    monitor.start(lost.append)
    hb = beat(monitor, [])
    wait_for(lambda: 1 in monitor._seen)
    for hello in (b"rank 1\n", b"rank 1 wrong-token\n"):  # a probe, a stale process
        stray = socket.create_connection(("127.0.0.1", monitor.port))
        stray.sendall(hello)
        assert stray.recv(64) == b""  # turned away, told nothing
        stray.close()
    time.sleep(4 * monitor.timeout_s)
    assert monitor.problem(time.monotonic()) is None and not lost
    hb.stop()


def test_workers_tell_an_orderly_stop_from_a_lost_serving_rank(monitor):
    lost: list[str] = []
    monitor.listen()
    beat(monitor, lost)
    wait_for(lambda: 1 in monitor._seen)
    monitor.close()
    assert wait_for(lambda: lost) == ["the serving rank stopped"]


def serving_rank_at(server: socket.socket, lost: list[str]) -> socket.socket:
    """A worker's heartbeat connected to a bare socket that answers its hello as the
    serving rank's monitor does, then does nothing more (the test does the rest)."""
    hb = Heartbeat("127.0.0.1", server.getsockname()[1], 1, 0.5, lost.append, token="t")
    answered: list[socket.socket] = []

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(64)
        conn.sendall(b"kvwarm t\n.")  # a beat may follow the answer in the same read
        answered.append(conn)

    thread = threading.Thread(target=answer)
    thread.start()
    hb.start()
    thread.join(5)
    return answered[0]


def test_a_worker_notices_its_serving_rank_gone():
    server = socket.create_server(("127.0.0.1", 0))
    lost: list[str] = []
    conn = serving_rank_at(server, lost)
    conn.close()  # the serving process died
    assert "is gone" in wait_for(lambda: lost)[0]
    server.close()


def test_a_worker_notices_its_serving_rank_gone_silent():
    """A serving rank that hangs (SIGSTOP) or whose machine leaves the network closes
    nothing: the worker sat in its collective for ever, never exiting for a restart."""
    server = socket.create_server(("127.0.0.1", 0))
    lost: list[str] = []
    conn = serving_rank_at(server, lost)  # and never a byte more
    started = time.monotonic()
    reason = wait_for(lambda: lost)[0]
    assert "went silent" in reason and 0.4 < time.monotonic() - started < 2.0
    conn.close()
    server.close()


def test_a_worker_reaches_the_monitor_at_the_first_address_where_it_answers(monitor):
    """mpirun writes no hostfile: the serving rank sends its machine's addresses and
    the worker tries them; something else listening at one of them is passed over."""
    monitor.listen()
    stranger = socket.create_server(("127.0.0.2", monitor.port))  # the same port elsewhere

    def answer_wrongly() -> None:
        conn, _ = stranger.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    thread = threading.Thread(target=answer_wrongly)
    thread.start()
    only_it = Heartbeat(["127.0.0.2"], monitor.port, 1, 0.5, [].append, token=monitor.token)
    with pytest.raises(OSError, match="no serving rank's monitor answered"):
        only_it.start()
    thread.join(5)
    thread = threading.Thread(target=answer_wrongly)
    thread.start()
    hb = Heartbeat(["127.0.0.2", "127.0.0.1"], monitor.port, 1, 0.5, [].append, token=monitor.token)
    hb.start()
    wait_for(lambda: 1 in monitor._seen)
    thread.join(5)
    stranger.close()
    hb.stop()


def test_stall_limit_is_far_beyond_a_step():
    assert stall_limit(1.0) == 60.0 and stall_limit(30.0) == 180.0


def test_the_group_is_ready_only_when_every_worker_beats(monitor):
    monitor.listen()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not open"):
        monitor.connect_s = 0.3
        monitor.wait_connected()
    hb = beat(monitor, [])
    monitor.connect_s = 5.0
    monitor.wait_connected()  # returns once rank 1 said hello
    hb.stop()


def test_a_hello_split_over_two_segments_is_read_whole(monitor):
    """The hello was parsed from one recv: one split over two TCP segments (a slow
    link, Nagle) read as rank -1, and the worker was turned away."""
    monitor.listen()
    conn = socket.create_connection(("127.0.0.1", monitor.port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = f"rank 1 {monitor.token}\n".encode()
    conn.sendall(hello[:7])
    time.sleep(0.2)  # the monitor reads the first part alone
    conn.sendall(hello[7:])
    conn.settimeout(5)
    answer = conn.recv(64)  # the monitor's beats may follow the answer
    assert answer.partition(b"\n")[0] == f"kvwarm {monitor.token}".encode()
    wait_for(lambda: 1 in monitor._seen)
    conn.close()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def test_the_monitor_listens_on_the_port_it_is_given_and_says_when_it_is_taken():
    port = free_port()
    monitor = RankMonitor([1], timeout_s=0.5, bind="127.0.0.1", port=port)
    assert monitor.port == port
    with pytest.raises(OSError, match=rf"heartbeat port {port} .*in use.*--distributed-port"):
        RankMonitor([1], timeout_s=0.5, bind="127.0.0.1", port=port)
    monitor.close()


def test_the_serving_rank_sends_its_workers_the_fixed_heartbeat_port():
    """The port a worker connects to comes to it through the group (the ``where``
    broadcast); the serving rank's monitor listens on the group's fixed one."""
    from engine.boot_deadline import BootDeadline
    from engine.group_boot import GroupBoot
    from engine.lockstep import TickClock

    port = free_port()
    sent: list[bytes] = []
    workers: list[Heartbeat] = []

    class Group:
        boot, rank, size, serving = BootDeadline(), 0, 2, True

        def broadcast(self, data: bytes | None) -> bytes:
            sent.append(data or b"")
            worker = GroupBoot(Follower(data), "auto", 0.5, TickClock())  # type: ignore[arg-type]
            worker.follow()
            hb = Heartbeat(
                ["127.0.0.1"], worker.heartbeat_to, 1, 0.5, [].append, worker.monitor_token
            )
            hb.start()  # as the worker does once it heard
            workers.append(hb)
            return data or b""

    class Follower:
        boot, rank, size, serving = BootDeadline(), 1, 2, False

        def __init__(self, where: bytes | None):
            self.where = where

        def broadcast(self, data: bytes | None) -> bytes:
            return self.where or b""

    serving = GroupBoot(Group(), "auto", 0.5, TickClock(), monitor_port=port)  # type: ignore[arg-type]
    _, monitor = serving.lead(type("Runner", (), {})())
    assert monitor.port == port and sent[0].split()[0] == str(port).encode()
    assert workers[0]._port == port
    workers[0].stop()
    monitor.close()


class Dribbling:
    """A listener that answers a worker's hello a byte a second (on the test's
    clock), never ending its line."""

    def __init__(self, clock: list[float]):
        self.clock = clock
        self.timeout: float | None = None
        self.closed = False

    def settimeout(self, seconds: float | None) -> None:
        self.timeout = seconds

    def sendall(self, data: bytes) -> None:
        pass

    def recv(self, n: int) -> bytes:
        assert self.timeout is not None
        if self.timeout < 1:
            self.clock[0] += self.timeout
            raise TimeoutError("timed out")
        self.clock[0] += 1
        return b"k"

    def close(self) -> None:
        self.closed = True


def test_a_workers_wait_for_the_monitors_answer_has_one_deadline(monkeypatch):
    """The answer was read a recv at a time, each with the whole timeout: a
    listener dribbling a byte just inside it held the worker's start for 64 of
    them. It is read as the monitor reads a hello (_first_line): one deadline."""
    from engine import rank_health

    clock = [0.0]
    listener = Dribbling(clock)

    def connect(address, timeout):
        listener.settimeout(timeout)
        return listener

    monkeypatch.setattr(rank_health.socket, "create_connection", connect)
    monkeypatch.setattr(rank_health, "time", type("Clock", (), {"monotonic": lambda: clock[0]}))
    hb = Heartbeat("127.0.0.1", 1, 1, 0.5, [].append, token="t")
    with pytest.raises(OSError):
        hb._connect("127.0.0.1")
    assert clock[0] <= 5.0 + 0.01 and listener.closed  # max(timeout, 5 s) in all


def test_a_workers_socket_keeps_its_timeout_after_a_split_answer():
    """The answer split over two segments is read whole, and the socket beats
    on with its own timeout, not what was left of the answer's deadline."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.recv(64)
        conn.sendall(b"kvwa")
        time.sleep(0.2)  # the worker reads the first part alone
        conn.sendall(b"rm t\n.")
        conn.close()

    thread = threading.Thread(target=answer)
    thread.start()
    hb = Heartbeat("127.0.0.1", server.getsockname()[1], 1, 0.5, [].append, token="t")
    sock = hb._connect("127.0.0.1")
    thread.join(5)
    assert sock.gettimeout() == 5.0
    sock.close()
    server.close()
