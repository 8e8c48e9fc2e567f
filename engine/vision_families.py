"""The vision model types kvwarm serves, without importing MLX: request-free
tools (`kvwarm fit`, /library) ask too."""

from __future__ import annotations

# mlx-vlm model types whose language model reads multimodal RoPE positions
GRID_ROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
# families whose language model reads image tokens at plain sequential positions,
# checked token for token against mlx-vlm's own forward (tests/engine/test_vision.py);
# others (LLaVA-NeXT's tiling, Gemma 3n/4, ...) wait for that proof
SEQUENTIAL_FAMILIES = frozenset({"idefics3", "smolvlm", "gemma3", "llava", "pixtral", "mistral3"})
SERVED_FAMILIES = SEQUENTIAL_FAMILIES | GRID_ROPE_FAMILIES
