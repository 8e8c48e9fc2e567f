"""The config.json fields a model's shape is read from, under every name
mlx-lm's ModelArgs know them by: one reader for ``kvwarm fit`` / /library
(app.model_library) and for serve (engine.loader), so the context and heads
fit prices are the ones the server enforces. Imports no mlx.

Most families say ``num_hidden_layers`` / ``num_attention_heads`` /
``hidden_size``; EXAONE 3 and LongCat-Flash say ``num_layers``, DBRX and OLMo 1
``n_layers`` / ``n_heads`` / ``d_model``, GPT-2, GPT-BigCode and GPT-J
``n_layer`` / ``n_head`` / ``n_embd``. Read under the first name only, those
came out at no KV at all.
"""

from __future__ import annotations

from typing import Any

LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
HEADS = ("num_attention_heads", "n_head", "n_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads")
WIDTH = ("hidden_size", "n_embd", "d_model")
# what engine.loader has always read, and OLMo 1's name for it
CONTEXT = (
    "max_position_embeddings",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "max_sequence_length",
)


def first_int(config: dict[str, Any], keys: tuple[str, ...], default: int = 0) -> int:
    """The first of ``keys`` that holds an integer (a bool is not one)."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def kv_heads(config: dict[str, Any], heads: int) -> int:
    """Key/value heads as mlx-lm's attention modules take them: DBRX's sit in
    ``attn_config.kv_n_heads``; GPT-BigCode's attention keeps one when
    ``multi_query`` (its default) whatever else the config says."""
    if config.get("model_type") == "gpt_bigcode":
        return 1 if config.get("multi_query", True) else heads
    attn = config.get("attn_config")
    if isinstance(attn, dict):
        found = first_int(attn, ("kv_n_heads",))
        if found:
            return found
    return first_int(config, KV_HEADS, default=heads)


def context_length(config: dict[str, Any]) -> int | None:
    """The context a config states: each name in turn, the top level before a
    vision model's ``text_config``; None where it states none."""
    text = config.get("text_config")
    sources = (config, text) if isinstance(text, dict) else (config,)
    for key in CONTEXT:
        for source in sources:
            found = first_int(source, (key,), default=-1)
            if found >= 0:
                return found
    return None
