"""A GGUF file's key/value header and tensor table, and why the converter would
refuse it, read without its tensor data and without mlx.

/library and ``kvwarm fit`` price a GGUF from this; ``resolve_model`` refuses one
from it before the file is hashed and loaded (engine.gguf_convert), so both say
the same thing about the same file.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.gguf_archs import (
    ARCHS,
    MOE_WHY,
    ROPE_FREQS,
    ROPE_FREQS_WHY,
    split_file,
    tensor_problem,
    unreadable_types,
)
from engine.model_errors import NotAModel, UnsupportedModelError

_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGML_MAX_DIMS = 4
_MAX_NESTING = 2  # an array of arrays at most (llama.cpp writes none deeper)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    numel: int
    ttype: int  # ggml type (engine.gguf_archs.GGML_TYPES)


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict[str, Any]  # scalars and strings; arrays are None (present, not read)
    tensors: list[GGUFTensor]

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", "?"))

    def arch_int(self, key: str, default: int = 0) -> int:
        """``{arch}.{key}`` when it is a plausible count, else ``default``."""
        value = self.meta.get(f"{self.arch}.{key}")
        if isinstance(value, (int, float)) and 0 <= value < 2**40:
            return int(value)
        return default

    def shape(self) -> dict[str, int]:
        """The config fields an architecture's ``extra`` reads (Gemma's attention scale)."""
        heads = self.arch_int("attention.head_count", 1) or 1
        return {
            "num_hidden_layers": self.arch_int("block_count"),
            "num_attention_heads": heads,
            "head_dim": self.arch_int(
                "attention.key_length", self.arch_int("embedding_length") // heads
            ),
            "hidden_size": self.arch_int("embedding_length"),
        }


class _Reader:
    """A bounds-checked reader: every count is checked against the bytes left in
    the file before anything is read or allocated for it."""

    def __init__(self, f: BinaryIO, size: int):
        self.f = f
        self.size = size

    def read(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        data = self.f.read(n)
        if len(data) != n:
            raise NotAModel("truncated GGUF header")
        return struct.unpack(fmt, data)[0]

    def count(self, min_item_bytes: int, what: str) -> int:
        n = int(self.read("<Q"))
        if n * min_item_bytes > self.size - self.f.tell():
            raise NotAModel(f"GGUF {what} count {n} runs past the end of the file")
        return n

    def value(self, vtype: int, keep: bool, depth: int = 0) -> Any:
        if vtype in _GGUF_SCALARS:
            return self.read(_GGUF_SCALARS[vtype])
        if vtype == 8:
            raw = self.f.read(self.count(1, "string length"))
            return raw.decode("utf-8", "replace") if keep else None
        if vtype == 9:
            if depth >= _MAX_NESTING:
                raise NotAModel("GGUF arrays nested too deep")
            itype = self.read("<I")
            if itype in _GGUF_SCALARS:
                width = struct.calcsize(_GGUF_SCALARS[itype])
                self.f.seek(self.count(width, "array") * width, 1)  # skipped
                return None
            for _ in range(self.count(8, "array")):  # strings / arrays: 8 bytes at least
                self.value(itype, False, depth + 1)
            return None
        raise NotAModel(f"unknown GGUF value type {vtype}")


def _numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of ``path``; NotAModel when it is none (or a corrupt one)."""
    with open(path, "rb") as f:
        r = _Reader(f, path.stat().st_size)
        if f.read(4) != b"GGUF":
            raise NotAModel(f"{path}: not a GGUF file")
        version = r.read("<I")
        if version < 2:
            raise NotAModel(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = r.count(24, "tensor"), r.count(12, "key/value")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.value(8, True)
            meta[key] = r.value(r.read("<I"), True)
        tensors = []
        for _ in range(n_tensors):
            name = r.value(8, True)
            n_dims = r.read("<I")
            if n_dims > _GGML_MAX_DIMS:
                raise NotAModel(f"{path}: a tensor of {n_dims} dimensions")
            numel = _numel(r.read("<Q") for _ in range(n_dims))
            ttype = r.read("<I")
            r.read("<Q")  # offset
            tensors.append(GGUFTensor(name, numel, ttype))
    return GGUFHeader(meta, tensors)


def gguf_problem(header: GGUFHeader) -> str | None:
    """Why serve would refuse this GGUF, as far as its header tells: what the
    converter refuses, said before it hashes and loads the whole file."""
    name = header.arch
    arch = ARCHS.get(name)
    if arch is None:
        return f"GGUF architecture {name!r} is not converted"
    meta = header.meta
    rope_freqs = any(t.name == f"{ROPE_FREQS}.weight" for t in header.tensors)
    problem = (
        split_file(meta.get("split.count"))
        or unreadable_types({t.ttype for t in header.tensors})
        or (ROPE_FREQS_WHY if rope_freqs and name != "llama" else None)  # llama: Llama 3.1+
    )
    if problem is not None:
        return problem
    for key in (f"{name}.attention.head_count", "tokenizer.ggml.tokens"):
        if key not in meta:
            return f"its metadata has no {key}"
    # a mixture of experts is named as such, whichever of its tensors comes first
    refused = [p for t in header.tensors if (p := tensor_problem(t.name, arch))]
    if refused:
        return MOE_WHY if MOE_WHY in refused else refused[0]
    try:
        arch.extra(lambda key, default: meta.get(f"{name}.{key}", default), header.shape())
    except UnsupportedModelError as exc:
        return str(exc)
    except (TypeError, ValueError, OverflowError, KeyError):
        pass  # metadata no model has: the converter says what it lacks
    return None
