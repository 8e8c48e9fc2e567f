"""GGUF -> mlx-lm directory: tensor names, config, tokenizer, caching."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models import llama
from tokenizers import pre_tokenizers

from engine.gguf_convert import convert_gguf, converted_dir
from engine.model_errors import UnsupportedModelError

CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 261,
    "rope_theta": 10000.0,
    "rope_traditional": True,
    "tie_word_embeddings": True,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{HF_TO_GGUF[module]}.weight"


def write_gguf(path, arch="llama", seed=0):
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    tensors = {_gguf_name(k): v for k, v in tree_flatten(model.parameters())}
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "<s>", "</s>", "<pad>"]
    metadata = {
        "general.architecture": arch,
        "llama.embedding_length": mx.array(32, dtype=mx.uint32),
        "llama.block_count": mx.array(2, dtype=mx.uint32),
        "llama.feed_forward_length": mx.array(64, dtype=mx.uint32),
        "llama.attention.head_count": mx.array(4, dtype=mx.uint32),
        "llama.attention.head_count_kv": mx.array(2, dtype=mx.uint32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": mx.array(512, dtype=mx.uint32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["h e", "l l"],
        "tokenizer.ggml.token_type": mx.array([1] * 258 + [3, 3, 3], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(258, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(259, dtype=mx.uint32),
        "tokenizer.chat_template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
    }
    mx.save_gguf(str(path), tensors, metadata)
    return model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWARM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_converted_model_computes_what_the_original_computes(tmp_path, cache_dir):
    gguf = tmp_path / "tiny-llama.F32.gguf"
    original = write_gguf(gguf)
    out = convert_gguf(gguf, dequantize=True)
    assert out.parent == cache_dir / "models"
    model, tokenizer = mlx_lm_load(str(out))
    ids = mx.array([[5, 17, 99, 200, 3]])
    assert mx.allclose(model(ids), original(ids), atol=1e-5).item()
    assert tokenizer.eos_token_id == 259
    # smollm pre-tokenizer: every digit is its own token; merges apply
    assert tokenizer.decode(tokenizer.encode("hello 42")) == "hello 42"
    assert tokenizer.encode("hell", add_special_tokens=False) == [256, 257]  # he + ll
    assert len(tokenizer.encode("42", add_special_tokens=False)) == 2
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[user]hi"


def test_conversion_happens_once(tmp_path, cache_dir):
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf)
    lines = []
    first = convert_gguf(gguf, dequantize=True, progress=lines.append)
    second = convert_gguf(gguf, dequantize=True, progress=lines.append)
    assert first == second == converted_dir(gguf, True)
    assert sum("converting" in ln for ln in lines) == 1


def test_non_llama_gguf_is_refused(tmp_path, cache_dir):
    gguf = tmp_path / "other.gguf"
    write_gguf(gguf, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        convert_gguf(gguf, dequantize=True)
    assert not any(cache_dir.glob("models/other*"))


@pytest.mark.parametrize(
    "tensor, why",
    [
        ("blk.0.ffn_up_exps.weight", "mixture-of-experts GGUFs are not converted"),
        ("blk.0.ffn_gate_inp.weight", "mixture-of-experts GGUFs are not converted"),
        ("blk.0.ssm_conv1d.weight", "unexpected GGUF tensor 'blk.0.ssm_conv1d.weight' for llama"),
    ],
)
def test_a_tensor_it_has_no_name_for_is_refused_saying_why(tensor, why):
    """A Mixtral GGUF (llama architecture) was refused only as "unexpected GGUF tensor
    'blk.0.ffn_up_exps.weight' for llama": nothing said it was a mixture of experts."""
    from engine.gguf_archs import ARCHS
    from engine.gguf_convert import _rename

    with pytest.raises(UnsupportedModelError, match=why):
        _rename(tensor, ARCHS["llama"])
    assert _rename("blk.0.ffn_up.weight", ARCHS["llama"]) == "model.layers.0.mlp.up_proj.weight"


def test_a_conversion_killed_midway_leaves_nothing_behind(tmp_path, cache_dir):
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf)
    target = converted_dir(gguf, True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = target.parent / f".{target.name}-{dead.pid}-x1y2"
    live = target.parent / f".{target.name}-{os.getpid()}-z3"  # still converting elsewhere
    for d in (abandoned, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    convert_gguf(gguf, dequantize=True)
    assert not abandoned.exists() and live.exists()
