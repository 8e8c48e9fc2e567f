"""What admission counts per cache type (no model: layouts as the loader reports them)."""

from __future__ import annotations

from kvcache.disk_budget import AUTO_CAP, resolve_disk_bytes
from kvcache.layout import GROWTH_SLACK, KVLayout, LayerKind, LayerKV
from scheduler.admission import AdmissionController, MemoryBudget

ATTN = LayerKV(LayerKind.ATTENTION, bytes_per_token=100)
WINDOW = LayerKV(LayerKind.WINDOW, bytes_per_token=100, window=1024)
STATE = LayerKV(LayerKind.STATE, state_bytes=50_000)


def budget(layout: KVLayout, kv_bytes: int, chunk: int = 512) -> MemoryBudget:
    return MemoryBudget(
        total_bytes=kv_bytes,
        weights_bytes=0,
        reserve_bytes=0,
        kv_bytes_per_token=layout.bytes_per_token,
        layout=layout,
        prefill_chunk=chunk,
    )


def test_each_kind_grows_as_its_cache_does():
    # a buffer grows by 256-position steps from wherever it stands, keeping an
    # unused tail when it grows from the grid: up to GROWTH_SLACK past
    assert ATTN.sequence_bytes(1000, 512) == 100 * (1000 + GROWTH_SLACK)
    assert ATTN.sequence_bytes(0, 512) == 0
    assert WINDOW.sequence_bytes(300, 512) == 100 * (300 + GROWTH_SLACK)
    assert WINDOW.sequence_bytes(100_000, 512) == 100 * (1024 + 512)  # window + one chunk
    assert STATE.sequence_bytes(10, 512) == STATE.sequence_bytes(100_000, 512) == 50_000


def test_the_ceiling_of_a_hybrid_model_counts_only_what_grows():
    hybrid = KVLayout((ATTN, STATE, STATE, WINDOW))
    b = budget(hybrid, kv_bytes=10_000_000)
    fixed = 2 * 50_000 + 100 * (1024 + 512)
    assert b.ceiling_tokens == ((10_000_000 - fixed) // 100 - GROWTH_SLACK) // 256 * 256
    plain = budget(KVLayout.attention_only(400), kv_bytes=10_000_000)
    assert plain.ceiling_tokens == (10_000_000 // 400 - GROWTH_SLACK) // 256 * 256
    assert not hybrid.trimmable and KVLayout((ATTN,)).trimmable
    assert hybrid.fingerprint() != KVLayout((ATTN, STATE, WINDOW, STATE)).fingerprint()


def test_admission_refuses_what_the_state_alone_cannot_hold():
    recurrent = KVLayout((STATE,) * 4)
    controller = AdmissionController(budget(recurrent, kv_bytes=450_000), 8192)
    assert controller.fits_with([8000], 8000)  # 2 x 200 kB of state, whatever the length
    assert not controller.fits_with([100, 100], 100)  # a third does not fit


def test_auto_disk_budget_is_a_share_of_free_space(tmp_path):
    assert resolve_disk_bytes(tmp_path, 123) == 123
    auto = resolve_disk_bytes(tmp_path / "kv", None)
    assert 0 < auto <= AUTO_CAP and (tmp_path / "kv").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert resolve_disk_bytes(blocker / "kv", None) == 0  # cannot be made: tier off


def test_the_auto_disk_budget_counts_what_the_tier_already_holds_as_free(tmp_path, monkeypatch):
    """A restart after the tier filled found that much less free space: the budget
    shrank and the restart deleted stored KV to fit it."""
    import shutil
    from collections import namedtuple

    disk = 16 * 2**20
    usage = namedtuple("usage", "total used free")
    root = tmp_path / "kv"

    def disk_usage(path):
        held = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        return usage(disk, held, disk - held)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    first = resolve_disk_bytes(root, None)
    assert first == disk // 4
    (root / "ns" / "blocks" / "ab").mkdir(parents=True)
    (root / "ns" / "blocks" / "ab" / "x.safetensors").write_bytes(b"\0" * first)
    assert resolve_disk_bytes(root, None) == first
