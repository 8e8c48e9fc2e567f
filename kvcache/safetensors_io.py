"""Safetensors files written and verified without MLX (any thread may run this).

The format is the public one (8-byte header length, JSON header, raw bytes),
so ``mx.load`` and the ``safetensors`` package read these files too. Each file
also carries, in its metadata, a CRC-32 of its header and data and the
namespace it was written for: a torn write, a flipped bit (in the tensors or in
the header, whose manifest names the tokens the KV was computed for) or a file
of another model or cache format is refused before any byte of it is used.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import numpy as np

DTYPES = {  # numpy dtype name -> safetensors dtype
    "float32": "F32",
    "float16": "F16",
    "float64": "F64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
}
NUMPY = {v: k for k, v in DTYPES.items()}
NUMPY["BF16"] = "uint16"  # numpy has no bfloat16: carried as its bits
MAX_HEADER = 64 * 2**20
# the file is not where it was written: damage, never undone by trying again. Any
# other OSError (EMFILE, EIO, EACCES, ENOMEM...) may pass and is raised as it is:
# taken for damage, one EMFILE deleted good files and the saves naming them
GONE = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
SLACK = 2**20  # past twice the bytes a file's arrays should take: it is no file of ours


def size_limit(data_bytes: int) -> int:
    """The largest file that can hold arrays of about ``data_bytes`` (the index's
    count of them): its header at most, and room to spare for the count's rounding."""
    return 8 + MAX_HEADER + 2 * data_bytes + SLACK


class CorruptFile(Exception):
    """A file that must not be used (torn, altered, or written for something else)."""


def encode(
    arrays: Mapping[str, np.ndarray],
    metadata: Mapping[str, str],
    bf16: frozenset[str] = frozenset(),
) -> list[bytes | memoryview]:
    """The file's parts in order: header then each array's bytes (no copies)."""
    header: dict[str, object] = {}
    parts: list[bytes | memoryview] = []
    offset = 0
    crc = 0
    for name, arr in arrays.items():
        # a flat byte view: memoryview.cast refuses a shape with a zero in it (an
        # entry whose length is a whole number of blocks has an empty tail)
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
        dtype = "BF16" if name in bf16 else DTYPES[arr.dtype.name]
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        crc = zlib.crc32(data, crc)
        parts.append(data)
    meta = {**metadata, "nbytes": str(offset)}
    header["__metadata__"] = meta
    meta["crc32"] = str(zlib.crc32(_unsigned(header), crc))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)), text, *parts]


def write_atomic(path: Path, parts: list[bytes | memoryview]) -> int:
    """Write to a temp file, fsync, rename: readers see the whole file or none."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
                size += len(part) if isinstance(part, bytes) else part.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) keeps no space
        raise
    return size


def sync_dir(folder: Path) -> None:
    """Make the renames into ``folder`` durable: a file's fsync keeps its bytes, not
    its name, and after a power loss an acknowledged entry or saved list could be
    gone. Best effort: some platforms and file systems cannot open or sync a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_regular(path: Path) -> tuple[IO[bytes], int]:
    """``path`` open for reading, and its size, if it is a regular file; else
    CorruptFile. A FIFO blocked the start-up scan in open() (O_NONBLOCK returns at
    once); a symlink to /dev/zero was read until memory ran out (O_NOFOLLOW: the
    file itself, never a folder above it, so a symlinked block shard still reads)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except GONE as exc:
        raise CorruptFile(f"{path.name}: unreadable: {exc}") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptFile(f"{path.name}: a symlink, not a file") from exc
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CorruptFile(f"{path.name}: not a regular file")
    return os.fdopen(fd, "rb"), info.st_size


def read_verified(
    path: Path, namespace: str, max_bytes: int | None = None
) -> tuple[dict[str, np.ndarray], dict[str, str], frozenset[str]]:
    """Arrays, metadata and the names stored as bfloat16; raises CorruptFile for
    damage (a file over ``max_bytes`` too), OSError for a read that may work later."""
    f, size = open_regular(path)
    with f:
        if max_bytes is not None and size > max_bytes:
            raise CorruptFile(f"{path.name}: {size} bytes, more than it can hold ({max_bytes})")
        raw = f.read(size + 1)  # a file grown since is caught by its byte count
    if len(raw) < 8:
        raise CorruptFile(f"{path.name}: truncated")
    (hlen,) = struct.unpack("<Q", raw[:8])
    if hlen > MAX_HEADER or 8 + hlen > len(raw):
        raise CorruptFile(f"{path.name}: truncated header")
    try:
        header = json.loads(raw[8 : 8 + hlen])
        meta = header["__metadata__"]
        want_crc, nbytes = int(meta.pop("crc32")), int(meta["nbytes"])
        signed = _unsigned(header)
        del header["__metadata__"]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        # RecursionError: JSON nested past Python's limit (damage, or a hostile file)
        raise CorruptFile(f"{path.name}: bad header: {exc}") from exc
    if meta.get("namespace") != namespace:
        raise CorruptFile(f"{path.name}: written for another model or cache format")
    data = memoryview(raw)[8 + hlen :]
    if data.nbytes != nbytes:
        raise CorruptFile(f"{path.name}: {data.nbytes} data bytes, header says {nbytes}")
    data_crc = zlib.crc32(data)
    # files written before the checksum covered the header hold their data's alone
    if want_crc not in (zlib.crc32(signed, data_crc), data_crc):
        raise CorruptFile(f"{path.name}: checksum mismatch")
    arrays: dict[str, np.ndarray] = {}
    bf16: set[str] = set()
    try:
        # tensors tile the data exactly, in order: names aliasing the same bytes
        # would make a small file load as many times its size
        spans = sorted((tuple(info["data_offsets"]), name) for name, info in header.items())
        end_of_last = 0
        for (start, end), name in spans:
            if start != end_of_last or end < start:
                raise ValueError(f"{name}'s bytes overlap another tensor's or leave a gap")
            end_of_last = end
        if end_of_last != nbytes:
            raise ValueError("the tensors do not cover the data")
        for name, info in header.items():
            start, end = info["data_offsets"]
            shape = [int(d) for d in info["shape"]]
            if any(not 0 <= d < 2**31 for d in shape):
                raise ValueError(f"{name}: shape {shape} out of range")
            dtype = np.dtype(NUMPY[info["dtype"]])
            arr = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
            arrays[name] = arr
            if info["dtype"] == "BF16":
                bf16.add(name)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFile(f"{path.name}: bad tensor entry: {exc}") from exc
    return arrays, meta, frozenset(bf16)


def _unsigned(header: dict[str, object]) -> bytes:
    """The header as the checksum covers it: written without its crc32 field.
    json keeps key order and writes these values (str, int, lists) the same way
    every time, so a reader re-serialising the parsed header gets these bytes."""
    return json.dumps(header, separators=(",", ":")).encode()
