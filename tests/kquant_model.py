"""The source of ``tests/data/tiny-llama-q4_k_m.gguf``: a tiny random ``llama`` as an F32 GGUF whose shapes
llama.cpp's K-quants take (rows of 256 or 512 weights), with a 512-token byte-level BPE vocabulary cut from
SmolLM2's (its 17 special tokens, 256 bytes and first 239 merges, so the file stays small).

Run as a script to rebuild the test file (needs llama.cpp's ``llama-quantize``; ``tests/data/README.md``)::

    python tests/kquant_model.py /tmp/tiny-llama-f32.gguf
    llama-quantize --tensor-type attn_output=q5_k /tmp/tiny-llama-f32.gguf \\
        tests/data/tiny-llama-q4_k_m.gguf Q4_K_M
"""

from __future__ import annotations

import sys

import numpy as np

from tiny_models import _llamacpp_permute, _smollm2_tokenizer_metadata

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 512, 256, 512, 2, 4, 2
_SPECIAL, _BYTES = 17, 256  # SmolLM2's token ids 0-16 are special, 17-272 the bytes, then one per merge


def write_source_gguf(path: str, seed: int = 0) -> None:
    """Write the F32 model: embedding and projections ``N(0, 1/sqrt(in))`` (the embedding ``N(0, 1)``), norm
    weights ``1 + N(0, 0.1)``, Q/K rows in llama.cpp's rotary order, tied LM head."""
    import gguf

    meta = _smollm2_tokenizer_metadata()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"][:VOCAB])
    writer.add_token_types(meta["token_type"][:VOCAB])
    writer.add_token_merges(meta["merges"][:VOCAB - _SPECIAL - _BYTES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    head_dim = HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", normal(VOCAB, HIDDEN, std=1.0))
    writer.add_tensor("output_norm.weight", 1 + normal(HIDDEN, std=0.1))
    for i in range(LAYERS):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        writer.add_tensor(p + "ffn_norm.weight", 1 + normal(HIDDEN, std=0.1))
        q = normal(HEADS * head_dim, HIDDEN, std=HIDDEN ** -0.5)
        k = normal(KV_HEADS * head_dim, HIDDEN, std=HIDDEN ** -0.5)
        writer.add_tensor(p + "attn_q.weight", _llamacpp_permute(q, HEADS))
        writer.add_tensor(p + "attn_k.weight", _llamacpp_permute(k, KV_HEADS))
        writer.add_tensor(p + "attn_v.weight", normal(KV_HEADS * head_dim, HIDDEN, std=HIDDEN ** -0.5))
        writer.add_tensor(p + "attn_output.weight", normal(HIDDEN, HEADS * head_dim, std=4 * HIDDEN ** -0.5))
        writer.add_tensor(p + "ffn_gate.weight", normal(INTER, HIDDEN, std=HIDDEN ** -0.5))
        writer.add_tensor(p + "ffn_up.weight", normal(INTER, HIDDEN, std=HIDDEN ** -0.5))
        writer.add_tensor(p + "ffn_down.weight", normal(HIDDEN, INTER, std=8 * INTER ** -0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    write_source_gguf(sys.argv[1])
