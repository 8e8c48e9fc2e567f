"""KV payloads on the engine thread: a sequence's caches cut into shared blocks
plus a private part, and put back together for a hit.

Only the engine thread imports this module (it touches MLX arrays). A plain
``KVCache`` layer is cut along positions: each full block of ``block_size``
positions (all such layers together) is one shared block; the positions after
the last full block are the entry's tail. Any other layer (a sliding window, a
recurrent state, a ``CacheList``) is kept whole as the entry's own: its state
is not a function of position ranges.

Stored arrays are fresh contiguous copies (never views of a batch buffer) and
are never written to: a hit hands BatchGenerator new caches built from them,
which it copies again into its batch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvcache.blocks import Digest, EntryBytes
from kvcache.layout import KVQuant

# one block: keys and values of every plain-KV layer by name ("k0", "v0", ...); a
# quantized block holds "k0.w", "k0.s", "k0.b" (mx.quantize) and "q" = [bits, group]
BlockArrays = dict[str, mx.array]


def _quantized(x: mx.array, q: KVQuant) -> tuple[mx.array, mx.array, mx.array]:
    w, scales, biases = mx.quantize(x, group_size=q.group_size, bits=q.bits)
    return w, scales, biases


def _plain(blk: BlockArrays, name: str, dtype: mx.Dtype) -> mx.array:
    if name in blk:
        return blk[name]
    q = blk["q"]
    bits, group = int(cast(int, q[0].item())), int(cast(int, q[1].item()))
    x = mx.dequantize(
        blk[f"{name}.w"], blk[f"{name}.s"], blk[f"{name}.b"], group_size=group, bits=bits
    )
    return x.astype(dtype)


def _no_positions(blk: BlockArrays, name: str) -> mx.array:
    """An empty (0-position) array shaped and typed as ``blk``'s ``name`` assembles:
    a quantized block's values come back in its scales' dtype (mx.quantize's own)."""
    if name in blk:
        a = blk[name]
        return mx.zeros((*a.shape[:2], 0, a.shape[3]), a.dtype)
    scales = blk[f"{name}.s"]
    group = int(cast(int, blk["q"][1].item()))
    return mx.zeros((*scales.shape[:2], 0, scales.shape[3] * group), scales.dtype)


def _is_plain_kv(cache: object) -> bool:
    return isinstance(cache, KVCache) and not isinstance(cache, RotatingKVCache)


def plain_kv_only(caches: Sequence[Any]) -> bool:
    """Every layer is plain KV: stored entries can be cut back to any depth."""
    return all(_is_plain_kv(c) for c in caches)


def _leaves(state: Any) -> list[tuple[str, Any]]:
    """A cache state's leaves by dotted path (arrays, ints, None, class names)."""
    return cast(list[tuple[str, Any]], tree_flatten(state))


def position_bytes(cache: Any) -> int:
    """Keys + values of one position of a KV cache layer (their head dims may differ)."""
    return sum(a.shape[1] * a.shape[3] * a.dtype.size for a in (cache.keys, cache.values))


def _own(x: mx.array) -> mx.array:
    """A copy that keeps no view of a larger buffer alive."""
    return mx.contiguous(x)


@dataclass
class PrivatePart:
    """What only this entry holds: per layer, the tail (keys, values) of a plain-KV
    layer, or the whole cache object of any other layer."""

    layers: list[tuple[mx.array, mx.array] | Any]
    nbytes: int

    def arrays(self) -> dict[str, mx.array]:
        """Flat name -> array, for a file (other layers by the arrays of their state)."""
        out: dict[str, mx.array] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, tuple):
                out[f"tail.{i}.k"] = layer[0]
                out[f"tail.{i}.v"] = layer[1]
            else:
                for name, value in _leaves(layer.state):
                    if isinstance(value, mx.array):
                        out[f"state.{i}.{name}"] = value
        return out

    def meta(self) -> list[Any]:
        """Per layer: "tail", or the non-array leaves of its state (offsets, window
        sizes, class names of CacheList parts), JSON-able, for a rebuild."""
        out: list[Any] = []
        for layer in self.layers:
            if isinstance(layer, tuple):
                out.append("tail")
                continue
            leaves = _leaves(layer.state)
            out.append({name: v for name, v in leaves if not isinstance(v, mx.array)})
        return out


@dataclass
class Split:
    """A sequence's KV as stored: addressed blocks + what is its own."""

    held: EntryBytes
    blocks: dict[Digest, BlockArrays] = field(default_factory=dict)  # only those asked for
    private: PrivatePart | None = None


class KVLayoutOps:
    """Cutting and assembling the caches of one model (the layout is fixed at load)."""

    def __init__(self, template: Sequence[Any], block_size: int, quant: KVQuant | None = None):
        self.block_size = block_size
        self.quant = quant
        self.plain = [i for i, c in enumerate(template) if _is_plain_kv(c)]
        self.n_layers = len(template)
        # every layer plain KV: any depth can be cut; else entries hit only whole
        self.trimmable = plain_kv_only(template)

    # -- cutting ---------------------------------------------------------------
    def _position_bytes(self, caches: Sequence[Any]) -> int:
        return sum(position_bytes(caches[i]) for i in self.plain)

    def _quantizes(self, block: int, head_dim: int) -> bool:
        q = self.quant
        return q is not None and block * self.block_size >= q.start and head_dim % q.group_size == 0

    def _block_bytes(self, caches: Sequence[Any], block: int) -> int:
        bs, q, total = self.block_size, self.quant, 0
        for i in self.plain:
            for a in (caches[i].keys, caches[i].values):
                values = a.shape[1] * bs * a.shape[3]
                if q is not None and self._quantizes(block, a.shape[3]):
                    total += int(values / q.group_size * q.bytes_per_value_group())
                else:
                    total += values * a.dtype.size
        return total

    def measure(self, caches: Sequence[Any], length: int, digests: Sequence[Digest]) -> EntryBytes:
        """What storing ``caches`` (``length`` positions) would hold: no copying."""
        bs = self.block_size
        n_blocks = min(len(digests), length // bs) if self.plain else 0
        per_pos = self._position_bytes(caches) if self.plain else 0
        private = per_pos * (length - n_blocks * bs)
        private += sum(int(caches[i].nbytes) for i in range(self.n_layers) if i not in self.plain)
        blocks = tuple((d, self._block_bytes(caches, b)) for b, d in enumerate(digests[:n_blocks]))
        return EntryBytes(blocks, private)

    def split(
        self, caches: Sequence[Any], length: int, held: EntryBytes, want: set[Digest]
    ) -> Split:
        """Copy out the blocks in ``want`` and the private part."""
        bs = self.block_size
        out = Split(held)
        for b, (digest, _) in enumerate(held.blocks):
            if digest in want:
                arrays: BlockArrays = {}
                for slot, i in enumerate(self.plain):
                    c = caches[i]
                    for name, a in ((f"k{slot}", c.keys), (f"v{slot}", c.values)):
                        x = a[..., b * bs : (b + 1) * bs, :]
                        if self.quant is not None and self._quantizes(b, a.shape[3]):
                            w, sc, bi = _quantized(x, self.quant)
                            arrays[f"{name}.w"], arrays[f"{name}.s"], arrays[f"{name}.b"] = (
                                w,
                                sc,
                                bi,
                            )
                            arrays["q"] = mx.array([self.quant.bits, self.quant.group_size])
                        else:
                            arrays[name] = _own(x)
                out.blocks[digest] = arrays
        start = len(held.blocks) * bs
        layers: list[tuple[mx.array, mx.array] | Any] = []
        for i in range(self.n_layers):
            c = caches[i]
            if i in self.plain:
                layers.append(
                    (_own(c.keys[..., start:length, :]), _own(c.values[..., start:length, :]))
                )
            else:
                layers.append(c)  # already this sequence's own copy (extracted)
        out.private = PrivatePart(layers, held.private)
        mx.eval(list(_all_arrays(out)))
        return out

    # -- assembling ----------------------------------------------------------
    def empty_tails(self, block: BlockArrays) -> PrivatePart:
        """The private part of a hit within an entry's blocks that left the entry's
        own file unread (a partial disk read): every layer's tail empty, shaped and
        typed as ``block``'s KV. Only for layouts of plain KV alone (the others'
        private layers are state no block holds, and their entries hit whole)."""
        assert self.trimmable
        layers: list[tuple[mx.array, mx.array] | Any] = [
            (_no_positions(block, f"k{slot}"), _no_positions(block, f"v{slot}"))
            for slot in range(len(self.plain))
        ]
        return PrivatePart(layers, 0)

    def assemble(self, blocks: Sequence[BlockArrays], private: PrivatePart, keep: int) -> list[Any]:
        """Fresh caches holding the first ``keep`` positions of ``blocks`` + the tails."""
        out: list[Any] = []
        for j, layer in enumerate(private.layers):
            if isinstance(layer, tuple):
                slot = self.plain.index(j)
                dtype = layer[0].dtype
                keys = [_plain(blk, f"k{slot}", dtype) for blk in blocks] + [layer[0]]
                values = [_plain(blk, f"v{slot}", dtype) for blk in blocks] + [layer[1]]
                c = KVCache()
                k = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0]
                v = mx.concatenate(values, axis=2) if len(values) > 1 else values[0]
                c.keys, c.values, c.offset = k[..., :keep, :], v[..., :keep, :], keep
                out.append(c)
            else:
                out.append(copy.copy(layer))  # the batch copies it in; never written to
        return out


def _all_arrays(split: Split) -> Iterator[mx.array]:
    for arrays in split.blocks.values():
        yield from arrays.values()
    if split.private is not None:
        yield from split.private.arrays().values()


def rebuild_private(
    template: Sequence[Any], arrays: dict[str, mx.array], meta: list[Any], nbytes: int
) -> PrivatePart:
    """A private part read from a file, on fresh cache objects of the model's own types."""
    layers: list[tuple[mx.array, mx.array] | Any] = []
    for i, layer_meta in enumerate(meta):
        if layer_meta == "tail":
            layers.append((arrays[f"tail.{i}.k"], arrays[f"tail.{i}.v"]))
            continue
        prefix = f"state.{i}."
        flat: list[tuple[str, Any]] = [
            (k[len(prefix) :], v) for k, v in arrays.items() if k.startswith(prefix)
        ]
        flat += list(layer_meta.items())
        flat.sort(key=lambda kv: [int(p) if p.isdigit() else p for p in kv[0].split(".")])
        fresh = copy.deepcopy(template[i])
        fresh.state = tree_unflatten(flat)
        layers.append(fresh)
    return PrivatePart(layers, nbytes)
