"""Per-row LoRA: rows with different adapters (or none) in one continuous batch.

Each adapted linear layer of the base model is wrapped once in a
``MultiLoRALinear`` holding every mounted adapter's low-rank pair by *slot*.
Which slot each row of a forward pass uses travels with the row's KV caches, as
one extra "cache layer" (``AdapterTag``): mlx-lm's BatchGenerator merges,
filters, splits, extends and extracts a row's caches together, so the tag stays
with its row however the batch is reordered, and the model wrapper
(``RoutedModel``) reads it before each forward pass. Rows of one adapter cost
one low-rank product; a mixed batch computes each present adapter's output and
selects it per row (``mx.where``), so every row gets exactly the arithmetic of
mlx-lm's own ``LoRALinear`` / ``DoRALinear`` for its adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

BASE = 0  # the slot of the base model: no adapter


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter's pair for one layer, as mlx-lm's LoRALinear holds it."""

    a: mx.array  # (input_dims, rank)
    b: mx.array  # (rank, output_dims)
    scale: float
    # DoRA: the learned magnitude over the adapted weight's row norms (m / ||W + sBA||),
    # computed once at mount; None: plain LoRA
    dora_factor: mx.array | None = None

    @property
    def nbytes(self) -> int:
        extra = self.dora_factor.nbytes if self.dora_factor is not None else 0
        return self.a.nbytes + self.b.nbytes + extra


class RowRouting:
    """The adapter slot of each row in the forward pass being built (one per model)."""

    def __init__(self) -> None:
        self.slots: tuple[int, ...] = ()
        self._masks: dict[tuple[int, int, int], mx.array] = {}

    def set(self, slots: Sequence[int]) -> None:
        self.slots = tuple(slots)
        self._masks = {}

    def clear(self) -> None:
        self.set(())

    def uniform(self) -> int | None:
        """The slot every row uses, or None when they differ."""
        first = self.slots[0]
        return first if all(s == first for s in self.slots) else None

    def mask(self, slot: int, shape: tuple[int, ...]) -> mx.array:
        """Rows of ``slot``, shaped to select along the leading axis of an input of
        ``shape``: (B, L, D), or (B*L, D) where a layer flattens the batch first
        (some MoE routers and shared experts); each row's tokens are contiguous."""
        rows = len(self.slots)
        if shape[0] % rows:
            raise ValueError(f"a {shape} input cannot be split into {rows} rows")
        key = (slot, shape[0], len(shape))
        if key not in self._masks:
            per_row = shape[0] // rows
            flags = [s == slot for s in self.slots for _ in range(per_row)]
            self._masks[key] = mx.array(flags).reshape((shape[0],) + (1,) * (len(shape) - 1))
        return self._masks[key]


def linear_dims(layer: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of an nn.Linear or nn.QuantizedLinear."""
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return in_dims, out_dims


def dense_weight(layer: nn.Module) -> mx.array:
    """The layer's weight as a dense matrix (what DoRA normalises)."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(
            layer.weight,
            layer.scales,
            layer.biases,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
        )
    return layer.weight


class MultiLoRALinear(nn.Module):
    """A base linear layer plus any number of adapters, chosen per row."""

    def __init__(self, base: nn.Module, routing: RowRouting):
        super().__init__()
        self.base = base
        # plain attributes, not module children: adapter weights are not the
        # model's parameters (they come and go at run time)
        object.__setattr__(self, "_routing", routing)
        object.__setattr__(self, "_adapters", {})

    @property
    def adapters(self) -> dict[int, LoRAWeights]:
        return self._adapters  # type: ignore[no-any-return]

    def _adapted(self, x: mx.array, y: mx.array, w: LoRAWeights) -> mx.array:
        z = (x @ w.a) @ w.b
        if w.dora_factor is None:
            return y + (w.scale * z).astype(x.dtype)
        out = x @ dense_weight(self.base).T + (w.scale * z).astype(x.dtype)
        out = w.dora_factor.astype(x.dtype) * out
        if "bias" in self.base:
            out = out + self.base.bias
        return out

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self._routing.slots  # type: ignore[attr-defined]
        if not slots or not self.adapters:
            return y
        uniform = self._routing.uniform()  # type: ignore[attr-defined]
        if uniform is not None:
            w = self.adapters.get(uniform)
            return y if w is None else self._adapted(x, y, w)
        out = y
        for slot in sorted(set(slots)):
            w = self.adapters.get(slot)
            if w is not None:
                rows = self._routing.mask(slot, x.shape)  # type: ignore[attr-defined]
                out = mx.where(rows, self._adapted(x, y, w), out)
        return out


class AdapterTag:
    """One row's adapter slot, riding along as the last entry of its cache list."""

    def __init__(self, slot: int = BASE):
        self.slot = slot

    @classmethod
    def merge(cls, tags: Sequence[AdapterTag]) -> AdapterTags:
        return AdapterTags([t.slot for t in tags])

    @property
    def slots(self) -> list[int]:
        return [self.slot]

    @property
    def state(self) -> list[Any]:
        return []  # nothing for mx.eval

    nbytes = 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n


class AdapterTags:
    """The batched form: one slot per row, kept in the batch's row order."""

    nbytes = 0

    @property
    def state(self) -> list[Any]:
        return []

    def __init__(self, slots: list[int]):
        self.slots = list(slots)

    def filter(self, keep: Sequence[int]) -> None:
        self.slots = [self.slots[i] for i in keep]

    def extend(self, other: AdapterTags) -> None:
        self.slots.extend(other.slots)

    def extract(self, idx: int) -> AdapterTag:
        return AdapterTag(self.slots[idx])

    def prepare(self, **_: Any) -> None:
        """Right padding changes no slot."""

    def finalize(self) -> None:
        pass

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n


def is_tag(cache: Any) -> bool:
    return isinstance(cache, (AdapterTag, AdapterTags))


class RoutedModel:
    """The model as the BatchGenerator sees it: strips the adapter tag off the
    cache list and routes each row to its adapter for this forward pass."""

    def __init__(self, model: nn.Module, routing: RowRouting):
        self.model = model
        self.routing = routing

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        if not cache or not is_tag(cache[-1]):
            return self.model(inputs, cache=cache, **kwargs)
        self.routing.set(cache[-1].slots)
        try:
            return self.model(inputs, cache=cache[:-1], **kwargs)
        finally:
            self.routing.clear()

    def make_cache(self, slot: int = BASE) -> list[Any]:
        return [*make_prompt_cache(self.model), AdapterTag(slot)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
