"""The vision benchmark's model: real SmolLM2-135M-Instruct text weights behind a
random SigLIP vision tower, shaped like SmolVLM-256M (mlx-vlm's ``idefics3``
classes, real Idefics3 processor configs; no model hub needed).

- text: the float32 mlx-lm directory ``kvwarm prepare`` writes (SmolLM2-135M, llama,
  30 layers, hidden 576), its weights loaded into ``language_model.*`` (the tied
  embeddings copied into ``lm_head``), vocab enlarged by the Idefics3 special tokens
  (new embedding rows random at the scale of the real ones, their ``lm_head`` rows
  zero so the text model never emits them);
- vision: SigLIP hidden 768, 12 heads, intermediate 3072, patch 16, image_size 512
  (SmolVLM-256M's tower) but 4 layers instead of 12, random weights; connector
  pixel shuffle x4, so one 512 px tile is 1024 patches -> 64 image tokens. The
  connector's projection is scaled so image features have the RMS of the text
  embeddings (random features at full scale would drown the real text model).
  Why 4 layers: on the 2-core CPU with OpenBLAS (~55 GFLOP/s measured on matmul
  here, MLX's CPU attention ~0.37 s per layer over 1024 patches) one SigLIP layer
  takes ~0.85 s on a 512 px tile, so the full 12-layer tower takes ~10.7 s per
  image; 4 layers take ~3.5 s, under the ~4 s the benchmark aims at
  (``vision_layers=12`` builds the full tower);
- processor: no image splitting, each image resized to one 512 x 512 tile:
  ``<fake_token_around_image><global-img>`` + 64 x ``<image>`` +
  ``<fake_token_around_image>`` = 67 tokens per image;
- chat template: SmolLM2's own ChatML (its weights were trained on it), extended
  to list contents (text parts, and ``<image>`` for image parts) so both kvwarm and
  mlx-vlm's server render the same prompt.

    python bench/vision_model.py [--out DIR] [--vision-layers 4]
        # builds it (once) and prints the folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Idefics3's own tokens and processor files, as the tiny test models have them
from tests.helpers.tiny_vlm import IDEFICS3_TOKENS, add_special_tokens, write_idefics3_processor  # noqa: E402

TILE = 512  # pixels per side of the one tile an image becomes
PATCH = 16
SCALE_FACTOR = 4
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2  # 64
VISION = {
    "model_type": "idefics3_vision",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "patch_size": PATCH,
    "image_size": TILE,
    "layer_norm_eps": 1e-6,
}
VISION_LAYERS = 4  # of SmolVLM-256M's 12 (see the module docstring)
VERSION = 1  # bump when the recipe changes: the cache folder's name carries it
DEFAULT_DIR = Path.home() / ".cache" / "kvwarm" / "bench-models"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'input_image'] %}{{ '<image>' }}"
    "{% elif part['type'] in ['text', 'input_text'] %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _text_model_dir() -> Path:
    from _common import prepare_model

    return Path(prepare_model())


def bench_model_dir(
    text_dir: Path | None = None, vision_layers: int = VISION_LAYERS, root: Path = DEFAULT_DIR
) -> Path:
    """Where the model built from ``text_dir`` is cached (its name says what it is from)."""
    text_dir = Path(text_dir or _text_model_dir())
    key = f"{VERSION}:{vision_layers}:{text_dir.resolve()}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return root / f"smolvlm-bench-v{vision_layers}-{digest}"


def write_bench_smolvlm(
    path: Path | None = None, text_dir: Path | None = None, vision_layers: int = VISION_LAYERS
) -> Path:
    """Build the benchmark's SmolVLM-shaped model in ``path`` (default: a cache folder
    under ~/.cache/kvwarm/bench-models named after its text model and tower depth)
    once; later calls return the folder as it is. ``text_dir``: the float mlx-lm
    SmolLM2 directory (default: what ``kvwarm prepare`` prints). Returns the folder."""
    text_dir = Path(text_dir or _text_model_dir())
    path = Path(path or bench_model_dir(text_dir, vision_layers))
    if (path / ".complete").exists():
        return path
    from engine.blas import preload_openblas

    preload_openblas()  # a no-op once mlx is imported (the caller preloaded it then)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        _build(tmp, text_dir, vision_layers)
        done = {"version": VERSION, "text": str(text_dir), "vision_layers": vision_layers}
        (tmp / ".complete").write_text(json.dumps(done))
        if path.exists():  # an unfinished earlier build
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _build(out: Path, text_dir: Path, vision_layers: int) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.models import idefics3
    from mlx_vlm.utils import update_module_configs

    for name in TOKENIZER_FILES:
        if (text_dir / name).exists():
            shutil.copy(text_dir / name, out / name)
    ids = add_special_tokens(out, IDEFICS3_TOKENS)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))

    text = json.loads((text_dir / "config.json").read_text())
    vocab = max(max(ids.values()) + 1, int(text["vocab_size"]))
    text_config = dict(text, vocab_size=vocab, tie_word_embeddings=False)
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ids["<image>"],
        "scale_factor": SCALE_FACTOR,
        "vocab_size": vocab,
        "eos_token_id": [int(text.get("eos_token_id", 2)), ids["<end_of_utterance>"]],
        "text_config": text_config,
        "vision_config": dict(VISION, num_hidden_layers=vision_layers),
    }
    mx.random.seed(0)
    model_config = update_module_configs(
        idefics3.ModelConfig.from_dict(config), idefics3, config, ["text", "vision"]
    )
    model = idefics3.Model(model_config)
    params = dict(tree_flatten(model.parameters()))

    # the real text weights
    src = mx.load(str(text_dir / "model.safetensors"))
    embed = src["model.embed_tokens.weight"].astype(mx.float32)
    rms = float(mx.sqrt((embed * embed).mean()).item())
    extra = mx.random.normal((vocab - embed.shape[0], embed.shape[1])) * rms
    head = src.get("lm_head.weight", src["model.embed_tokens.weight"]).astype(mx.float32)
    loaded = {
        "language_model.embed_tokens.weight": mx.concatenate([embed, extra]),
        # the added tokens' logits are 0: the real text model never picks them
        "language_model.lm_head.weight": mx.concatenate([head, mx.zeros_like(extra)]),
    }
    for key, value in src.items():
        if key.startswith("model.") and key != "model.embed_tokens.weight":
            loaded["language_model." + key[len("model.") :]] = value
    missing = [k for k in params if k.startswith("language_model.") and k not in loaded]
    unused = [k for k in loaded if k not in params]
    if missing or unused:
        raise ValueError(f"text weights do not fit: missing {missing[:5]}, unused {unused[:5]}")
    for key, value in loaded.items():
        if value.shape != params[key].shape:
            raise ValueError(f"{key}: {value.shape} vs the model's {params[key].shape}")
        params[key] = value.astype(params[key].dtype)
    model.update(tree_unflatten(list(params.items())))

    # scale the connector so image features sit at the text embeddings' RMS
    rng = np.random.default_rng(0)
    pixels = mx.array(rng.uniform(-1, 1, (1, TILE, TILE, 3)).astype(np.float32))
    hidden, *_ = model.vision_model(pixels, output_hidden_states=True)
    feats = model.connector(hidden)
    feat_rms = float(mx.sqrt((feats * feats).mean()).item())
    proj = model.connector.modality_projection.proj
    proj.weight = proj.weight * (rms / feat_rms)
    params = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})

    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_idefics3_processor(out, TILE, TILE, splitting=False, image_seq_len=IMAGE_SEQ_LEN)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None, help="folder (default: the cache)")
    ap.add_argument("--text-dir", type=Path, default=None, help="mlx-lm SmolLM2 directory")
    ap.add_argument("--vision-layers", type=int, default=VISION_LAYERS, help="SigLIP depth")
    args = ap.parse_args()
    print(write_bench_smolvlm(args.out, args.text_dir, args.vision_layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
