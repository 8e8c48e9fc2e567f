"""A distributed rank's start-up is bounded: a group that never comes up ends
each rank that waits for it, naming where it waited (model-free)."""

from __future__ import annotations

import logging
import threading

from engine.boot_deadline import BootDeadline


def _deadline(limit_s: float) -> tuple[BootDeadline, threading.Event, list[int]]:
    expired = threading.Event()
    codes: list[int] = []

    def expire(code: int) -> None:
        codes.append(code)
        expired.set()

    deadline = BootDeadline(expire, backstop=False)
    deadline.limit_s = limit_s  # read by the tests as start's argument
    return deadline, expired, codes


def test_a_start_up_that_never_finishes_exits_non_zero_naming_its_stage(caplog):
    deadline, expired, codes = _deadline(0.2)
    with caplog.at_level(logging.ERROR, logger="kvwarm.distributed"):
        deadline.start(deadline.limit_s)
        deadline.stage("loading its shard of the model")
        assert expired.wait(5)
    assert codes == [1]
    assert "did not come up within" in caplog.text
    assert "loading its shard of the model" in caplog.text


def test_a_rank_ready_in_time_is_left_alone():
    deadline, expired, codes = _deadline(0.3)
    deadline.start(deadline.limit_s)
    deadline.done()
    assert not expired.wait(0.6)
    assert codes == []


def test_no_limit_waits_for_ever():
    deadline, expired, _ = _deadline(0)
    deadline.start(deadline.limit_s)
    assert not expired.wait(0.3)
    assert not any(t.name == "kvwarm-boot-deadline" for t in threading.enumerate())


def test_a_boot_timeout_beyond_a_year_is_a_settings_error():
    """1e10 s overflowed faulthandler's time_t: a traceback at start, exit 1, and a
    supervisor restarting it; "for ever" is 0."""
    import pytest
    from pydantic import ValidationError

    from app.settings import Settings

    with pytest.raises(ValidationError, match="distributed_boot_timeout"):
        Settings(_env_file=None, distributed_boot_timeout=1e10)
    assert Settings(_env_file=None, distributed_boot_timeout=0).distributed_boot_timeout == 0
