"""What loading a checkpoint yields, and the tokenizer steps every checkpoint format shares.

:class:`LoadedModel` is the result of :func:`goodserve.models.loader.load_model`, whichever format the
weights came in (:mod:`~goodserve.models.hf_dir`, :mod:`~goodserve.models.gguf_file`). Both formats ship
a tokenizer, read here with ``transformers``, whose EOS id joins the config's and which may carry the
chat template.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from goodserve.config import ModelConfig, unique_ids


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint.

    Attributes:
        config: The architecture.
        weights: HF parameter name -> tensor in the requested dtype on CPU. Linear weights are
            ``[out_features, in_features]``; ``lm_head.weight`` is absent when embeddings are tied.
        tokenizer: A ``transformers`` fast tokenizer, or for a GGUF with a GPT-2-style vocabulary a
            :class:`~goodserve.models.gguf_tokenizer.GGUFTokenizer` (the same API, transformers built on demand).
        chat_template: Jinja chat template, or ``None`` if the checkpoint has none.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    chat_template: Optional[str]


def load_hf_tokenizer(path: str) -> Any:
    """The ``transformers`` fast tokenizer of a HF model directory (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_gguf_tokenizer(path: str) -> Any:
    """The ``transformers`` fast tokenizer embedded in a GGUF file."""
    # PreTrainedTokenizerFast reads only the tokenizer metadata (~0.5 s); AutoTokenizer would first parse
    # the whole file again to build a model config (~3 s) and ends up with the same class and vocabulary.
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(path)
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def with_tokenizer_eos(config: ModelConfig, tokenizer: Any) -> ModelConfig:
    """``config`` with the tokenizer's EOS id added to its EOS ids (no repeats, config's first)."""
    eos = list(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    return dataclasses.replace(config, eos_token_ids=unique_ids(eos))


def tokenizer_chat_template(tokenizer: Any) -> Optional[str]:
    """The tokenizer's Jinja chat template, or ``None`` when it has none."""
    return getattr(tokenizer, "chat_template", None)
