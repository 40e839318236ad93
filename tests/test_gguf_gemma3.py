"""Gemma 3 text from a llama.cpp GGUF (``general.architecture`` ``gemma3``) against HF transformers.

A tiny random Gemma 3 (seven layers: llama.cpp's hard-coded layout slides all but layer 5; window 8; local RoPE
base 10000 as llama.cpp fixes it; linear RoPE scaling on the global layer; ``query_pre_attn_scalar`` = head width,
which is what llama.cpp derives for it) is written as llama.cpp's converter writes it: its tensor names, every
``*norm.weight`` stored as ``1 + w``, its metadata, F32 (and Q8_0 for the 2-D weights). ``load_model`` must give
the HF directory's ModelConfig and the engine HF's greedy tokens (float32) on prompts longer than the window.
What the file says that the engine cannot honour is refused by name before any tensor is read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.models.loader import load_model
from test_gemma3 import make_tiny_gemma3
from tiny_models import EQUALITY_PROMPTS, add_shape_metadata, add_smollm2_tokenizer, hf_greedy

W, NEW = 8, 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
OVERRIDES = dict(num_hidden_layers=7, layer_types=LAYER_TYPES, query_pre_attn_scalar=16,
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# HF name after ``model.layers.N.`` -> llama.cpp's (gguf-py MODEL_TENSORS for GEMMA3).
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def _writer(path: str, config, extra: dict | None = None, window: bool = True):
    """A GGUFWriter holding the metadata llama.cpp's Gemma3Model converter writes for ``config``."""
    writer = gguf.GGUFWriter(path, "gemma3")
    add_shape_metadata(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    full = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    if window:  # the converter leaves it out for a model without local layers
        writer.add_sliding_window(config.sliding_window)
    local = (config.rope_parameters or {}).get("sliding_attention", {}).get("rope_theta")
    if window and local is not None and "rope_freq_base_swa" not in (extra or {}):  # as current converters
        writer.add_rope_freq_base_swa(float(local))
    for key, value in (extra or {}).items():
        getattr(writer, f"add_{key}")(value)
    add_smollm2_tokenizer(writer, config.bos_token_id, config.eos_token_id)
    return writer


def write_gemma3_gguf(hf_dir: str, path: str, qtype: str = "F32") -> dict[str, torch.Tensor]:
    """Convert the HF directory as llama.cpp's converter does (norms + 1, no q/k row reordering, tied head
    left out); ``qtype`` ``"Q8_0"`` stores every 2-D weight in Q8_0 blocks (norms stay F32).

    Returns:
        The HF state dict the file encodes (the blocks dequantized).
    """
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    state = {k: v for k, v in load_file(str(Path(hf_dir) / "model.safetensors")).items() if k != "lm_head.weight"}
    writer = _writer(path, config)
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):  # Gemma3RMSNorm's 1 + w, as the converter stores it
            writer.add_tensor(_gguf_name(name), (array + 1.0).astype(np.float32))
        elif qtype != "F32" and array.ndim == 2:
            blocks = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(_gguf_name(name), quantize(array, blocks), raw_dtype=blocks)
            state[name] = torch.from_numpy(dequantize(quantize(array, blocks), blocks).reshape(array.shape))
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def _hf_twin(hf_dir: str, state: dict[str, torch.Tensor], out: Path) -> str:
    """The HF model with ``state``'s weights (what a Q8_0 file encodes), saved to ``out``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("g3gguf")
    hf_dir = make_tiny_gemma3(tmp, **OVERRIDES)
    path = str(tmp / "tiny-gemma3.gguf")
    write_gemma3_gguf(hf_dir, path)
    return hf_dir, path, hf_greedy(hf_dir, EQUALITY_PROMPTS, NEW)


def test_config_equals_the_hf_directory(gemma3_gguf):
    """Every ModelConfig field (rope_scaling included) equals the HF directory's, up to the float32 epsilon and the
    tokenizer's EOS ids; layer 5 is the only global layer; the KV cache gets the same groups."""
    hf_dir, path, _ = gemma3_gguf
    hf, ours = load_model(hf_dir).config, load_model(path).config
    assert ours.architecture == "gemma3_text"
    assert ours.layer_types == tuple(LAYER_TYPES) and ours.sliding_window == W
    assert (ours.rope_theta, ours.rope_local_theta, ours.query_pre_attn_scalar) == (100000.0, 10000.0, 16.0)
    assert ours.rope_scaling == hf.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    # GGUF stores the epsilon as a float32 (the same float32 the model computes with); EOS ids come from each
    # source's tokenizer (the HF directory's adds its tokenizer's <|im_end|>).
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    assert set(ours.eos_token_ids) <= set(hf.eos_token_ids)
    same = dict(rms_norm_eps=hf.rms_norm_eps, eos_token_ids=hf.eos_token_ids)
    assert dataclasses.asdict(dataclasses.replace(ours, **same)) == dataclasses.asdict(hf)
    assert ours.kv_cache_layout() == hf.kv_cache_layout()


def test_norms_lose_the_converters_one(gemma3_gguf):
    """The loader's weights are the HF checkpoint's, q/k rows unpermuted; the norms, stored as float32 ``1 + w``,
    come back as ``w`` up to that rounding, and the scale the model computes, ``1 + w``, is exactly HF's."""
    from safetensors.torch import load_file

    hf_dir, path, _ = gemma3_gguf
    ref = load_file(str(Path(hf_dir) / "model.safetensors"))
    ours = load_model(path).weights
    assert set(ours) == {k for k in ref if k != "lm_head.weight"}
    for name, tensor in ref.items():
        if name != "lm_head.weight":
            if "norm" in name:
                torch.testing.assert_close(ours[name], tensor, rtol=0, atol=2.5e-7, msg=name)
                assert torch.equal(1.0 + ours[name], 1.0 + tensor), name
            else:
                assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("budget, hybrid", [(512, True), (7, True), (7, False)])
def test_greedy_equals_hf(gemma3_gguf, budget, hybrid):
    """The engine's greedy tokens on the GGUF equal transformers' on the HF model (prompts of 5-48 tokens, 12
    outputs, window 8): one batch and chunked (budget 7), with KV-cache groups and with one full group."""
    _, path, refs = gemma3_gguf
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=256, max_num_batched_tokens=budget,
              disable_hybrid_kv_cache_manager=not hybrid, log_stats_interval=0)
    assert llm.engine.max_model_len > W
    layout = load_model(path).config.kv_cache_layout(hybrid)
    assert llm.engine.config.cache.group_windows == layout.group_windows
    assert set(layout.group_windows) == ({None, W} if hybrid else {None})
    assert [o.token_ids for o in llm.generate(EQUALITY_PROMPTS, GREEDY, use_tqdm=False)] == refs
    llm.engine.core.scheduler.kv_cache_manager.check_integrity()


def test_q8_0_equals_hf_on_the_dequantized_weights(gemma3_gguf, tmp_path):
    """A Q8_0 file (2-D weights in blocks, the embedding too) gives HF's greedy tokens on what the blocks encode."""
    hf_dir = gemma3_gguf[0]
    path = str(tmp_path / "tiny-gemma3-q8_0.gguf")
    state = write_gemma3_gguf(hf_dir, path, "Q8_0")
    refs = hf_greedy(_hf_twin(hf_dir, state, tmp_path / "twin"), EQUALITY_PROMPTS, NEW)
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=256, max_num_batched_tokens=7, log_stats_interval=0)
    assert [o.token_ids for o in llm.generate(EQUALITY_PROMPTS, GREEDY, use_tqdm=False)] == refs


def test_layout_as_llamacpp_runs_it(tmp_path):
    """llama.cpp's layout: every sixth layer global (13 layers: 5 and 11); no window: every layer global; the
    62-layer (27B) model scales scores by (hidden / heads) ** -0.5, others by key_length ** -0.5."""
    from goodserve.models.gguf_file import _gguf_config
    from goodserve.models.gguf_reader import GGUFFile

    def config(layers, window, hidden=64, extra=None):
        from transformers import Gemma3TextConfig

        cfg = Gemma3TextConfig(vocab_size=512, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window or 8,
                               max_position_embeddings=1024)
        path = str(tmp_path / f"g{layers}-{window}-{hidden}-{bool(extra)}.gguf")
        writer = _writer(path, cfg, extra, window=bool(window))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return _gguf_config(GGUFFile(path), 512)

    c = config(13, 8)
    assert [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"] == [5, 11]
    assert (c.sliding_window, c.rope_local_theta, c.query_pre_attn_scalar) == (8, 10000.0, 16.0)
    c = config(13, 0)
    assert c.layer_types == ("full_attention",) * 13 and c.sliding_window is None
    assert config(62, 8, hidden=672).query_pre_attn_scalar == 168.0
    # The local RoPE base current converters write (rope.freq_base_swa) is read.
    assert config(13, 8, extra={"rope_freq_base_swa": 20000.0}).rope_local_theta == 20000.0


@pytest.mark.parametrize("extra, match", [
    ({"final_logit_softcapping": 30.0}, "gemma3.final_logit_softcapping=30.0 .*final logit soft-capping"),
    ({"attn_logit_softcapping": 50.0}, "gemma3.attn_logit_softcapping=50.0 .*attention logit soft-capping"),
    ({"sliding_window_pattern": 4}, "gemma3.attention.sliding_window_pattern=4 .*every 6th layer global"),
    ({"rope_scaling_type": gguf.RopeScalingType.YARN}, "gemma3.rope.scaling.type='yarn' .*none and linear"),
    ({"attention_scale": 0.5}, "gemma3.attention.scale=0.5 .*custom attention scale"),
])
def test_refused_by_name_before_weights(tmp_path, extra, match):
    """Metadata the engine cannot honour is refused naming the key, from a file without any tensor."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    path = str(tmp_path / "refused.gguf")
    writer = _writer(path, cfg, extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"GGUF metadata {match}"):
        load_model(path)


def test_llamacpps_layout_pattern_key_accepted(tmp_path):
    """An ``attention.sliding_window_pattern`` saying what llama.cpp does anyway (6) is accepted."""
    from transformers import Gemma3TextConfig

    from goodserve.models.gguf_file import _gguf_config
    from goodserve.models.gguf_reader import GGUFFile

    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    for value in (6, [i % 6 < 5 for i in range(7)]):
        path = str(tmp_path / f"p{len(str(value))}.gguf")
        writer = _writer(path, cfg, {"sliding_window_pattern": value})
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        assert _gguf_config(GGUFFile(path), 512).layer_types == tuple(LAYER_TYPES)
