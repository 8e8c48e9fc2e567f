"""What the ranks of a distributed group compare at start: the same model files,
or they refuse to start (a group of mixed files hangs or serves a mix)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.loader import group_fingerprint, model_fingerprint
from tests.helpers.tiny_models import write_tiny_llama


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_stop_tokens_and_the_middle_of_the_weights_count(tiny_llama_dir, tmp_path):
    base = group_fingerprint(tiny_llama_dir)
    assert group_fingerprint(copy(tiny_llama_dir, tmp_path / "same")) == base
    # mlx-lm reads eos_token_id from generation_config.json: rows stop differently
    eos = copy(tiny_llama_dir, tmp_path / "eos")
    (eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert group_fingerprint(eos) != base
    assert model_fingerprint(eos) == model_fingerprint(tiny_llama_dir)  # KV is the same
    # a tokenizer kept outside tokenizer.json (SentencePiece) reads text differently
    for name in ("tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json"):
        other = copy(tiny_llama_dir, tmp_path / name)
        (other / name).write_bytes(b"another tokenizer's " + name.encode())
        assert group_fingerprint(other) != base, name


def test_a_fine_tune_of_the_same_shapes_differs(tmp_path):
    """Only bytes in the middle of a weight file differ: the first and last MiB
    (what the KV namespace reads) named both alike."""
    base = write_tiny_llama(tmp_path / "base", seed=3, hidden=256)
    tuned = copy(base, tmp_path / "tuned")
    (weights,) = tuned.glob("*.safetensors")
    raw = bytearray(weights.read_bytes())
    assert len(raw) > 2 * 2**20 + 2**18  # a middle past both ends' MiB
    for at in range(2**20 + 2**16, len(raw) - 2**20, 2**15):
        raw[at] ^= 1
    weights.write_bytes(bytes(raw))
    assert model_fingerprint(tuned) == model_fingerprint(base)
    assert group_fingerprint(tuned) != group_fingerprint(base)


def test_kv_kept_across_restarts_is_keyed_by_every_byte_of_the_weights(tmp_path):
    """The SSD tier's namespace: a fine-tune differing from its base only between
    the two ends of a weight file (a fused LoRA) gets its own, where the sampled
    fingerprint gave both one and the base's KV was served as the tune's."""
    import os
    import time

    from engine.loader import kv_namespace
    from kvcache.layout import KVLayout

    layout = KVLayout((), ())
    base = write_tiny_llama(tmp_path / "base", seed=3, hidden=256)
    tuned = copy(base, tmp_path / "tuned")
    (weights,) = tuned.glob("*.safetensors")
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 1
    weights.write_bytes(bytes(raw))
    memo = tmp_path / "kv" / ".weights-digests.json"
    assert kv_namespace(tuned, layout) == kv_namespace(base, layout)  # RAM only: sampled
    assert kv_namespace(tuned, layout, memo) != kv_namespace(base, layout, memo)
    assert kv_namespace(copy(base, tmp_path / "copy"), layout, memo) == kv_namespace(
        base, layout, memo
    )
    # each file is read once: the digest is remembered by path, size, times and inode
    import engine.file_digest as file_digest

    hashed: list[int] = []
    sha256 = file_digest.hashlib.sha256

    def counting(*args):
        hashed.append(1)
        return sha256(*args)

    file_digest.hashlib.sha256 = counting  # type: ignore[assignment]
    try:
        stat = weights.stat()
        named = kv_namespace(tuned, layout, memo)
        assert kv_namespace(tuned, layout, memo) == named and not hashed  # remembered
        raw[len(raw) // 2] ^= 1
        time.sleep(0.05)  # past the file system clock's tick: a change time of its own
        with open(weights, "r+b") as f:  # in place: the same inode and size
            f.write(bytes(raw))
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and its old mtime
        # its change time tells: read again (it was the old digest, naming new bytes)
        assert kv_namespace(tuned, layout, memo) == kv_namespace(base, layout, memo)
        assert hashed
    finally:
        file_digest.hashlib.sha256 = sha256  # type: ignore[assignment]
