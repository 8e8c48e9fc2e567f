"""Lockstep replication without a model: the serving rank's runner calls reach a
worker's runner in order, at the serving rank's clock, and drift is caught."""

from __future__ import annotations

from collections import deque

import pytest

from engine.lockstep import Follower, LeaderRunner, LockstepError, TickClock
from scheduler.request import Request, RequestOutput
from scheduler.step_budget import SlicePlan


class RecordingRunner:
    """Records every call with the clock it saw; steps emit one token per row."""

    def __init__(self, clock: TickClock, cached: int = 3, fail_ids: tuple[str, ...] = ()):
        self.clock = clock
        self.cached = cached
        self.fail_ids = fail_ids
        self.calls: list[tuple] = []
        self.rows: list[str] = []
        self.recoverable = True
        self.token = 0
        self.closed = False

    @property
    def active(self) -> int:
        return len(self.rows)

    def add(self, request: Request) -> RequestOutput:
        self.calls.append(("add", request.request_id, self.clock()))
        if request.request_id in self.fail_ids:
            raise ValueError("bad request")
        self.rows.append(request.request_id)
        return RequestOutput(request.request_id, cached_tokens=self.cached)

    def remove(self, request_id: str) -> None:
        self.calls.append(("remove", request_id, self.clock()))
        self.rows.remove(request_id)

    def cut_short(self, request_id: str) -> None:
        self.calls.append(("cut_short", request_id, self.clock()))
        self.rows.remove(request_id)

    def plan_step(self) -> SlicePlan:
        return SlicePlan(slice_tokens=100 + len(self.calls))

    def step(self, plan: SlicePlan | None = None) -> list[RequestOutput]:
        self.calls.append(("step", plan.slice_tokens if plan else None, self.clock()))
        self.token += 1
        return [RequestOutput(r, token_ids=(self.token,)) for r in self.rows]

    def close(self) -> None:
        self.closed = True


def pair(**worker_kw):
    wire: deque[bytes] = deque()
    lead_clock, work_clock = TickClock(), TickClock()
    inner = RecordingRunner(lead_clock)
    leader = LeaderRunner(inner, wire.append, lead_clock)
    worker = RecordingRunner(work_clock, **worker_kw)
    follower = Follower(worker, wire.popleft, work_clock)
    return leader, inner, follower, worker


def req(rid: str) -> Request:
    return Request(prompt_tokens=[1, 2, 3], max_tokens=4, request_id=rid)


def test_worker_replays_every_change_in_order_at_the_serving_ranks_clock():
    leader, inner, follower, worker = pair()
    leader.add(req("a"))
    leader.add(req("b"))
    leader.step()
    leader.remove("a")
    leader.step()
    leader.cut_short("b")
    leader.close()
    follower.run()  # returns at the stop op
    assert worker.calls == inner.calls
    # the step ran with the slice the serving rank's budget chose, not its own
    assert [c[1] for c in worker.calls if c[0] == "step"] == [102, 104]
    assert inner.closed and not worker.recoverable and not inner.recoverable
    assert follower.ticks == 3


def test_a_request_the_serving_rank_refused_is_refused_on_the_worker_too():
    leader, inner, follower, worker = pair(fail_ids=("bad",))
    inner.fail_ids = ("bad",)
    with pytest.raises(ValueError):
        leader.add(req("bad"))
    leader.add(req("ok"))
    leader.step()
    leader.close()
    follower.run()
    assert worker.rows == ["ok"]


def test_a_worker_that_accepts_what_the_serving_rank_refused_stops_the_group():
    leader, inner, follower, _ = pair()
    inner.fail_ids = ("bad",)
    with pytest.raises(ValueError):
        leader.add(req("bad"))
    leader.step()
    with pytest.raises(LockstepError, match="failed to join on the serving rank"):
        follower.run()


def test_prefix_caches_that_disagree_stop_the_group():
    leader, _, follower, _ = pair(cached=0)
    leader.add(req("a"))
    leader.step()
    with pytest.raises(LockstepError, match="prefix caches disagree"):
        follower.run()


def test_a_worker_whose_step_produced_other_tokens_stops_the_group():
    leader, _, follower, worker = pair()
    leader.add(req("a"))
    leader.step()
    worker.token = 41  # its next step emits 42, the serving rank's 1
    leader.step()
    with pytest.raises(LockstepError, match="other tokens"):
        follower.run()


def test_a_serving_rank_whose_engine_died_stops_the_others_as_failed():
    """An orderly stop let the workers exit 0, so a supervisor restarting on failure
    restarted the serving rank alone, and it waited for workers that never came."""
    leader, _, follower, _ = pair()
    leader.add(req("a"))
    leader.step()
    leader.failure = "engine step failed: RuntimeError: boom"
    leader.close()
    with pytest.raises(LockstepError, match="serving rank's engine failed: engine step failed"):
        follower.run()
    leader, _, follower, _ = pair()
    leader.close()
    follower.run()  # an orderly stop returns


def test_a_broken_group_is_not_told_to_stop():
    wire: deque[bytes] = deque()
    clock = TickClock()
    leader = LeaderRunner(RecordingRunner(clock), wire.append, clock)
    leader.broken = True
    leader.close()
    assert not wire  # a broadcast would wait for the lost rank forever


def test_a_broadcast_that_finds_a_rank_gone_is_the_groups_loss():
    """The plan's broadcast is a collective too: a rank killed between steps
    fails it, and that must read as a lost rank, not a model fault."""
    clock = TickClock()
    timed: list[bool] = []

    sent: list[bytes] = []

    def lost(tick: bytes) -> None:
        sent.append(tick)
        raise RuntimeError("[ring] connection to a peer was lost")

    inner = RecordingRunner(clock)
    leader = LeaderRunner(inner, lost, clock, on_step=timed.append)
    with pytest.raises(LockstepError, match="rank of the distributed group was lost"):
        leader.step()
    assert not [c for c in inner.calls if c[0] == "step"]  # never ran alone
    assert timed == [True, False]  # the monitor timed the broadcast, then let go
    leader.close()
    assert len(sent) == 1  # no goodbye over the broken group: it could hang
    assert inner.closed


def test_unknown_bytes_are_refused():
    from engine.lockstep import decode, encode

    with pytest.raises(LockstepError):
        decode(encode(["not a tick"]))  # type: ignore[arg-type]


def test_bytes_that_would_run_code_are_refused_before_anything_runs(tmp_path):
    """decode unpickled whatever reached a rank, then checked it was a tick: bytes
    sent to a rank's (unauthenticated) ring port ran code there, as root."""
    import os
    import pickle

    from engine.lockstep import decode

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for payload in (Evil(), {"f": Evil()}):
        with pytest.raises(LockstepError):
            decode(pickle.dumps(payload))
    assert not marker.exists()


def test_a_full_tick_round_trips():
    from engine.lockstep import Op, Tick, decode, encode
    from kvcache.prompt_key import PromptKey
    from scheduler.request import CacheHints, SamplingParams

    key = PromptKey.build([1, 2, 3, 4])
    request = Request(
        [1, 2, 3, 4],
        5,
        SamplingParams(temperature=0.5, seed=3, logit_bias={7: 1.5}),
        stop=["x"],
        request_id="r1",
        cache=CacheHints(key, "s", ("h",)),
    )
    plan = SlicePlan(8, ("r1",), budgeted=True)
    tick = Tick((Op("add", 1.0, request=request, cached=2), Op("step", 2.0, plan=plan)), "ab")
    assert repr(decode(encode(tick))) == repr(tick)  # Request compares by identity


def test_a_budget_share_round_trips():
    """What ranks gather at start-up (engine.group_boot.tightest) reads back whole."""
    from engine import group_wire
    from kvcache.layout import KVLayout, LayerKind, LayerKV
    from scheduler.admission import MemoryBudget

    layout = KVLayout((LayerKV(LayerKind.WINDOW, 64, 512), LayerKV(LayerKind.STATE, state_bytes=9)))
    share = (MemoryBudget(10**9, 10**8, 10**7, 64, layout=layout), 1234)
    assert group_wire.loads(group_wire.dumps(share)) == share


def test_ranks_agree_on_the_software_before_anything_else():
    """Another mlx-lm may shard the model (and so talk) otherwise, another kvwarm
    send ticks of another form: found late, as a token digest mismatch or a hang."""
    from engine.boot_deadline import BootDeadline
    from engine.group_boot import GroupBoot, software_versions

    agreed: list[tuple[str, str]] = []

    class Group:
        boot = BootDeadline()

        def agree(self, what: str, value: str) -> None:
            agreed.append((what, value))

    GroupBoot(Group(), "auto", 10.0, TickClock()).check_same("fp", "settings")  # type: ignore[arg-type]
    assert agreed[0] == ("the software", software_versions())
    assert "mlx-lm=" in agreed[0][1] and "mlx=" in agreed[0][1]


def test_bytes_that_would_change_a_class_are_refused():
    """A class the reader allows was handed out whole: BUILD with slot state set
    its attributes process-wide (SamplingParams.temperature = "pwned")."""
    import pickle as p

    from engine import group_wire
    from scheduler.request import SamplingParams

    before = SamplingParams.temperature
    payload = (
        p.PROTO + bytes([4])
        + p.GLOBAL + b"scheduler.request\nSamplingParams\n"
        + p.NONE + p.EMPTY_DICT + p.SHORT_BINUNICODE + bytes([11]) + b"temperature"
        + p.SHORT_BINUNICODE + bytes([5]) + b"pwned" + p.SETITEM + p.TUPLE2
        + p.BUILD + p.POP + p.NONE + p.STOP
    )  # fmt: skip
    with pytest.raises(group_wire.UnsafeBytes):
        group_wire.loads(payload)
    assert SamplingParams.temperature == before


def test_bytes_that_would_change_an_enum_member_are_refused():
    """An enum member, reached by calling its class, is a process-wide singleton:
    BUILD on it set FinishReason.STOP's value for the whole rank."""
    import pickle as p

    from engine import group_wire
    from scheduler.request import FinishReason

    def text(s: str) -> bytes:
        return p.SHORT_BINUNICODE + bytes([len(s)]) + s.encode()

    state = p.EMPTY_DICT + text("_value_") + text("pwned") + p.SETITEM + p.BUILD + p.STOP
    head = p.PROTO + bytes([4]) + p.GLOBAL + b"scheduler.request\nFinishReason\n" + text("stop")
    # called (REDUCE), or "made" (NEWOBJ: Enum.__new__ hands back the existing member)
    for payload in (head + p.TUPLE1 + p.REDUCE + state, head + p.TUPLE1 + p.NEWOBJ + state):
        with pytest.raises(group_wire.UnsafeBytes):
            group_wire.loads(payload)
    assert FinishReason.STOP.value == "stop"
