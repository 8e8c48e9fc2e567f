"""What one sequence's cache costs, layer by layer, for every mlx-lm cache type.

Attention layers (``KVCache``) grow by a fixed number of bytes per position;
sliding-window layers (``RotatingKVCache``) grow the same way until the window
is full and then stay put (plus the prefill chunk a step appends before it
rotates); recurrent layers (``ArraysCache``: conv and SSM states) hold a
constant state per sequence whatever its length. ``CacheList`` layers are the
sum of their parts. The engine probes the layout once at load (a real forward
pass, so shapes and dtypes are the truth); admission and the KV store only
ever see this pure-Python description.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

KV_ALLOCATION_STEP = 256  # mlx-lm's KVCache / BatchKVCache growth step


def round_up(n: int, step: int = KV_ALLOCATION_STEP) -> int:
    return -(-n // step) * step


# what an mlx-lm cache's buffer may hold past its positions (see ``allocated``)
GROWTH_SLACK = 2 * (KV_ALLOCATION_STEP - 1)


def allocated(positions: int) -> int:
    """Positions an mlx-lm cache holding ``positions`` may have allocated.

    Its buffer grows by whole 256-position steps from wherever it stands, and a
    cache rebuilt from stored KV, merged into a batch or grown by a prefill chunk
    after a prefix hit stands off the 256 grid: 300 reused positions plus one
    decoded token allocate 556, and the next growth from 556 gives 812 where
    ``round_up(557)`` says 768. A growth from a position on the grid keeps the old
    buffer's unused tail too (mlx-lm trims it only off the grid): 154 reused, 102
    more, then a 300-token chunk hold 922 for 556. A search over every chunk size
    up to 4096 from every start finds at most 510 past the positions held.
    """
    return positions + GROWTH_SLACK if positions > 0 else 0


class LayerKind(str, enum.Enum):
    ATTENTION = "attention"  # KVCache: bytes per position, trimmable
    WINDOW = "window"  # RotatingKVCache: bytes per position up to a window
    STATE = "state"  # ArraysCache: a constant per sequence, never trimmable


@dataclass(frozen=True)
class LayerKV:
    kind: LayerKind
    bytes_per_token: int = 0  # attention and window layers
    window: int = 0  # window layers: positions kept
    state_bytes: int = 0  # state layers: bytes per sequence

    def sequence_bytes(self, positions: int, chunk: int) -> int:
        if self.kind is LayerKind.ATTENTION:
            return self.bytes_per_token * allocated(positions)
        if self.kind is LayerKind.WINDOW:
            # a prefill chunk is appended before the buffer rotates back to the window
            return self.bytes_per_token * min(allocated(positions), self.window + chunk)
        return self.state_bytes

    def tag(self) -> str:
        return f"{self.kind.value[0]}{self.bytes_per_token}w{self.window}s{self.state_bytes}"


@dataclass(frozen=True)
class KVLayout:
    """One entry per cache slot ``make_prompt_cache`` returns (CacheList parts flattened)."""

    layers: tuple[LayerKV, ...]
    cache_types: tuple[str, ...] = ()  # the mlx-lm class per top-level layer (for logs)

    @classmethod
    def attention_only(cls, bytes_per_token: int) -> KVLayout:
        """A model of plain KV caches at ``bytes_per_token`` (tests, fakes)."""
        return cls((LayerKV(LayerKind.ATTENTION, bytes_per_token),), ("KVCache",))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more position costs while every window still grows."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def attention_bytes_per_token(self) -> int:
        return sum(la.bytes_per_token for la in self.layers if la.kind is LayerKind.ATTENTION)

    @property
    def state_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers)

    @property
    def trimmable(self) -> bool:
        """Every layer can be cut back to any earlier position (prefix hits at any depth)."""
        return all(layer.kind is LayerKind.ATTENTION for layer in self.layers)

    def sequence_bytes(self, positions: int, chunk: int = 0) -> int:
        """What one sequence's cache can occupy at ``positions`` KV positions."""
        return sum(layer.sequence_bytes(positions, chunk) for layer in self.layers)

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for layer in self.layers:
            kinds[layer.kind.value] = kinds.get(layer.kind.value, 0) + 1
        parts = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        return (
            f"{parts} layers: {self.bytes_per_token} B/token, "
            f"{self.state_bytes} B/sequence of state"
        )

    def fingerprint(self) -> str:
        """Names the cache format: stored KV of another layout is never read back."""
        text = "|".join(layer.tag() for layer in self.layers)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def layout_multiples(layouts: Sequence[KVLayout]) -> list[int] | None:
    """Each layout as a number of copies of one common mix of layers (the same
    layer costs and cache types in the same proportions), or None when their
    mixes differ. A cache entry measured by a layout of n copies costs exactly n
    times what it costs under the mix, whatever its length; under other mixes
    (a pipeline slice of a hybrid model) their ratio changes with the length."""
    mix: tuple[Counter[object], ...] | None = None
    multiples = []
    for layout in layouts:
        counts: tuple[Counter[object], ...] = (
            Counter(layout.layers),
            Counter(layout.cache_types),
        )
        n = math.gcd(*(k for c in counts for k in c.values()))
        if n == 0:
            return None
        own = tuple(Counter({key: k // n for key, k in c.items()}) for c in counts)
        if mix is not None and own != mix:
            return None
        mix = own
        multiples.append(n)
    return multiples


@dataclass(frozen=True)
class KVQuant:
    """``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start``: stored blocks
    past ``start`` positions hold quantized keys and values (dequantized on a hit)."""

    bits: int = 8
    group_size: int = 64
    start: int = 0

    def tag(self) -> str:
        return f"q{self.bits}g{self.group_size}s{self.start}"

    def bytes_per_value_group(self) -> float:
        """Bytes per ``group_size`` values: packed bits plus a float scale and bias."""
        return self.group_size * self.bits / 8 + 2 * 4
