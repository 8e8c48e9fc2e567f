"""What a pure state-space model caches per sequence, from its config.

mlx-lm gives every layer of Mamba, Mamba 2 and RWKV-7 an ``ArraysCache``: a
convolution / token-shift window and a recurrent state whose size is fixed,
however long the context. Priced as attention they cost KV per token they never
hold (a Mamba 2.8B at 640 KB a token). The shapes are those mlx-lm's modules
allocate (mamba.py, mamba2.py, rwkv7.py), each at the activations' width except
Mamba 2's SSM state, which its ``ssm_update`` keeps float32.
"""

from __future__ import annotations

from typing import Any

from engine.config_fields import first_int
from kvcache.layout import KVLayout, LayerKind, LayerKV

PURE_STATE = frozenset({"mamba", "falcon_mamba", "mamba2", "rwkv7"})
_MAX_LAYERS = 4096  # past this a layout would only cost the listing time


def _layer_state(model_type: str, text: dict[str, Any], act_bytes: int) -> int:
    """Bytes one layer's ArraysCache holds for one sequence."""
    hidden = first_int(text, ("hidden_size", "d_model"))
    inner = first_int(text, ("intermediate_size", "d_inner"))
    state = first_int(text, ("state_size", "d_state"))
    window = max(0, first_int(text, ("conv_kernel", "d_conv")) - 1)  # conv inputs kept
    if model_type == "rwkv7":  # two token shifts of the hidden size; heads of D x D
        head_dim = first_int(text, ("head_dim",))
        return (2 * hidden + hidden * head_dim) * act_bytes
    if model_type == "mamba2":
        state = first_int(text, ("ssm_state_size",), default=state)
        conv = inner + 2 * first_int(text, ("n_groups",)) * state
        ssm = first_int(text, ("num_heads",)) * first_int(text, ("head_dim",)) * state
        return window * conv * act_bytes + ssm * 4
    return (window + state) * inner * act_bytes  # Mamba: conv window, then d_inner x d_state


def state_layout(
    model_type: str, text: dict[str, Any], layers: int, act_bytes: int
) -> KVLayout | None:
    """Every layer a constant state, for the model types mlx-lm caches so; None
    for any other (or a config that does not say enough)."""
    if model_type not in PURE_STATE or not 0 < layers <= _MAX_LAYERS:
        return None
    per_layer = _layer_state(model_type, text, act_bytes)
    if per_layer <= 0:
        return None
    return KVLayout(
        tuple(LayerKV(LayerKind.STATE, state_bytes=per_layer) for _ in range(layers)),
        ("recurrent state (from config)",),
    )
