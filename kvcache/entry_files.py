"""How a stored entry becomes file contents and back: MLX arrays as numpy views
for the writer thread (bfloat16 as its bits), and prompt keys as manifest JSON.
Engine thread only (it touches MLX arrays)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvcache.disk import Arrays
from kvcache.prompt_key import PromptKey, TokenSpan


def _to_numpy(a: mx.array) -> tuple[np.ndarray, bool]:
    """A zero-copy numpy view (bfloat16 as its bits) for the writer thread."""
    if a.dtype == mx.bfloat16:
        bits = a.view(mx.uint16)
        mx.eval(bits)
        return np.asarray(bits), True
    return np.asarray(a), False


def numpy_arrays(named: dict[str, mx.array]) -> Arrays:
    """Engine-thread arrays as numpy views the writer thread can write."""
    out: dict[str, np.ndarray] = {}
    bf16: set[str] = set()
    for name, a in named.items():
        out[name], is_bf16 = _to_numpy(a)
        if is_bf16:
            bf16.add(name)
    return Arrays(out, frozenset(bf16))


def mlx_arrays(arrays: Arrays) -> dict[str, mx.array]:
    """Arrays read from a file, as MLX arrays (engine thread)."""
    out = {}
    for name, a in arrays.arrays.items():
        x = mx.array(a)
        out[name] = x.view(mx.bfloat16) if name in arrays.bf16 else x
    return out


def key_manifest(key: PromptKey) -> dict[str, Any]:
    """A prompt key as JSON for an entry's manifest (its canonical form is rebuilt)."""
    return {
        "model_tokens": list(key.model_tokens),
        "spans": [[s.start, s.end, s.rule] for s in key.spans],
        "message_ends": list(key.message_ends),
        "stable_prefix_end": key.stable_prefix_end,
    }


def key_from(manifest: dict[str, Any]) -> PromptKey:
    return PromptKey.build(
        [int(t) for t in manifest["model_tokens"]],
        [TokenSpan(int(a), int(b), int(r)) for a, b, r in manifest["spans"]],
        [int(e) for e in manifest["message_ends"]],
        int(manifest["stable_prefix_end"]),
    )
