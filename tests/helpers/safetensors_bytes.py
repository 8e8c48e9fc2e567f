"""Safetensors files written byte by byte (no MLX): valid ones and hostile ones."""

from __future__ import annotations

import json
import struct


def safetensors(header: dict, data: bytes = b"") -> bytes:
    """A safetensors file as the format lays it out: 8-byte length, JSON, data."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def one_element_tensors(count: int, leaf: str = "lora_a") -> bytes:
    """``count`` float16 tensors of one element each, named as adapter leaves."""
    header = {
        f"model.layers.{i}.x.{leaf}": {
            "dtype": "F16",
            "shape": [1, 1],
            "data_offsets": [2 * i, 2 * i + 2],
        }
        for i in range(count)
    }
    return safetensors(header, b"\0" * (2 * count))


def safetensors_of_size(size: int) -> bytes:
    """One float16 adapter tensor in a file of ``size`` bytes or a few more."""
    elements = max(1, (size - 200) // 2)
    while True:
        header = {
            "x.lora_a": {"dtype": "F16", "shape": [1, elements], "data_offsets": [0, 2 * elements]}
        }
        raw = safetensors(header, b"\0" * (2 * elements))
        if len(raw) >= size:
            return raw
        elements += 1
