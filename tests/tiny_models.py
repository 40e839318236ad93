"""Tiny random Llama-family checkpoints for fast CPU tests.

``make_tiny_hf_model`` writes a HF model directory (config.json, safetensors, generation_config.json and
the SmolLM2 tokenizer) that both :func:`goodserve.models.loader.load_model` and
``transformers.AutoModelForCausalLM.from_pretrained`` can read, so tests can compare the engine with HF
token for token. The vocabulary is the real SmolLM2 one (49152 ids) so real text tokenizes; the other
sizes are tiny (hidden 64, 2 layers), keeping a model at a few million parameters.

``make_tiny_gguf`` writes the same kind of model as an F32 GGUF file, with Q/K rows reordered the way
llama.cpp's converter does for ``llama`` (so the loader's un-permutation is exercised), Qwen3's q/k norms as
``attn_q_norm`` / ``attn_k_norm`` and Phi-3's fused projections as ``attn_qkv`` / ``ffn_up``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

ARCHES = ("llama", "qwen2", "llama3", "mistral", "qwen3", "phi3", "mixtral", "qwen3_moe")
SMOLLM2_VOCAB = 49152


#: Prompts of 5, 17, 33 and 48 token ids (100-4099) for the greedy-equality tests against transformers.
EQUALITY_PROMPTS = [[100 + (7 * i + 3 * j) % 4000 for j in range(n)] for i, n in enumerate((5, 17, 33, 48))]


def hf_greedy(model_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly ``new_tokens`` long (float32, one at a time)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer read from the default GGUF (cached; ~0.5 s the first time)."""
    from transformers import PreTrainedTokenizerFast

    from goodserve.models.loader import default_model_path

    path = default_model_path()
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def tiny_hf_config(arch: str = "llama", tie: Optional[bool] = None, vocab_size: int = SMOLLM2_VOCAB,
                   overrides: Optional[dict[str, Any]] = None) -> Any:
    """A tiny ``transformers`` config of the given family.

    Args:
        arch: ``"llama"``, ``"qwen2"`` (q/k/v bias), ``"llama3"`` (llama3 rope scaling, list of EOS ids),
            ``"mistral"``, ``"qwen3"`` (q/k norms; head_dim 32, not hidden / heads = 16), ``"phi3"`` (fused
            qkv_proj and gate_up_proj), ``"mixtral"`` (4 experts of width 128, top 2) or ``"qwen3_moe"`` (q/k
            norms as qwen3, 8 experts of width 32, top 2, renormalised).
        tie: Tie the LM head to the embeddings; default True except for ``"llama3"`` and ``"phi3"``.
        vocab_size: Number of token ids (keep the SmolLM2 size to tokenize real text).
        overrides: Config keys set on top (e.g. ``{"sliding_window": 24}``, ``{"head_dim": 32}``).

    Returns:
        A ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` / ``Qwen3Config`` / ``Phi3Config`` /
        ``MixtralConfig`` / ``Qwen3MoeConfig``.
    """
    from transformers import (LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    if tie is None:
        tie = arch not in ("llama3", "phi3")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides or {})
    if arch == "llama":
        return LlamaConfig(**{"rope_theta": 100000.0, **common})
    if arch == "llama3":
        common["eos_token_id"] = [2, 0]
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(rope_scaling=scaling, rope_theta=500000.0, **common)
    if arch == "mistral":
        return MistralConfig(**{"rope_theta": 10000.0, "sliding_window": None, **common})
    if arch == "mixtral":
        return MixtralConfig(**{"rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 2, **common})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{"rope_theta": 1000000.0, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "norm_topk_prob": True, **common})
    if arch == "qwen3":
        return Qwen3Config(**{"rope_theta": 1000000.0, "head_dim": 32, **common})
    if arch == "phi3":
        positions = common["max_position_embeddings"]
        return Phi3Config(**{"rope_theta": 10000.0, "original_max_position_embeddings": positions, "pad_token_id": 0,
                             **common})
    return Qwen2Config(**{"rope_theta": 1000000.0, **common})


def make_tiny_hf_model(
    tmp_path: os.PathLike | str,
    arch: str = "llama",
    tie: Optional[bool] = None,
    seed: int = 0,
    max_shard_size: Optional[str] = None,
    overrides: Optional[dict[str, Any]] = None,
) -> str:
    """Build a random tiny model, save it with its tokenizer, and return the directory.

    Norm weights, attention biases and MoE routers are randomized too (HF initializes them to ones / zeros /
    small values), so a test catches a loader or model that ignores them and routing is far from uniform.

    Args:
        tmp_path: Parent folder; the model goes to ``tmp_path / f"tiny-{arch}"``.
        arch: See :func:`tiny_hf_config`.
        tie: See :func:`tiny_hf_config`.
        seed: Seed of the random weights.
        max_shard_size: Passed to ``save_pretrained`` (e.g. ``"1MB"``) to write sharded safetensors.
        overrides: See :func:`tiny_hf_config` (they name the directory too).

    Returns:
        The model directory path.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, tie, overrides=overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # the router (transformers 5 names Mixtral's mlp too)
                param.copy_(torch.randn_like(param))
            elif ".experts." in name:  # experts strong enough that their mix decides the tokens
                param.copy_(0.2 * torch.randn_like(param))
    model.eval()
    extra = f"-{hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]}" if overrides else ""
    out = Path(tmp_path) / f"tiny-{arch}{'-tied' if config.tie_word_embeddings else ''}-{seed}{extra}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    smollm2_tokenizer().save_pretrained(out)
    return str(out)


def _llamacpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Rotary row order llama.cpp writes for ``llama``: within a head, HF row ``j*d/2 + i`` -> row ``2i + j``."""
    out = np.empty_like(weight)
    head_dim = weight.shape[0] // n_heads
    half = head_dim // 2
    for h in range(n_heads):
        for i in range(half):
            for j in range(2):
                out[h * head_dim + 2 * i + j] = weight[h * head_dim + j * half + i]
    return out


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_metadata() -> dict[str, Any]:
    """Tokenizer metadata of the default GGUF (cached)."""
    from goodserve.models.gguf_reader import GGUFFile
    from goodserve.models.loader import default_model_path

    fields = GGUFFile(default_model_path()).fields
    keys = ("model", "pre", "tokens", "token_type", "merges")
    meta = {key: fields[f"tokenizer.ggml.{key}"] for key in keys}
    meta["chat_template"] = fields["tokenizer.chat_template"]
    return meta


def add_shape_metadata(writer: Any, config: Any) -> None:
    """Write the HF ``config``'s shape keys every llama.cpp converter writes: layers, context, widths, heads,
    KV heads and the RMSNorm epsilon."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def add_smollm2_tokenizer(writer: Any, bos: int = 1, eos: int = 2) -> None:
    """Write the default GGUF's byte-level BPE tokenizer (vocabulary, merges, ``smollm`` split) into ``writer``,
    with the given BOS / EOS ids and no BOS added to prompts."""
    meta = _smollm2_tokenizer_metadata()
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_type"])
    writer.add_token_merges(meta["merges"])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)


_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",  # qwen3
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",  # phi3: q/k/v and gate/up fused as in the HF checkpoint
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",  # qwen3_moe's router
}


def make_tiny_gguf(
    tmp_path: os.PathLike | str, arch: str = "llama", tie: bool = True, seed: int = 0, qtype: str = "F32"
) -> tuple[str, dict[str, torch.Tensor]]:
    """Write a tiny random model as a GGUF (with the SmolLM2 tokenizer metadata).

    Args:
        tmp_path: Folder to write ``tiny-{arch}.gguf`` into.
        arch: ``"llama"`` (Q/K rows permuted as llama.cpp does), ``"qwen2"`` (q/k/v biases, no permutation),
            ``"qwen3"`` (q/k norms, head_dim != hidden / heads) or ``"phi3"`` (fused ``attn_qkv`` and
            ``ffn_up``, with the ``rope.scaling.original_context_length`` and zero ``attention.sliding_window``
            llama.cpp's converter writes for it) or ``"qwen3_moe"`` (GGUF arch ``qwen3moe``: ``ffn_gate_inp`` and
            the experts stacked in ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``).
        tie: Omit ``output.weight`` (tied embeddings).
        seed: Seed of the random weights.
        qtype: ``"F32"``, or ``"Q8_0"`` for the linear (``*_proj``) weights (the state dict then holds what the
            blocks encode, dequantized).

    Returns:
        ``(path, state_dict)``: the file and the HF-layout weights it encodes.
    """
    import gguf
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, tie)
    gguf_arch = {"qwen3_moe": "qwen3moe"}.get(arch, arch)
    torch.manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and tie:
            continue
        state[name] = (param + 0.1 * torch.randn_like(param)).contiguous()

    path = str(Path(tmp_path) / f"tiny-{arch}{'' if qtype == 'F32' else '-' + qtype}.gguf")
    writer = gguf.GGUFWriter(path, gguf_arch)
    add_shape_metadata(writer, config)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(0)

    add_smollm2_tokenizer(writer)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(_smollm2_tokenizer_metadata()["chat_template"])

    kv_heads, q_heads = config.num_key_value_heads, config.num_attention_heads
    for name, tensor in state.items():
        array = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        elif ".mlp.experts." in name:  # qwen3_moe: transformers' stacked experts, as llama.cpp stacks them
            layer = name.split(".")[2]
            parts = np.split(array, 2, axis=1) if name.endswith("gate_up_proj") else [array]
            kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            coded = []
            for kind, part in zip(kinds, parts):
                part = np.ascontiguousarray(part)
                if qtype == "F32":
                    writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", part)
                    coded.append(part)
                    continue
                from gguf.quants import dequantize, quantize

                blocks = gguf.GGMLQuantizationType[qtype]
                writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", quantize(part, blocks), raw_dtype=blocks)
                coded.append(dequantize(quantize(part, blocks), blocks).reshape(part.shape))
            state[name] = torch.from_numpy(np.concatenate(coded, axis=1))
            continue
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                array = _llamacpp_permute(array, q_heads if module == "self_attn.q_proj" else kv_heads)
            if qtype != "F32" and module.endswith("_proj") and kind == "weight":
                from gguf.quants import dequantize, quantize

                blocks = gguf.GGMLQuantizationType[qtype]
                writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(array), blocks), raw_dtype=blocks)
                # Blocks quantize each row alone, so the rows' order (llama's permutation) does not matter.
                state[name] = torch.from_numpy(dequantize(quantize(tensor.numpy(), blocks), blocks))
                continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, state
