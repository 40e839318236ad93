"""Read a GGUF file (llama.cpp format): metadata, quantized tensors and the embedded tokenizer.

The file is read with :class:`~goodserve.models.gguf_reader.GGUFFile`. Tensors are kept as the file's
Q4_0/Q4_1/Q8_0 blocks for the low-bit kernels (:mod:`goodserve.models.quant`), its Q5_0/Q5_1 blocks
(:mod:`goodserve.models.q5`) or its Q4_K/Q5_K/Q6_K super-blocks (:mod:`goodserve.models.kquant`), or dequantized (those types in torch, a few thousand rows at a
time; any other with ``gguf.quants``), and renamed to Hugging Face
parameter names (``model.layers.0.self_attn.q_proj.weight``, shape ``[out_features, in_features]``). The
tokenizer comes from :mod:`goodserve.models.gguf_tokenizer`.

GGUF notes:

* GGUF lists tensor dimensions fastest-varying first (``ne`` order); the numpy array the reader gives
  (and what ``gguf.quants.dequantize`` returns) is already row-major ``[out, in]``, i.e. torch order.
* llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` for the ``llama`` architecture so
  that each head's rotary pairs are adjacent (``x[2i], x[2i+1]``, GPT-J style). HF Llama rotates the two
  halves of a head instead (``x[i], x[i + d/2]``). :func:`_unpermute_rotary_rows` restores HF order.
  ``qwen2`` GGUFs are written without that reordering.
* ``deepseek2`` (DeepSeek-V2: multi-head latent attention, DeepSeekMoE) has tensors, metadata and a split
  ``kv_b`` of its own: :mod:`goodserve.models.gguf_deepseek2`.
* ``qwen3moe`` (Qwen3-MoE) stacks each layer's experts in 3-D tensors ``ffn_gate_exps`` / ``ffn_up_exps``
  (``[E, I, hidden]``) and ``ffn_down_exps`` (``[E, hidden, I]``) beside the router ``ffn_gate_inp``, joined
  by :func:`goodserve.models.moe.join_gguf_experts`; with ``keep_quantized`` their blocks are kept, per expert
  (:func:`goodserve.models.moe_blocks.unpack_gguf_experts`), else they are dequantized to the dtype.
* ``gemma3`` (Gemma 3 text) runs as ``gemma3_text``: its norm names, ``1 + w`` norm weights, layer layout and
  score scale follow llama.cpp (:mod:`goodserve.models.gguf_gemma3`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
from typing import Any, Optional, Union

import numpy as np
import torch

from goodserve.model_config import ModelConfig, token_id_list, unique_ids
from goodserve.models.config_support import check_gguf_metadata, check_gguf_tensors
from goodserve.models.gguf_gemma3 import GEMMA3_GGUF_LAYER_NAMES, GGUF_GEMMA3, HF_GEMMA3, gemma3_config_fields, \
    hf_norm_weight
from goodserve.models.gguf_reader import GGUFFile, GGUFTensor
from goodserve.models.kquant import KQUANT_TYPES, unpack_gguf_kquant
from goodserve.models.q5 import Q5_TYPES, unpack_gguf_q5
from goodserve.models.quant import BLOCK_TYPES, BlockQuantized, dequantize_rows, unpack_gguf_blocks
from goodserve.models.checkpoint import (LoadedModel, split_fused_projections, tokenizer_chat_template,
                                        with_tokenizer_eos)
from goodserve.models.gguf_deepseek2 import DEEPSEEK2_LAYER_NAMES, deepseek2_expected_names, deepseek2_fields, join_kv_b
from goodserve.models.gguf_tokenizer import check_split_rule, gguf_tokenizer
from goodserve.models.moe import GGUF_EXPERT_NAMES, join_gguf_experts
from goodserve.models.moe_blocks import (BLOCK_EXPERT_ARCHITECTURES, EXPERT_BLOCK_TYPES, StackedBlocks, experts_mix,
                                         unpack_gguf_experts)

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` values we can run.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "qwen3moe", GGUF_GEMMA3, "deepseek2")
#: GGUF architectures whose every layer's MLP is a mixture of experts, and the HF ``model_type`` they run as.
_GGUF_MOE_ARCHITECTURES = {"qwen3moe": "qwen3_moe"}
#: GGUF architectures that run as a HF ``model_type`` of another name.
_GGUF_HF_ARCHITECTURES = {**_GGUF_MOE_ARCHITECTURES, GGUF_GEMMA3: HF_GEMMA3}

# GGUF tensor name (the part after ``blk.N.``) -> HF name (the part after ``model.layers.N.``).
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Per architecture, what differs from ``_GGUF_LAYER_NAMES`` (``None``: the architecture has no such tensor).
_GGUF_ARCH_LAYER_NAMES: dict[str, dict[str, Optional[str]]] = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "qwen3_moe": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": None,
                 "ffn_up": None, "ffn_down": None, **GGUF_EXPERT_NAMES},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "attn_q": None, "attn_k": None, "attn_v": None,
             "ffn_up": "mlp.gate_up_proj", "ffn_gate": None},
    HF_GEMMA3: GEMMA3_GGUF_LAYER_NAMES,
    "deepseek_v2": {**GGUF_EXPERT_NAMES, **DEEPSEEK2_LAYER_NAMES},
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _gguf_layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``) for ``arch``."""
    names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    return {gguf: hf for gguf, hf in names.items() if hf is not None}


def _unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary row reordering of a Q or K projection.

    Within each head of width ``d``, GGUF row ``2i + j`` (``i < d/2``, ``j in {0, 1}``) holds HF row
    ``j * d/2 + i``. Splitting the head into ``[d/2, 2]`` and swapping the axes restores HF order.

    Args:
        weight: ``[n_heads * d, in_features]`` (or ``[n_heads * d]`` for a bias) in GGUF row order.
        n_heads: Heads in the projection (query heads for Q, KV heads for K).

    Returns:
        The same rows in HF rotate-half order, same shape.
    """
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _gguf_config(reader: GGUFFile, n_tokens: int) -> ModelConfig:
    """The architecture from a GGUF's metadata, every ``{arch}.`` key checked by
    :func:`~goodserve.models.config_support.check_gguf_metadata` and the tensor list by
    :func:`~goodserve.models.config_support.check_gguf_tensors` (no tensor data is read).

    Raises:
        ValueError: on an unsupported architecture, metadata key or value, or tensor.
    """
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    check_gguf_metadata(arch, reader.fields)

    def get(key: str, default: Any = None) -> Any:
        value = reader.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    eos = token_id_list(reader.get("tokenizer.ggml.eos_token_id"))
    eos += token_id_list(reader.get("tokenizer.ggml.eot_token_id"))
    eos += token_id_list(reader.get("tokenizer.ggml.eom_token_id"))
    bos = reader.get("tokenizer.ggml.bos_token_id")
    common: dict[str, Any] = dict(
        vocab_size=n_tokens, hidden_size=hidden, num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
        max_position_embeddings=int(get("context_length")), tie_word_embeddings=not any(
            t.name == "output.weight" for t in reader.tensors), bos_token_id=None if bos is None else int(bos),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)), eos_token_ids=unique_ids(eos),
        rope_theta=float(get("rope.freq_base", 10000.0)))
    if arch == "deepseek2":  # multi-head latent attention, DeepSeekMoE (models/gguf_deepseek2.py)
        config = ModelConfig(**common, **deepseek2_fields(lambda key: reader.get(f"{arch}.{key}"),
                                                          common["num_hidden_layers"], heads))
        split_kv_b = any(t.name.endswith(".attn_k_b.weight") for t in reader.tensors)
        empty = frozenset(t.name for t in reader.tensors if 0 in tuple(t.shape))
        check_gguf_tensors((t.name for t in reader.tensors), deepseek2_expected_names(config, split_kv_b, empty))
        return config
    head_dim = int(reader.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(reader.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"GGUF metadata {arch}.rope.dimension_count={rope_dim} is not supported: partial rotary "
                         f"embeddings (rope dim != head dim {head_dim}) are not implemented")
    value_dim = int(reader.get(f"{arch}.attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise ValueError(f"GGUF metadata {arch}.attention.value_length={value_dim} is not supported: it must equal "
                         f"the key length {head_dim}")

    scaling = None
    scaling_type = reader.get(f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        original = reader.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)

    window = reader.get(f"{arch}.attention.sliding_window")
    gemma3: dict[str, Any] = {}
    if arch == GGUF_GEMMA3:
        gemma3 = gemma3_config_fields(lambda key: reader.get(f"{arch}.{key}"), hidden, heads, head_dim)
        window = gemma3.pop("sliding_window")
    moe: dict[str, Any] = {}
    if arch in _GGUF_MOE_ARCHITECTURES:  # llama.cpp renormalises qwen3moe's top-k weights
        moe = dict(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(get("expert_feed_forward_length")), norm_topk_prob=True)
        if not 0 < moe["num_experts_per_tok"] <= moe["num_experts"]:
            raise ValueError(f"GGUF metadata {arch}.expert_used_count={moe['num_experts_per_tok']} is not "
                             f"supported: expected 1..{moe['num_experts']}")
    config = ModelConfig(
        **common,
        architecture=_GGUF_HF_ARCHITECTURES.get(arch, arch),
        intermediate_size=int(reader.get(f"{arch}.feed_forward_length") or 0 if moe else get("feed_forward_length")),
        num_key_value_heads=int(reader.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_scaling=scaling,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe"),
        sliding_window=int(window) if window else None,
        **moe,
        **gemma3,
    )
    check_gguf_tensors((t.name for t in reader.tensors), _expected_gguf_names(config))
    return config


def _expected_gguf_names(config: ModelConfig) -> set[str]:
    """GGUF names of every tensor the engine reads for ``config`` (``output.weight`` included)."""
    names = set(_GGUF_GLOBAL_NAMES)
    for i in range(config.num_hidden_layers):
        names.update(f"blk.{i}.{part}.weight" for part in _gguf_layer_names(config.architecture))
        if config.attention_bias:
            names.update(f"blk.{i}.attn_{x}.bias" for x in "qkv")
    return names


def _gguf_hf_name(name: str, arch: str) -> Optional[str]:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    layer_names = _gguf_layer_names(arch)
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in layer_names:
        return None
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _rotary_heads(config: ModelConfig, hf_name: str) -> Optional[int]:
    """Heads whose rows llama.cpp reordered in this tensor (Q/K of ``llama``), else ``None``."""
    if config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        return config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
    return None


# GGUF types kept as blocks, and how their bytes unpack.
_UNPACK = {**{t: unpack_gguf_blocks for t in BLOCK_TYPES}, **{t: unpack_gguf_q5 for t in Q5_TYPES},
           **{t: unpack_gguf_kquant for t in KQUANT_TYPES}}


def _unpacks(qtype: str, shape: tuple[int, ...]) -> bool:
    """Whether ``qtype``'s unpacker takes a weight of ``shape``: Q5_0 / Q5_1 in pairs of blocks (rows of a
    multiple of 64 weights; llama.cpp's rows of 32 * odd are dequantized instead)."""
    return qtype not in Q5_TYPES or shape[-1] % 64 == 0


def _gguf_tensor(tensor: GGUFTensor, hf_name: str, config: ModelConfig, dtype: torch.dtype,
                 keep_quantized: bool) -> Union[torch.Tensor, BlockQuantized, StackedBlocks]:
    """One GGUF tensor in HF layout (``[out, in]`` for linear weights): dequantized to ``dtype``, or as the
    file's blocks when ``keep_quantized`` and it is a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 or Q4_K/Q5_K/Q6_K linear weight
    or the token embedding (the tied LM head's weight), or a ``qwen3moe`` layer's stacked experts
    (``[E, out, in]``, :class:`~goodserve.models.moe_blocks.StackedBlocks`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    # torch shape is GGUF's ne order reversed: ne = [in, out] -> [out, in].
    shape = tuple(int(n) for n in reversed(tensor.shape))
    data = tensor.data  # read-only view of the memory map
    heads = _rotary_heads(config, hf_name)
    if config.architecture == HF_GEMMA3 and hf_name.endswith("norm.weight"):  # stored as 1 + w
        array = hf_norm_weight(dequantize(data, qtype).reshape(shape))
        return torch.from_numpy(array).to(dtype)
    if keep_quantized and len(shape) == 3 and ".moe.experts." in hf_name and qtype.name in EXPERT_BLOCK_TYPES \
            and config.architecture in BLOCK_EXPERT_ARCHITECTURES and _unpacks(qtype.name, shape):
        return unpack_gguf_experts(data, qtype.name, shape)
    blocks = hf_name.endswith("proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")
    unpack = _UNPACK.get(qtype.name)
    if keep_quantized and unpack is not None and blocks and len(shape) == 2 and _unpacks(qtype.name, shape):
        weight = unpack(data, qtype.name, shape)
        if heads is not None:
            index = _unpermute_rotary_rows(np.arange(shape[0]), heads)
            weight = weight.permute_rows(torch.from_numpy(index))
        return weight
    if qtype.name in BLOCK_TYPES + Q5_TYPES and len(shape) == 2 and heads is None and _unpacks(qtype.name, shape):
        return dequantize_rows(_UNPACK[qtype.name](data, qtype.name, shape), dtype)  # e.g. a Q8_0 embedding
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(data).reshape(shape)
    else:
        try:
            array = dequantize(data, qtype).reshape(shape)  # float32
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name}: unsupported type {qtype.name}") from exc
    if heads is not None:
        array = _unpermute_rotary_rows(array, heads)
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _gguf_weights(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                  keep_quantized: bool) -> dict[str, Union[torch.Tensor, BlockQuantized]]:
    named = []
    for tensor in reader.tensors:
        hf_name = _gguf_hf_name(tensor.name, config.architecture)
        if hf_name is None:  # _gguf_config refused every tensor without one
            raise RuntimeError(f"GGUF tensor {tensor.name} has no HF name")
        named.append((hf_name, tensor))
    # numpy releases the GIL in its array kernels, so a few threads overlap the per-tensor dequantization.
    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_gguf_tensor, tensor, name, config, dtype, keep_quantized) for name, tensor in named]
        weights = {name: future.result() for (name, _), future in zip(named, futures)}
    split_fused_projections(weights, config)
    join_gguf_experts(weights, config)
    if config.is_mla:
        join_kv_b(weights, config)
    return weights


def tensor_type_mix(tensors: list[GGUFTensor]) -> str:
    """The file's tensor types with their counts, most frequent first (ties by name): ``"Q4_K ×14, F32 ×5"``."""
    counts: dict[str, int] = {}
    for tensor in tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def load_gguf(path: str, dtype: torch.dtype, keep_quantized: bool = False) -> LoadedModel:
    """Load a GGUF file: metadata, tensors (dequantized with numpy, or kept as blocks) and the tokenizer.

    Args:
        path: The ``.gguf`` file.
        dtype: Dtype every dense weight is cast to (quantized tensors are dequantized to float32 first).
        keep_quantized: Keep Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K linear weights (``*proj.weight``), the token
            embedding and the LM head as :class:`~goodserve.models.quant.BlockQuantized` codes, scales and
            minimums, as in the file (K-quants as :class:`~goodserve.models.kquant.KQuantized`, Q5_0 / Q5_1 as
            :class:`~goodserve.models.q5.Q5Quantized`).

    Returns:
        The :class:`LoadedModel` (weights on CPU, HF names, fused projections split); ``vocab_size`` is the
        embedding's rows.

    Raises:
        ValueError: On an unsupported architecture, metadata field, tensor or tensor type.
    """
    reader = GGUFFile(path)
    logger.info("GGUF %s: tensor types: %s", os.path.basename(path), tensor_type_mix(reader.tensors))
    n_tokens = len(reader.get("tokenizer.ggml.tokens", ()))
    config = _gguf_config(reader, n_tokens)
    check_split_rule(reader.fields)
    chat_template = reader.get("tokenizer.chat_template")
    # Build the tokenizer (mostly outside the GIL) while we unpack the weights.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(gguf_tokenizer, reader, path)
        weights = _gguf_weights(reader, config, dtype, keep_quantized)
        del reader
        tokenizer = tokenizer_future.result()
    if experts_mix(weights):
        logger.info("GGUF %s: MoE experts kept as blocks: %s", os.path.basename(path), experts_mix(weights))

    embed_rows = weights["model.embed_tokens.weight"].shape[0]
    if embed_rows != config.vocab_size:
        logger.warning(
            "token list has %d entries but the embedding %d rows; using the latter", config.vocab_size, embed_rows
        )
    config = dataclasses.replace(with_tokenizer_eos(config, tokenizer), vocab_size=embed_rows)
    if chat_template is None:
        chat_template = tokenizer_chat_template(tokenizer)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, chat_template=chat_template)
