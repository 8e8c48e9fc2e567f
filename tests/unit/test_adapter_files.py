"""Reading an adapter directory off the engine thread (engine.adapter_files):
what the engine is never handed, with no model loaded."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from engine.adapter_files import read_adapter_files
from scheduler.contracts import AdapterError, AdapterTooLarge

CONFIG = {"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 1.0}}


def adapter_dir(root: Path, weights: bytes | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps(CONFIG))
    if weights is not None:
        (root / "adapters.safetensors").write_bytes(weights)
    return root


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux's /proc")
def test_the_size_limit_holds_for_the_bytes_read_not_the_size_stat_reported(tmp_path):
    """The size was taken from stat() and the file read again by name: a file
    that grew between the two (here: one whose stat says 0 bytes) was read whole."""
    d = adapter_dir(tmp_path / "a")
    (d / "adapters.safetensors").symlink_to("/proc/self/maps")  # st_size 0, kilobytes long
    with pytest.raises(AdapterTooLarge, match="more than"):
        read_adapter_files(d, max_weights_bytes=64)


def test_a_fifo_in_place_of_the_weights_is_refused_not_waited_on(tmp_path):
    """Opened by name after an is_file() check, a FIFO swapped in meanwhile
    blocked the worker for good: the one open is non-blocking and checked."""
    d = adapter_dir(tmp_path / "a")
    os.mkfifo(d / "adapters.safetensors")
    caught: list[BaseException] = []

    def read() -> None:
        try:
            read_adapter_files(d, max_weights_bytes=1 << 20)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            caught.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the read blocked on the FIFO"
    assert len(caught) == 1 and isinstance(caught[0], AdapterError)
