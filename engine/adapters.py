"""LoRA / DoRA adapters mounted into the running model (engine thread only).

An adapter directory is what ``mlx_lm.lora`` writes: ``adapter_config.json``
(``fine_tune_type``, ``lora_parameters.rank/scale``) and
``adapters.safetensors`` (``<module path>.lora_a``, ``.lora_b``, DoRA's ``.m``).
Mounting validates every tensor against the model before touching a layer (all
or nothing), then adds the adapter's pairs to the layers' ``MultiLoRALinear``
wrappers under a slot of its own; unmounting removes them and unwraps layers no
adapter uses any more. Rows pick their slot through ``RowRouting``.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from engine.adapter_files import LEAVES
from engine.lora import (
    BASE,
    LoRAWeights,
    MultiLoRALinear,
    RoutedModel,
    RowRouting,
    dense_weight,
    linear_dims,
)
from scheduler.contracts import (
    AdapterError,
    AdapterExists,
    AdapterFiles,
    AdapterInfo,
    AdapterNotFound,
)

log = logging.getLogger("kvwarm.engine.adapters")
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
# the prompt of the forward pass a new adapter is tried on (any model's vocabulary
# has them; not token 0 alone, whose embedding may be all zeros: a pad)
PROBE_TOKENS = (1, 2, 3, 4)


@dataclass
class _Mounted:
    info: AdapterInfo
    layers: dict[str, LoRAWeights]  # module path -> its pair


def _load_weights(files: AdapterFiles) -> dict[str, mx.array]:
    """The tensors of the bytes that were hashed (no file read on this thread)."""
    file = files.weights_file
    try:
        weights = mx.load(io.BytesIO(files.weights), format="safetensors")
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the client's
        raise AdapterError(f"{file} is not a readable safetensors file: {exc}") from None
    if not isinstance(weights, dict) or not weights:
        raise AdapterError(f"{file} holds no tensors")
    return weights


def adaptable_layers(model: nn.Module) -> int:
    """The layers an adapter can target (Linear, QuantizedLinear): each takes a
    lora_a, lora_b and m at most, which bounds an adapter file's tensors."""
    return sum(isinstance(m, (nn.Linear, nn.QuantizedLinear)) for _, m in model.named_modules())


class AdapterSet:
    """The adapters mounted into one model, and the routing of rows to them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.routing = RowRouting()
        self.routed = RoutedModel(model, self.routing)
        self._mounted: dict[str, _Mounted] = {}
        self._next_slot = BASE + 1  # never reused: a stale slot can never mean another adapter

    def infos(self) -> list[AdapterInfo]:
        return [m.info for m in self._mounted.values()]

    @property
    def nbytes(self) -> int:
        return sum(m.info.size_bytes for m in self._mounted.values())

    def get(self, adapter_id: str) -> AdapterInfo:
        mounted = self._mounted.get(adapter_id)
        if mounted is None:
            raise AdapterNotFound(adapter_id)
        return mounted.info

    def slot(self, adapter_id: str | None) -> int:
        return BASE if adapter_id is None else self.get(adapter_id).slot

    def namespace(self, adapter_id: str | None) -> str:
        """The prefix-cache namespace of KV computed with this adapter ('' = base)."""
        if adapter_id is None:
            return ""
        info = self.get(adapter_id)
        # the scale exactly (repr round-trips a float): 1.0 and 1.0000004 are other KV
        return f"lora:{info.id}:{info.fingerprint}:{float(info.scale)!r}"

    # -- mounting ---------------------------------------------------------------
    def mount(self, adapter_id: str, files: AdapterFiles, scale: float = 1.0) -> AdapterInfo:
        """Validate every tensor, then mount (nothing changes if anything is wrong)."""
        if adapter_id in self._mounted:
            raise AdapterExists(f"an adapter {adapter_id!r} is already mounted; unmount it first")
        config = files.config
        weights = _load_weights(files)
        params = config["lora_parameters"]
        effective = float(params["scale"]) * scale
        if not math.isfinite(effective):  # each finite, their product not: every token NaN
            raise AdapterError(
                f"lora_parameters.scale {params['scale']} times the mount's scale {scale} "
                "is no finite number"
            )
        modules = dict(self.model.named_modules())
        pairs = self._validate(modules, weights, int(params["rank"]), effective)
        slot = self._next_slot
        self._next_slot += 1
        wrap = []  # layers no adapter used yet: wrapped in one module update
        for module_path, pair in pairs.items():
            layer = modules[module_path]
            if not isinstance(layer, MultiLoRALinear):
                layer = MultiLoRALinear(layer, self.routing)
                wrap.append((module_path, layer))
            layer.adapters[slot] = pair
        if wrap:
            self.model.update_modules(tree_unflatten(wrap))
        try:
            broken = self._breaks_the_model(slot)
        except BaseException:
            # the pairs are in the model already: a probe that raised (out of memory,
            # say) must not leave them and their wrappers in every later pass
            self._remove(pairs, slot)
            raise
        if broken:
            self._remove(pairs, slot)
            raise AdapterError(
                f"with adapter {adapter_id!r} the model's logits are not finite or all "
                "alike where the base model's are fine: its lora_a/lora_b products overflow "
                "the model's arithmetic (weights far too large)"
            )
        info = AdapterInfo(
            id=adapter_id,
            path=str(files.path),
            rank=int(params["rank"]),
            scale=scale,
            lora_scale=float(params["scale"]),
            fine_tune_type=config.get("fine_tune_type", "lora"),
            size_bytes=sum(p.nbytes for p in pairs.values()),
            mounted_layers=len(pairs),
            fingerprint=files.fingerprint,
            slot=slot,
        )
        self._mounted[adapter_id] = _Mounted(info, pairs)
        log.info(
            "adapter %s mounted from %s: %s rank %d, scale %g x %g, %d layers, %.1f MiB",
            adapter_id,
            files.path,
            info.fine_tune_type,
            info.rank,
            info.lora_scale,
            scale,
            info.mounted_layers,
            info.size_bytes / 2**20,
        )
        return info

    def unmount(self, adapter_id: str) -> AdapterInfo:
        mounted = self._mounted.get(adapter_id)
        if mounted is None:
            raise AdapterNotFound(adapter_id)
        del self._mounted[adapter_id]
        self._remove(mounted.layers, mounted.info.slot)
        log.info("adapter %s unmounted", adapter_id)
        return mounted.info

    def _remove(self, layers: dict[str, LoRAWeights], slot: int) -> None:
        """Take ``slot``'s pairs off ``layers``; a layer no adapter uses is unwrapped."""
        modules = dict(self.model.named_modules())
        wrappers = [modules[module_path] for module_path in layers]  # before any change
        unwrap = []
        for module_path, layer in zip(layers, wrappers):
            layer.adapters.pop(slot, None)
            if not layer.adapters:
                unwrap.append((module_path, layer.base))
        if unwrap:  # no adapter left on these layers: back to the bare base layer
            self.model.update_modules(tree_unflatten(unwrap))

    def _breaks_the_model(self, slot: int) -> bool:
        """Whether one short forward pass with ``slot``'s adapter gives logits that are
        not finite or all alike while the base model's, beside it in the same batch,
        are neither. Finite weights pass the NaN check and can still overflow in their
        products: the hidden state then collapses (RMSNorm of it 0 or NaN) and every
        token sampled is 0. One tiny pass on this thread, at mount only."""
        tokens = mx.array([PROBE_TOKENS, PROBE_TOKENS])
        self.routing.set([BASE, slot])
        try:
            out = self.model(tokens, cache=make_prompt_cache(self.model))
        finally:
            self.routing.clear()
        logits = getattr(out, "logits", out)[:, -1, :].astype(mx.float32)
        finite = mx.all(mx.isfinite(logits), axis=-1)
        spread = mx.max(logits, axis=-1) > mx.min(logits, axis=-1)
        base_ok, adapter_ok = (finite & spread).tolist()
        return bool(base_ok and not adapter_ok)

    @staticmethod
    def _validate(
        modules: dict[str, nn.Module], weights: dict[str, mx.array], rank: int, scale: float
    ) -> dict[str, LoRAWeights]:
        """Every tensor against the model's ``modules``; the first problem is a 400 naming it."""
        grouped: dict[str, dict[str, mx.array]] = {}
        for name, value in weights.items():
            module_path, _, leaf = name.rpartition(".")
            if leaf not in LEAVES:
                raise AdapterError(
                    f"tensor {name!r} is not an adapter parameter (expected "
                    f"<layer>.lora_a, .lora_b or .m)"
                )
            grouped.setdefault(module_path, {})[leaf] = value
        pairs: dict[str, LoRAWeights] = {}
        for module_path, leaves in sorted(grouped.items()):
            layer = modules.get(module_path)
            if isinstance(layer, MultiLoRALinear):
                layer = layer.base
            if layer is None or _inside_a_wrapper(modules, module_path):
                # "<layer>.base" exists only because another adapter wrapped <layer>
                raise AdapterError(f"layer {module_path!r} does not exist in the loaded model")
            if not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
                raise AdapterError(
                    f"layer {module_path!r} is a {type(layer).__name__}: only Linear and "
                    "QuantizedLinear layers take run-time adapters"
                )
            if "lora_a" not in leaves or "lora_b" not in leaves:
                raise AdapterError(f"layer {module_path!r} needs both lora_a and lora_b")
            for leaf, value in leaves.items():
                if value.dtype not in _FLOATS:
                    raise AdapterError(
                        f"layer {module_path!r}: {leaf} is {value.dtype}, not a float "
                        "(float16, bfloat16 or float32)"
                    )
            in_dims, out_dims = linear_dims(layer)
            a, b = leaves["lora_a"], leaves["lora_b"]
            if a.shape != (in_dims, rank) or b.shape != (rank, out_dims):
                raise AdapterError(
                    f"layer {module_path!r}: lora_a {tuple(a.shape)} and lora_b "
                    f"{tuple(b.shape)} do not fit a ({in_dims} -> {out_dims}) layer at rank "
                    f"{rank} (expected ({in_dims}, {rank}) and ({rank}, {out_dims}))"
                )
            factor = None
            if "m" in leaves:
                m = leaves["m"]
                if m.shape != (out_dims,):
                    raise AdapterError(
                        f"layer {module_path!r}: DoRA magnitude m {tuple(m.shape)} does not "
                        f"match the layer's {out_dims} outputs"
                    )
                # as mlx-lm's DoRALinear: m over the row norms of W + s * B^T A^T
                w = dense_weight(layer)
                adapted = w + (scale * b.T) @ a.T
                factor = m / mx.linalg.norm(adapted, axis=1)
            # kept in the dtype they were saved in, as mlx-lm's load_weights keeps them
            pair = LoRAWeights(a, b, scale, factor)
            arrays = (pair.a, pair.b, *(() if factor is None else (factor,)))
            mx.eval(*arrays)
            if not all(mx.all(mx.isfinite(x)).item() for x in arrays):
                # a NaN in lora_b (or a zero row norm under DoRA) mounted, and its
                # rows answered token 0 over and over
                raise AdapterError(f"layer {module_path!r}: the adapter holds NaN or infinity")
            pairs[module_path] = pair
        return pairs


def _inside_a_wrapper(modules: dict[str, nn.Module], module_path: str) -> bool:
    """Whether a path runs through a run-time adapter wrapper (not the model's own tree)."""
    parts = module_path.split(".")
    return any(
        isinstance(modules.get(".".join(parts[:i])), MultiLoRALinear) for i in range(1, len(parts))
    )
