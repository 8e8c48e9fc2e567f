"""`kvwarm fit`'s KV bytes per token, read from headers alone, against what
mlx-lm's cache really holds for the same model: multi-head latent attention,
hybrid linear-attention stacks, and a bf16 model keeping a tensor float32."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v2, deepseek_v3, llama, minicpm3, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

from app.model_library import dir_facts

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=256, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
    n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=64,
    q_lora_rank=96, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
    num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1,
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
DEEPSEEK_V2 = dict(
    model_type="deepseek_v2", vocab_size=256, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
    n_shared_experts=1, n_routed_experts=4, kv_lora_rank=64, q_lora_rank=96,
    qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, num_experts_per_tok=2,
    max_position_embeddings=8192, rope_scaling={"type": "yarn", "factor": 1.0, "mscale": 1,
    "mscale_all_dim": 1, "original_max_position_embeddings": 8192},
)  # fmt: skip
MINICPM3 = dict(
    model_type="minicpm3", hidden_size=128, dim_model_base=128, num_hidden_layers=2,
    intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=256,
    num_key_value_heads=4, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
    kv_lora_rank=32, scale_depth=1.4, scale_emb=12, max_position_embeddings=4096,
    rope_scaling={"original_max_position_embeddings": 4096},
)  # fmt: skip
QWEN3_NEXT = dict(
    model_type="qwen3_next", vocab_size=256, hidden_size=128, intermediate_size=256,
    num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    decoder_sparse_step=1, shared_expert_intermediate_size=64, moe_intermediate_size=64,
    mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
    max_position_embeddings=8192, full_attention_interval=4, tie_word_embeddings=False,
    norm_topk_prob=True,
)  # fmt: skip
LLAMA = dict(
    model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
)  # fmt: skip


def save(model: nn.Module, config: dict, path: Path, quantize: bool, f32: str = "") -> Path:
    if quantize:
        nn.quantize(
            model,
            group_size=32,
            bits=4,
            class_predicate=lambda _, m: (
                isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 32 == 0
            ),
        )
        config = {**config, "quantization": {"group_size": 32, "bits": 4}}
    weights = dict(tree_flatten(model.parameters()))
    if f32:  # what mlx-lm's cast_predicate keeps float32 in a bf16 model
        weights[f32] = weights[f32].astype(mx.float32)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


def cached_bytes_per_token(model: nn.Module, tokens: int = 48) -> float:
    """What the caches that grow with the prompt hold per token."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache))
    grown = 0
    for c in cache:
        if getattr(c, "offset", None) is None:
            continue  # a fixed-size state (linear attention, SSM)
        for _, array in tree_flatten(c.state):
            if isinstance(array, mx.array):  # keys and values, cut to the offset
                grown += array.size // array.shape[-2] * array.itemsize * c.offset
    return grown / tokens


@pytest.mark.parametrize(
    "module, config, quantize, f32",
    [
        (deepseek_v3, DEEPSEEK_V3, True, ""),  # one latent per layer, not every head's K and V
        # latent attention in its config, yet mlx-lm caches every head's K and V
        (deepseek_v2, DEEPSEEK_V2, True, ""),
        (minicpm3, MINICPM3, False, ""),  # value heads of hidden / heads, not in its config
        (qwen3_next, QWEN3_NEXT, True, ""),  # KV in one layer of four
        (llama, LLAMA, False, "model.norm.weight"),  # bf16 KV beside one float32 tensor
    ],
    ids=["mla", "mla-expanded", "mla-expanded-minicpm3", "hybrid", "bf16-with-a-float32-tensor"],
)
def test_the_kv_estimate_is_what_mlx_lm_caches(tmp_path, module, config, quantize, f32):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    if not quantize:
        model.set_dtype(mx.bfloat16)
    real = cached_bytes_per_token(model)
    path = save(model, config, tmp_path / config["model_type"], quantize, f32)
    assert dir_facts(path).kv_bytes_per_token == real


GEMMA3 = dict(
    model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    sliding_window=64,
)  # fmt: skip
GPT_OSS = dict(
    model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
    layer_types=["sliding_attention", "full_attention"] * 2,
)  # fmt: skip
LLAMA_SWA = dict(
    LLAMA, num_hidden_layers=3, sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [GEMMA3, dict(GEMMA3, sliding_window_pattern=2), GPT_OSS, LLAMA_SWA],
    ids=["gemma3-default-pattern", "gemma3-pattern-2", "gpt-oss", "llama-layer-types"],
)
def test_sliding_window_layers_are_what_mlx_lm_caches(tmp_path, config):
    """Fit counted every layer as growing with the context: Gemma 3 keeps five of
    six at a 1024-token window, so its 128k context was said to need six times the
    KV it does."""
    from importlib import import_module

    from mlx_lm.models.cache import RotatingKVCache

    from kvcache.layout import LayerKind

    module = import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    real = [c.max_size if isinstance(c, RotatingKVCache) else 0 for c in make_prompt_cache(model)]
    facts = dir_facts(save(model, config, tmp_path / "m", quantize=False))
    assert facts.layout is not None
    layers = facts.layout.layers
    assert [la.window if la.kind is LayerKind.WINDOW else 0 for la in layers] == real
    assert sum(la.bytes_per_token for la in layers) == facts.kv_bytes_per_token


def test_a_gemma3_vision_checkpoint_silent_on_heads_is_read_with_mlx_lms_defaults(tmp_path):
    """Its text_config names neither heads nor head size: read as one head of the
    whole hidden size, fit's KV was a quarter too large and the server's attention
    reserve (scores per head) an eighth of what it holds."""
    from mlx_lm.models import gemma3

    from engine.loader import _num_heads

    text = dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=7,
        sliding_window=64,
    )  # fmt: skip
    config = dict(model_type="gemma3", vocab_size=256, text_config=text)
    model = gemma3.Model(gemma3.ModelArgs.from_dict(json.loads(json.dumps(config))))
    facts = dir_facts(save(model, config, tmp_path / "g", quantize=False))
    assert facts.num_heads == 8 and _num_heads(model, config) == 8
    real = cached_bytes_per_token(model, tokens=8)  # inside every window: all grow alike
    assert facts.kv_bytes_per_token == real


EXAONE = dict(
    model_type="exaone", vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, layer_norm_epsilon=1e-5,
    max_position_embeddings=2048,
)  # fmt: skip
GPT2 = dict(
    model_type="gpt2", vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_ctx=512,
    n_positions=512, layer_norm_epsilon=1e-5,
)  # fmt: skip
GPT_BIGCODE = dict(
    model_type="gpt_bigcode", vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_inner=128,
    n_positions=512, layer_norm_epsilon=1e-5, multi_query=True,
)  # fmt: skip
GPTJ = dict(
    model_type="gptj", vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_positions=512,
    rotary_dim=8,
)  # fmt: skip
DBRX = dict(
    model_type="dbrx", vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=1024,
    attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 1e4},
    ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
)  # fmt: skip


@pytest.mark.parametrize(
    "config, heads, context",
    [(EXAONE, 4, 2048), (GPT2, 4, 512), (GPT_BIGCODE, 4, 512), (GPTJ, 4, 512), (DBRX, 4, 1024)],
    ids=["exaone-num_layers", "gpt2-n_layer", "gpt-bigcode-multi-query", "gptj", "dbrx-n_layers"],
)
def test_configs_naming_layers_heads_and_width_otherwise_are_read(tmp_path, config, heads, context):
    """Only num_hidden_layers / num_attention_heads / hidden_size were read: EXAONE
    3, DBRX, GPT-2, GPT-BigCode and GPT-J came out at no KV at all, priced at one
    byte a token ("fits", with millions of sequences); GPT-2's n_positions context
    was read as 4096. Fit, serve's context and serve's attention heads now agree."""
    from importlib import import_module

    from engine.loader import _context_length, _num_heads

    module = import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    real = cached_bytes_per_token(model)
    facts = dir_facts(save(model, config, tmp_path / "m", quantize=False))
    assert real > 0 and facts.kv_bytes_per_token == real
    assert facts.num_heads == _num_heads(model, config) == heads
    assert facts.context_length == _context_length(config, None) == context


DEEPSEEK_V32 = dict(
    DEEPSEEK_V2, model_type="deepseek_v32", index_head_dim=32, index_n_heads=4, index_topk=16,
)  # fmt: skip
GLM_MOE_DSA = dict(
    DEEPSEEK_V32, model_type="glm_moe_dsa", routed_scaling_factor=1.0, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1,
    first_k_dense_replace=1, rms_norm_eps=1e-6, attention_bias=False,
    rope_parameters={"rope_theta": 10000.0, "type": "default"},
)  # fmt: skip
LONGCAT = dict(
    model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity",
    hidden_size=128, ffn_hidden_size=256, moe_topk=2, expert_ffn_hidden_size=64,
    n_routed_experts=4, zero_expert_num=2, num_layers=2, vocab_size=256,
    max_position_embeddings=8192, num_attention_heads=8, kv_lora_rank=64, q_lora_rank=96,
    qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, routed_scaling_factor=1.0,
    rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
    attention_bias=False,
)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [DEEPSEEK_V32, GLM_MOE_DSA, LONGCAT],
    ids=["deepseek-v32-indexer", "glm-moe-dsa-indexer", "longcat-flash-two-mla"],
)
def test_caches_of_several_parts_per_layer_are_priced_whole(tmp_path, config):
    """Each layer's cache is a CacheList of two KVCaches: DeepSeek V3.2 and GLM-5
    keep the sparse-attention indexer's keys (index_head_dim wide, and values as
    large) beside the latent, LongCat-Flash two latent attentions. Fit priced one
    latent (LongCat-Flash, whose layers are num_layers, at nothing)."""
    from importlib import import_module

    from engine.loader import probe_layout

    module = import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))  # float32: CPU MoE kernels
    facts = dir_facts(save(model, config, tmp_path / "m", quantize=False))
    assert facts.kv_bytes_per_token == probe_layout(model).bytes_per_token > 0


MAMBA = dict(
    model_type="mamba", vocab_size=256, hidden_size=64, intermediate_size=128, state_size=16,
    num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
)  # fmt: skip
MAMBA2 = dict(
    model_type="mamba2", num_heads=8, head_dim=16, vocab_size=256, hidden_size=64,
    intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
    conv_kernel=4, n_groups=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
    time_step_limit=[0.0, 1e9], time_step_rank=8,
)  # fmt: skip
RWKV7 = dict(
    model_type="rwkv7", vocab_size=256, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
    head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
    decay_low_rank_dim=8,
)  # fmt: skip


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", [MAMBA, MAMBA2, RWKV7], ids=["mamba", "mamba2", "rwkv7"])
def test_a_state_space_model_costs_a_constant_state_per_sequence(tmp_path, config, dtype):
    """mlx-lm gives every layer of Mamba, Mamba 2 and RWKV-7 an ArraysCache: a
    state that does not grow with the context. Fit priced them as attention (a
    Mamba 2.8B at 640 KB a token, 2 sequences of 4k on 16 GB)."""
    from importlib import import_module

    from engine.loader import probe_layout
    from kvcache.layout import LayerKind

    module = import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    real = probe_layout(model)  # Mamba 2's SSM state is float32 whatever the weights
    facts = dir_facts(save(model, config, tmp_path / "m", quantize=False))
    assert facts.kv_bytes_per_token == real.bytes_per_token == 0
    assert facts.layout is not None
    assert [la.kind for la in facts.layout.layers] == [LayerKind.STATE] * len(real.layers)
    assert facts.layout.state_bytes == real.state_bytes > 0
