"""Files named by their content, remembered per (path, size, mtime, ctime, inode)
so a restart does not read gigabytes again. The change time too: ``cp -p``,
``rsync -t --inplace`` or ``curl -R`` over a file keep its size, mtime and inode,
and the old digest then named new weights (their old conversion, their old KV)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("kvwarm.engine")
CHUNK = 8 * 2**20
LOG_FROM = 2**30  # files this large say they are being read (it takes a while)


def content_digest(path: Path, memo_path: Path) -> str:
    """SHA-256 of ``path``'s bytes; ``memo_path`` keeps what earlier runs computed."""
    stat = path.stat()
    where = str(path.resolve())
    stamp = {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,  # no tool can set it back
        "inode": stat.st_ino,
    }
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the limit
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    known = memo.get(where)
    if isinstance(known, dict) and all(known.get(k) == v for k, v in stamp.items()):
        return str(known["sha256"])
    if stat.st_size >= LOG_FROM:
        log.info("reading %s (%.1f GiB) once to name its content", path, stat.st_size / 2**30)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    memo = {k: v for k, v in memo.items() if Path(k).exists()}  # files since deleted go
    memo[where] = {**stamp, "sha256": digest.hexdigest()}
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:
        pass  # a read-only cache still works: the file is hashed again next time
    return digest.hexdigest()
