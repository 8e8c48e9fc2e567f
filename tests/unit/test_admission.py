from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from app.settings import Settings
from kvcache.layout import GROWTH_SLACK
from scheduler.admission import (
    AdmissionController,
    ContextLengthExceeded,
    MemoryBudget,
    OverBudget,
    kv_bytes_per_token,
    round_up,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GB", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5g", int(1.5 * 10**9)),
        ("1024", 1024),
        ("2 GiB", 2 * 2**30),
        ("auto", None),
        ("AUTO", None),
    ],
)
def test_memory_budget_sizes(text, expected):
    assert Settings(_env_file=None, memory_budget=text).memory_budget_bytes == expected


@pytest.mark.parametrize(
    "text", ["", "lots", "-1GB", "0", "12XB", "GB", "75%", "1,5GB", "2GB of RAM", "8GB!"]
)
def test_memory_budget_rejects_garbage(text):
    """pydantic reads only a size's start: "75%" (what the help's "75% of RAM"
    invites) was 75 bytes and "1,5GB" one."""
    with pytest.raises(ValidationError):
        Settings(_env_file=None, memory_budget=text)


@pytest.mark.parametrize("field", ["prompt_cache_bytes", "kv_disk_bytes", "max_body_bytes"])
def test_every_size_setting_is_read_whole(field):
    """ "--prompt-cache-bytes 25%" served with a 25-byte prefix cache: nothing reused."""
    with pytest.raises(ValidationError, match="not a size"):
        Settings(_env_file=None, **{field: "25%"})
    assert getattr(Settings(_env_file=None, **{field: " 25 MiB "}), field) == 25 * 2**20


@pytest.mark.parametrize("value", ["0.4", "0.0001KB", ".5", " 0.9 b "])
@pytest.mark.parametrize("field", ["prompt_cache_bytes", "kv_disk_bytes"])
def test_a_size_that_rounds_to_no_bytes_is_refused(field, value):
    """--prompt-cache-bytes 0.4 was read as 0 bytes: the prefix cache quietly off
    (0 turns it off, said as 0)."""
    with pytest.raises(ValidationError, match="less than one byte"):
        Settings(_env_file=None, **{field: value})
    assert getattr(Settings(_env_file=None, **{field: "0"}), field) == 0
    assert getattr(Settings(_env_file=None, **{field: "0.0"}), field) == 0
    assert getattr(Settings(_env_file=None, **{field: "0.5KB"}), field) == 500


def test_kv_bytes_per_token_smollm2_float32():
    # 30 layers x 3 kv heads x 64 dims x (k and v) x 4 bytes
    assert kv_bytes_per_token(30, 3, 64, 4) == 46080


def budget(kv_tokens: int, per_token: int = 100) -> MemoryBudget:
    return MemoryBudget(
        total_bytes=10_000 + 1_000 + kv_tokens * per_token,
        weights_bytes=10_000,
        reserve_bytes=1_000,
        kv_bytes_per_token=per_token,
    )


def test_budget_split_and_ceiling():
    b = budget(1000)
    assert b.kv_budget_bytes == 100_000
    # whole 256-position steps, each with what a grown buffer may hold past them:
    # 256 + 510 fits 1000, 512 + 510 does not
    assert b.ceiling_tokens == 256


def test_never_fits_is_over_budget_and_names_the_ceiling():
    ctl = AdmissionController(budget(1024 + GROWTH_SLACK), context_length=100_000)
    ctl.check_ever_fits(24, 1000)
    with pytest.raises(OverBudget) as exc:
        ctl.check_ever_fits(24, 1001)
    assert exc.value.code == "context_over_budget" and exc.value.error_type == "memory_admission"
    assert "1024" in exc.value.message


def test_context_limit_checked_before_memory():
    ctl = AdmissionController(budget(10), context_length=2048)
    with pytest.raises(ContextLengthExceeded) as exc:
        ctl.check_ever_fits(2000, 49)
    assert exc.value.code == "context_length_exceeded"
    ctl_big = AdmissionController(budget(4096), context_length=2048)
    ctl_big.check_ever_fits(2000, 48)


def test_footprint_is_the_padded_rectangle():
    row = 1024 + GROWTH_SLACK  # 1000 positions: 4 steps, and what growth may add past them
    ctl = AdmissionController(budget(4 * row, per_token=1), context_length=10**6)
    # a long row makes every row as wide as it is
    assert ctl.footprint([1000, 10, 10]) == 3 * row
    assert ctl.fits_with([1000, 10, 10], 10)  # 4 rows of 1000: exactly fits
    assert not ctl.fits_with([1000, 10, 10, 10], 10)  # 5 do not
    # the same five short rows alone are cheap: only width counts, not the sum
    assert ctl.fits_with([10, 10, 10, 10], 10)
    assert ctl.footprint([]) == 0


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=16), st.integers(1, 5000))
def test_admitted_sets_never_exceed_budget(running, candidate):
    ctl = AdmissionController(budget(20_000, per_token=3), context_length=10**6)
    if ctl.fits_with(running, candidate):
        assert ctl.footprint([*running, candidate]) <= ctl.budget.kv_budget_bytes
    assert round_up(candidate) >= candidate


def test_a_context_overflow_has_anthropics_words_for_claude_code():
    """Claude Code retries with a smaller max_tokens on "input length and
    `max_tokens` exceed context limit: a + b > c", and compacts on "prompt is too
    long"; the numbers are what it parses."""
    from scheduler.admission import ContextLengthExceeded

    budget = MemoryBudget(total_bytes=10**9, weights_bytes=1, reserve_bytes=1, kv_bytes_per_token=1)
    admission = AdmissionController(budget, 4096)
    with pytest.raises(ContextLengthExceeded) as both:
        admission.check_ever_fits(4000, 500)
    assert both.value.anthropic_message == (
        "input length and `max_tokens` exceed context limit: 4000 + 500 > 4096, "
        "decrease input length or `max_tokens` and try again"
    )
    with pytest.raises(ContextLengthExceeded) as prompt:
        admission.check_ever_fits(5000, 1)
    assert prompt.value.anthropic_message == "prompt is too long: 5000 tokens > 4096 maximum"
    # a prompt of the whole context leaves no room for a reply: never "4096 > 4096"
    at_limit = ContextLengthExceeded("x", 4096, 4096)
    assert at_limit.anthropic_message == "prompt is too long: 4096 tokens > 4095 maximum"
