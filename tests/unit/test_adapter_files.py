"""Reading an adapter directory off the engine thread (engine.adapter_files):
what the engine is never handed, with no model loaded."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest

from engine.adapter_files import MAX_TENSORS, read_adapter_files, tensor_cap
from scheduler.contracts import AdapterError, AdapterTooLarge
from tests.helpers.safetensors_bytes import one_element_tensors, safetensors

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


def test_a_valid_header_is_read(tmp_path):
    header = {
        "__metadata__": {"format": "mlx"},
        "model.layers.0.self_attn.q_proj.lora_a": {
            "dtype": "F32",
            "shape": [2, 1],
            "data_offsets": [0, 8],
        },
        "model.layers.0.self_attn.q_proj.lora_b": {
            "dtype": "BF16",
            "shape": [1, 2],
            "data_offsets": [8, 12],
        },
        "model.layers.0.self_attn.q_proj.m": {
            "dtype": "F16",
            "shape": [2],
            "data_offsets": [12, 16],
        },
    }
    files = read_adapter_files(adapter_dir(tmp_path / "a", safetensors(header, b"\0" * 16)))
    assert files.weights_size > 16


def test_more_tensors_than_the_model_has_room_for_are_refused_off_the_engine_thread(tmp_path):
    """mx.load of every tensor ran on the engine thread before any name was
    checked: 100k one-element tensors (8 MiB) stalled every stream for 5 s."""
    d = adapter_dir(tmp_path / "many", one_element_tensors(MAX_TENSORS + 1))
    with pytest.raises(AdapterError, match=f"more than the {MAX_TENSORS}"):
        read_adapter_files(d)
    # the model's own bound: a lora_a, lora_b and m per linear layer
    d = adapter_dir(tmp_path / "seven", one_element_tensors(7))
    assert read_adapter_files(d, max_tensors=tensor_cap(3)).weights_size > 0
    with pytest.raises(AdapterError, match="7 tensors, more than the 6"):
        read_adapter_files(d, max_tensors=tensor_cap(2))


@pytest.mark.parametrize(
    "header,data,match",
    [
        (
            {"t0.weight": {"dtype": "F16", "shape": [1, 1], "data_offsets": [0, 2]}},
            2,
            "not an adapter parameter",
        ),
        (
            {"x.lora_a": {"dtype": "I32", "shape": [1, 1], "data_offsets": [0, 4]}},
            4,
            "'x.lora_a' is I32, not a float",
        ),
        ({"x.lora_a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, "shape"),
        ({"x.m": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, 16, "shape"),
        (
            {"x.lora_a": {"dtype": "F32", "shape": [100000, 100000], "data_offsets": [0, 16]}},
            16,
            "bytes",
        ),
        (
            {"x.lora_a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 1 << 40]}},
            16,
            "offsets",
        ),
        ({"x.lora_a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, 8, "offsets"),
        ({"x.lora_a": {"dtype": "F32", "shape": [2, 2]}}, 16, "offsets"),
        ({"x.lora_a": [1, 2]}, 0, "not a readable safetensors file"),
        ({}, 0, "holds no tensors"),
    ],
)
def test_hostile_headers_are_refused_before_the_engine_sees_them(tmp_path, header, data, match):
    d = adapter_dir(tmp_path / "h", safetensors(header, b"\0" * data))
    with pytest.raises(AdapterError, match=match):
        read_adapter_files(d)


@pytest.mark.parametrize(
    "raw",
    [
        b"not a safetensors file",  # its first 8 bytes read as a length of petabytes
        struct.pack("<Q", 1 << 50) + b"{}",
        struct.pack("<Q", 4) + b"[1]x",
        struct.pack("<Q", 3),
        b"abc",
    ],
)
def test_unreadable_layouts_are_refused(tmp_path, raw):
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        read_adapter_files(adapter_dir(tmp_path / "r", raw))
