"""LoRA / DoRA adapter directories built with mlx-lm's own LoRA layers."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")


def write_adapter(
    model_dir: Path,
    out: Path,
    seed: int,
    rank: int = 4,
    scale: float = 4.0,
    keys: list[str] | None = None,
    num_layers: int = 2,
    dora: bool = False,
) -> Path:
    """An adapter as ``mlx_lm.lora`` saves one: mlx-lm's LoRALinear/DoRALinear on
    the model, ``lora_b`` (zero at init) and DoRA's ``m`` perturbed so the adapter
    changes the output, then ``adapter_config.json`` + ``adapters.safetensors``."""
    model, _ = load(str(model_dir))
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "lora_b":
            value = mx.random.normal(value.shape) * 0.5
        elif leaf == "m":
            value = value * (1.0 + 0.3 * mx.random.normal(value.shape))
        if leaf in ADAPTER_LEAVES:
            weights[name] = value
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "dora" if dora else "lora",
        "num_layers": num_layers,
        "lora_parameters": params,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
