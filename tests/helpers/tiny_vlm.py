"""Tiny random-weight vision-language models built from mlx-vlm's own classes,
with real processor configs (no downloads)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from tests.helpers.tiny_models import write_byte_tokenizer
from tests.helpers.tools import require

# the Idefics3 (SmolVLM) processor's own tokens, added to the byte tokenizer
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
IDEFICS3_TOKENS += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
IMAGE_SIDE = 32  # one tile: 4x4 patches of 8 pixels, pixel-shuffled (x2) to 4 tokens


def add_special_tokens(path: Path, tokens: list[str]) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    (path / "tokenizer.json").write_text(tok.to_str())
    return {t: tok.token_to_id(t) for t in tokens}


def _tokenizer(path: Path, tokens: list[str]) -> tuple[dict[str, int], int]:
    """The byte tokenizer plus a family's own tokens: their ids, and the vocab size."""
    write_byte_tokenizer(path)
    ids = add_special_tokens(path, tokens)
    return ids, max(ids.values()) + 1


def _text(vocab: int, model_type: str = "llama", **extra: object) -> dict:
    """A 2-layer text model of width 64, the settings every family here shares."""
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        **extra,
    }


def _save(path: Path, config: dict, seed: int) -> None:
    """Random weights of mlx-vlm's own ``config["model_type"]`` classes, saved with
    the config as ``mlx_vlm.load`` reads them."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    nested = dict(config)  # Qwen2-VL's from_dict nests its top-level text settings here
    model_config = update_module_configs(
        module.ModelConfig.from_dict(nested), module, nested, ["text", "vision"]
    )
    model = module.Model(model_config)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))


def _processor_files(path: Path, preprocessor: dict, processor: dict | None = None) -> None:
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    if processor is not None:
        (path / "processor_config.json").write_text(json.dumps(processor))


def write_tiny_smolvlm(path: Path, seed: int = 0, longest_edge: int = 2 * IMAGE_SIDE) -> Path:
    """An Idefics3 / SmolVLM-shaped model: a llama text model (hidden 64, 2 layers)
    behind a one-layer SigLIP tower. Images are split into tiles of
    ``IMAGE_SIDE`` pixels (up to ``longest_edge``) plus a global view, each tile
    one image token, as SmolVLM does at full size."""
    ids, vocab = _tokenizer(path, IDEFICS3_TOKENS)
    config = {
        "model_type": "idefics3",
        "image_token_id": ids["<image>"],
        "scale_factor": 2,
        "vocab_size": vocab,
        "text_config": _text(vocab, tie_word_embeddings=False),
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "patch_size": 8,
            "image_size": IMAGE_SIDE,
        },
    }
    _save(path, config, seed)
    write_idefics3_processor(path, longest_edge, IMAGE_SIDE, splitting=True, image_seq_len=4)
    return path


def write_idefics3_processor(
    path: Path, longest_edge: int, tile: int, splitting: bool, image_seq_len: int
) -> None:
    """The Idefics3 (SmolVLM) processor's own config files: images resized to
    ``longest_edge``, cut into ``tile`` pixel tiles (plus a global view) when
    ``splitting``, each tile ``image_seq_len`` tokens."""
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Idefics3ImageProcessor",
                "processor_class": "Idefics3Processor",
                "do_convert_rgb": True,
                "do_resize": True,
                "size": {"longest_edge": longest_edge},
                "max_image_size": {"longest_edge": tile},
                "do_image_splitting": splitting,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_pad": True,
                "resample": 1,
            },
            indent=2,
        )
    )
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": image_seq_len})
    )


def png_bytes(width: int, height: int, color: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    """A solid-colour image with a diagonal line (so crops and scales differ)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), color)
    ImageDraw.Draw(image).line((0, 0, width - 1, height - 1), fill=(255 - color[0], 0, 0))
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


# Qwen2-VL's own tokens, added to the byte tokenizer
QWEN2VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PATCH = 14  # pixels per patch side; 2x2 patches merge into one image token


# each family's one-block vision tower (its output: the text model's width, 64)
QWEN_TOWERS = {
    "qwen2_vl": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
    "qwen2_5_vl": {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "window_size": 4 * QWEN_PATCH,
        "fullatt_block_indexes": [0],
    },
}


def write_tiny_qwen2vl(
    path: Path, seed: int = 0, max_tokens_per_image: int = 16, family: str = "qwen2_vl"
) -> Path:
    """A Qwen2-VL- or Qwen2.5-VL-shaped model (multimodal RoPE: an image's tokens
    sit on a 2-D grid of positions): a qwen2 text model (hidden 64, 2 layers)
    behind a one-block vision tower; images resized to at most
    ``max_tokens_per_image`` tokens."""
    ids, vocab = _tokenizer(path, QWEN2VL_TOKENS)
    config = {
        "model_type": family,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        # Qwen2-VL keeps its text model's settings at the top level
        **_text(
            vocab,
            family,
            rms_norm_eps=1e-6,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            tie_word_embeddings=False,
        ),
        "vision_config": {
            "model_type": family,
            **QWEN_TOWERS[family],
            "patch_size": QWEN_PATCH,
            "spatial_patch_size": QWEN_PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    _save(path, config, seed)
    unit = (2 * QWEN_PATCH) ** 2  # the pixels of one image token
    _processor_files(
        path,
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "patch_size": QWEN_PATCH,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "min_pixels": unit,
            "max_pixels": unit * max_tokens_per_image,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    )
    return path


def make_video(
    folder: Path, seconds: float = 2.0, fps: int = 4, size: tuple[int, int] = (64, 48)
) -> bytes:
    """ffmpeg's moving test pattern (every frame differs), as MPEG-4."""
    ffmpeg = require("ffmpeg", shutil.which("ffmpeg"))
    out = folder / "clip.mp4"
    source = f"testsrc=size={size[0]}x{size[1]}:rate={fps}:duration={seconds}"
    cmd = [ffmpeg, "-v", "error", "-y", "-f", "lavfi", "-i", source, "-c:v", "mpeg4", str(out)]
    subprocess.run(cmd, check=True)
    return out.read_bytes()


# Gemma 3's own tokens (an image: "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n")
GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def write_tiny_gemma3(path: Path, seed: int = 0, sliding_window: int = 64) -> Path:
    """A Gemma 3-shaped vision model: a gemma3 text model (hidden 64, 2 layers:
    a sliding-window one, then a global one) behind a one-layer SigLIP tower;
    each image is one 32 px square of 4x4 patches pooled to 4 soft tokens. The
    window is wider than the tests' prompts: a filled window cannot be cut back,
    so a re-sent prompt would hit only whole entries (kvcache's rule for them)."""
    ids, vocab = _tokenizer(path, GEMMA3_TOKENS)
    cfg_path = path / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["extra_special_tokens"] = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    cfg_path.write_text(json.dumps(tok_cfg))
    config = {
        "model_type": "gemma3",
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": 4,
        "vocab_size": vocab,
        "hidden_size": 64,
        "pad_token_id": 0,
        "text_config": _text(
            vocab,
            "gemma3",
            rms_norm_eps=1e-6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=sliding_window,
            sliding_window_pattern=2,
            mm_tokens_per_image=4,
        ),
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "patch_size": 8,
            "image_size": 32,
        },
    }
    _save(path, config, seed)
    _processor_files(
        path,
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"height": 32, "width": 32},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pan_and_scan": False,
            "resample": 2,
        },
        {"processor_class": "Gemma3Processor", "image_seq_length": 4},
    )
    return path


def write_tiny_llava(path: Path, seed: int = 0) -> Path:
    """A LLaVA-1.5-shaped model: a llama text model (hidden 64, 2 layers) behind a
    one-layer CLIP tower; each image one 32 px square of 4x4 patches, 16 tokens."""
    ids, vocab = _tokenizer(path, ["<image>"])
    config = {
        "model_type": "llava",
        "image_token_index": ids["<image>"],
        "vocab_size": vocab,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "projector_hidden_act": "gelu",
        "text_config": _text(vocab),
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "image_size": 32,
            "patch_size": 8,
            "projection_dim": 32,
        },
    }
    _save(path, config, seed)
    _processor_files(
        path,
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": 32},
            "do_center_crop": True,
            "crop_size": {"height": 32, "width": 32},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
            "resample": 3,
        },
        {
            "processor_class": "LlavaProcessor",
            "patch_size": 8,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
        },
    )
    return path


PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def write_tiny_pixtral(path: Path, seed: int = 0, family: str = "pixtral") -> Path:
    """A Pixtral-shaped model: a mistral text model (hidden 64, 2 layers) behind a
    one-layer Pixtral tower (2-D RoPE over patches); images keep their aspect up to
    48 px, one [IMG] token per 8 px patch, [IMG_BREAK] after each row, [IMG_END].
    ``family="mistral3"``: Mistral Small 3.1's shape, 2x2 patches merged into a token."""
    merge = 2 if family == "mistral3" else 1

    ids, vocab = _tokenizer(path, PIXTRAL_TOKENS)
    config = {
        "model_type": family,
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": merge,
        "vocab_size": vocab,
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "text_config": _text(vocab, "mistral", head_dim=16, tie_word_embeddings=False),
        "vision_config": {
            "model_type": "pixtral",
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "image_size": 48,
            "patch_size": 8,
            "rope_theta": 10000.0,
        },
    }
    _save(path, config, seed)
    _processor_files(
        path,
        {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "PixtralProcessor",
            "size": {"longest_edge": 48},
            "patch_size": {"height": 8, "width": 8},
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
        },
        {
            "processor_class": "Mistral3Processor" if merge > 1 else "PixtralProcessor",
            "patch_size": 8,
            "spatial_merge_size": merge,
        },
    )
    return path
