"""Random-weight GGUF files for benchmarks and tests: a Llama-style dense model or a ``qwen3moe`` mixture of
experts, their projections (and experts) quantized with ``gguf.quants`` as llama.cpp stores them.

The files carry what llama.cpp's loader asks of the architecture (``qwen3moe``: per-head q/k norms, the router
``ffn_gate_inp`` in F32 and the experts stacked in ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``;
``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``), and a byte-level BPE vocabulary cut
from the default model's (SmolLM2: its 17 special tokens, 256 bytes and the first merges, as
``tests/kquant_model.py`` cuts it), so ``goodserve`` and llama.cpp's ``llama-bench`` both load them.

Weights: embedding ``N(0, 1)``; projections and experts ``N(0, 1/in_features)`` (``o_proj`` and ``down`` x4);
router ``N(0, 16/hidden)`` (routing probabilities far from ties); norm weights ``1 + N(0, 0.01)``. Q/K rows of
``llama`` files are random, so llama.cpp's rotary row order needs no permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

_SPECIAL, _BYTES = 17, 256  # SmolLM2's token ids 0-16 are special, 17-272 the bytes, then one per merge


@dataclass(frozen=True)
class RandomShape:
    """The shape of a random model.

    Attributes:
        hidden: Hidden size.
        layers: Decoder layers.
        heads: Query heads.
        kv_heads: KV heads.
        head_dim: Width of one head.
        vocab: Tokens (at least 274, the special tokens and bytes of the cut vocabulary plus one merge; at most
            the default model's 49,152).
        intermediate: SwiGLU width of a dense model's MLP (``0`` for a mixture of experts).
        experts: Experts per MoE layer (``0`` for a dense model).
        top_k: Experts per token.
        moe_intermediate: SwiGLU width of one expert.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 512
    intermediate: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def active_mlp_params(self) -> int:
        """MLP weights one token multiplies per layer: ``3 * hidden * width`` (a MoE's top k experts)."""
        width = self.top_k * self.moe_intermediate if self.is_moe else self.intermediate
        return 3 * self.hidden * width


def write_random_gguf(path: str, shape: RandomShape, qtype: str = "Q4_0", expert_qtype: Optional[str] = None,
                      seed: int = 0) -> None:
    """Write a random model of ``shape`` as a GGUF: ``llama`` (dense) or ``qwen3moe`` (``shape.experts > 0``).

    Args:
        path: The ``.gguf`` file to write.
        shape: The model's shape.
        qtype: GGUF type of the projections (``*_proj``: ``attn_q/k/v/output``, ``ffn_gate/up/down``) and the
            token embedding (the tied LM head): ``"F32"``, ``"F16"``, ``"BF16"``, or a type
            ``gguf.quants.quantize`` writes (``"Q4_0"``, ``"Q4_1"``, ``"Q8_0"``, ...). Norms and the router are
            F32.
        expert_qtype: GGUF type of the stacked experts; default ``qtype``.
        seed: Seed of the weights (numpy's ``default_rng``).

    Raises:
        ValueError: for a type ``gguf.quants`` cannot write, or a vocabulary outside the cut one's range.
    """
    import gguf
    from gguf.quants import quantize

    from goodserve.models.gguf_reader import GGUFFile
    from goodserve.models.loader import default_model_path

    s = shape
    fields = GGUFFile(default_model_path()).fields
    tokens = fields["tokenizer.ggml.tokens"]
    if not _SPECIAL + _BYTES < s.vocab <= len(tokens):
        raise ValueError(f"vocab must be in {_SPECIAL + _BYTES + 1}..{len(tokens)}, got {s.vocab}")
    arch = "qwen3moe" if s.is_moe else "llama"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(s.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.intermediate)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    # general.file_type names the file's main type (llama-bench prints it); each tensor carries its own.
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", gguf.LlamaFileType.ALL_F32))
    if s.is_moe:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.top_k)
        writer.add_expert_feed_forward_length(s.moe_intermediate)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens[:s.vocab])
    writer.add_token_types(fields["tokenizer.ggml.token_type"][:s.vocab])
    writer.add_token_merges(fields["tokenizer.ggml.merges"][:s.vocab - _SPECIAL - _BYTES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    rng = np.random.default_rng(seed)

    def normal(*dims: int, std: float) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float32)

    def add(name: str, array: np.ndarray, kind: str) -> None:
        kind_type = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, array)
        elif kind in ("F16", "BF16"):
            writer.add_tensor(name, quantize(array, kind_type), raw_dtype=kind_type)
        else:
            try:
                data = quantize(array, kind_type)
            except NotImplementedError as exc:
                raise ValueError(f"gguf.quants cannot write {kind}") from exc
            writer.add_tensor(name, data, raw_dtype=kind_type)

    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    add("token_embd.weight", normal(s.vocab, h, std=1.0), qtype)
    add("output_norm.weight", 1 + normal(h, std=0.01), "F32")
    for i in range(s.layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + normal(h, std=0.01), "F32")
        add(p + "ffn_norm.weight", 1 + normal(h, std=0.01), "F32")
        add(p + "attn_q.weight", normal(q, h, std=h ** -0.5), qtype)
        add(p + "attn_k.weight", normal(kv, h, std=h ** -0.5), qtype)
        add(p + "attn_v.weight", normal(kv, h, std=h ** -0.5), qtype)
        add(p + "attn_output.weight", normal(h, q, std=4 * q ** -0.5), qtype)
        if s.is_moe:
            add(p + "attn_q_norm.weight", 1 + normal(s.head_dim, std=0.01), "F32")
            add(p + "attn_k_norm.weight", 1 + normal(s.head_dim, std=0.01), "F32")
            e, w = s.experts, s.moe_intermediate
            add(p + "ffn_gate_inp.weight", normal(e, h, std=4 * h ** -0.5), "F32")
            add(p + "ffn_gate_exps.weight", normal(e, w, h, std=h ** -0.5), expert_qtype or qtype)
            add(p + "ffn_up_exps.weight", normal(e, w, h, std=h ** -0.5), expert_qtype or qtype)
            add(p + "ffn_down_exps.weight", normal(e, h, w, std=4 * w ** -0.5), expert_qtype or qtype)
        else:
            add(p + "ffn_gate.weight", normal(s.intermediate, h, std=h ** -0.5), qtype)
            add(p + "ffn_up.weight", normal(s.intermediate, h, std=h ** -0.5), qtype)
            add(p + "ffn_down.weight", normal(h, s.intermediate, std=4 * s.intermediate ** -0.5), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
