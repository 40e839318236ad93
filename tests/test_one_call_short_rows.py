"""Steps of decodes and short chunks (rows verifying speculative drafts) in the one-call decode step
(``native_decode.decode_layers``, issue 33): each token one row, equal to the layer-by-layer path."""

from pathlib import Path

import pytest
import torch

from goodserve.models import native
from goodserve.models.attention import AttentionMetadata, NativeAttentionBackend
from goodserve.models.invariant import kernel_mode
from goodserve.models.llama import LlamaForCausalLM
from goodserve.models.short_rows import MAX_SHORT_CHUNK, as_decode_rows, decode_rows
from test_block_gemv import _config, _model, _weights

pytestmark = pytest.mark.skipif(not native.block_gemv_usable(torch.empty(0)),
                                reason="the block kernel needs AVX-512 VNNI or AVX2 and a C++ compiler")

BS = 4  # tokens per block
CPU = torch.device("cpu")
TINY_Q4_K_M = str(Path(__file__).parent / "data" / "tiny-llama-q4_k_m.gguf")


def _step(decodes: list[tuple[list[int], int]], chunks: list[tuple[list[int], int, int]], per_row: bool = False,
          decode_groups: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """``positions`` and the metadata of a step: ``decodes`` ``(table, position)`` first, then ``chunks``
    ``(table, num_computed, num_new)``."""
    positions = [p for _, p in decodes] + [p for _, c, n in chunks for p in range(c, c + n)]
    tables = [t for t, _ in decodes] + [t for t, c, n in chunks for _ in range(n)]
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(tables, positions)])
    meta = AttentionMetadata.build(BS, [t[: p // BS + 1] for t, p in decodes], [p + 1 for _, p in decodes],
                                   [(c, n, t) for t, c, n in chunks], slots, CPU, decode_groups=decode_groups,
                                   per_row=per_row)
    return torch.tensor(positions), meta


def test_decode_rows_are_every_tokens_table_and_context_in_flat_order():
    a, b = [0, 1, 2], [3, 4, 5, 6, 7]
    positions, meta = _step([(a, 6)], [(b, 13, 4)])
    assert as_decode_rows(meta, 5)
    tables, seq_lens, max_len = decode_rows(meta)
    assert tables.dtype == seq_lens.dtype == torch.int32
    assert tables.tolist() == [[0, 1, 0, 0, 0]] + [[3, 4, 5, 6, 7]] * 4  # a chunk's tokens share its table
    assert seq_lens.tolist() == (positions + 1).tolist() == [7, 14, 15, 16, 17] and max_len == 17
    _, meta = _step([], [(b, 13, 5)])  # a lone chunk: its own rows
    assert as_decode_rows(meta, 5) and decode_rows(meta)[1].tolist() == [14, 15, 16, 17, 18]
    _, meta = _step([(a, 6), (b, 9)], [])  # decodes alone: the metadata's own tensors
    assert as_decode_rows(meta, 2) and decode_rows(meta)[0] is meta.decode_block_tables


def test_only_decodes_and_short_chunks_after_a_cached_context_are_decode_rows():
    a, b = [0, 1, 2], list(range(3, 12))
    assert not as_decode_rows(_step([(a, 6)], [(b, 0, 3)])[1], 4)  # a fresh prompt
    assert not as_decode_rows(_step([], [(b, 0, 3)])[1], 3)
    long = MAX_SHORT_CHUNK + 1
    assert not as_decode_rows(_step([(a, 6)], [(b, 2, long)])[1], 1 + long)
    assert not as_decode_rows(_step([(a, 6)], [(b, 13, 4), (b, 0, 2)])[1], 7)  # a short chunk and a prompt
    # decode groups (the torch backend) give no short rows
    assert not as_decode_rows(_step([(a, 6)], [(b, 13, 4)], decode_groups=True)[1], 5)
    # per-row tables (batch-invariant): every token is a row already, in any step
    assert as_decode_rows(_step([(a, 6)], [], per_row=True)[1], 1)
    positions, meta = _step([(a, 6)], [(b, 13, 4), (b, 0, 2)], per_row=True)
    assert as_decode_rows(meta, 7) and decode_rows(meta)[0] is meta.row_block_tables
    assert decode_rows(meta)[1].tolist() == (positions + 1).tolist() and decode_rows(meta)[2] == 17
    assert as_decode_rows(_step([(a, 6)], [(b, 2, long)], per_row=True)[1], 1 + long)


def test_the_one_call_step_takes_at_most_the_plans_rows():
    c = _config()
    model, attn = _model(c, _weights(c)), NativeAttentionBackend()
    assert model.decode_plan.max_rows == 8
    tables = [[4 * i + j for j in range(4)] for i in range(3)]
    assert model.can_decode_in_one_call(8, _step([(tables[0], 5)], [(tables[1], 7, 4), (tables[2], 2, 3)])[1], attn)
    assert not model.can_decode_in_one_call(9, _step([(tables[0], 5)], [(tables[1], 7, 5), (tables[2], 2, 3)])[1],
                                            attn)
    assert not model.can_decode_in_one_call(5, _step([(tables[0], 5)], [(tables[1], 0, 4)])[1], attn)


def test_decodes_and_short_chunks_in_one_call_equal_the_layer_by_layer_path():
    """Four requests prefill, then steps of one decode and a 4-token chunk, a lone 5-token chunk, and two
    decodes with two 3-token chunks (8 rows): each step's hidden states and KV writes from the one-call step
    equal the layer-by-layer path's, and a chunk's tokens equal the same tokens decoded one per step."""
    c = _config()
    model, attn = _model(c, _weights(c)), NativeAttentionBackend()
    shape = (40, BS, c.num_key_value_heads, c.head_dim)
    caches = {way: [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
                    for _ in range(c.num_hidden_layers)] for way in ("one call", "layers", "decodes")}
    tables = [[10 * i + j for j in range(10)] for i in range(4)]
    prompts = [[5, 9, 11, 3, 7], [1, 2, 8, 8, 8, 8, 8, 8, 8], [4, 6, 9], [7, 7, 1, 2, 3, 5, 7, 11, 13, 17, 19]]
    lens = [len(p) for p in prompts]
    ids = iter(range(20, 500))
    with torch.inference_mode():
        for way, kv in caches.items():
            for table, prompt in zip(tables, prompts):
                positions, meta = _step([], [(table, 0, len(prompt))])
                model(torch.tensor(prompt), positions, kv, meta, attn)
        for decodes, chunks in (([0], [(1, 4)]), ([], [(2, 5)]), ([3, 0], [(1, 3), (2, 3)])):
            decodes = sorted(decodes, key=lambda i: lens[i])  # as the runner lays them out
            positions, meta = _step([(tables[i], lens[i]) for i in decodes],
                                    [(tables[i], lens[i], n) for i, n in chunks])
            tokens = torch.tensor([next(ids) for _ in positions])
            assert model.can_decode_in_one_call(len(tokens), meta, attn)
            fused = model.decode_in_one_call(tokens, positions, caches["one call"], meta, attn)
            assert meta.short_rows is not None and fused.shape == (len(tokens), c.hidden_size)
            assert torch.equal(fused, model(tokens, positions, caches["layers"], meta, attn))
            alone = []  # every token a decode step of its own, in order
            for table, token, position in zip([tables[i] for i in decodes]
                                              + [tables[i] for i, n in chunks for _ in range(n)], tokens, positions):
                one_pos, one = _step([(table, int(position))], [])
                alone.append(model.decode_in_one_call(token[None], one_pos, caches["decodes"], one, attn))
            assert torch.equal(fused, torch.cat(alone))
            for i in decodes:
                lens[i] += 1
            for i, n in chunks:
                lens[i] += n
    for way in ("layers", "decodes"):
        for (k1, v1), (k2, v2) in zip(caches["one call"], caches[way]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), way


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_greedy_tokens_with_ngram_speculation_in_one_call_equal_those_without(monkeypatch, batch_invariant):
    """``tests/data/tiny-llama-q4_k_m.gguf`` in bfloat16 on the block kernel (or, batch-invariant, on the
    invariant GEMM), two requests batched: with n-gram speculation (k = 3), the steps that verify drafts run in
    one native call, and the greedy tokens equal the run without speculation token for token."""
    from goodserve import LLM, SamplingParams

    calls = {"short": 0, "all": 0}
    one_call = LlamaForCausalLM.decode_in_one_call

    def counted(self, input_ids, positions, kv_caches, meta, attn):
        calls["all"] += 1
        calls["short"] += bool(meta.prefills)
        return one_call(self, input_ids, positions, kv_caches, meta, attn)

    monkeypatch.setattr(LlamaForCausalLM, "decode_in_one_call", counted)
    base = [100 + (7 * i) % 50 for i in range(30)]
    prompts = [base * 2, [5, 6, 7, 8] * 10]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs, stats = {}, None
    for spec in (False, True):
        kw = dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
                  speculative_length="3") if spec else {}
        llm = LLM(TINY_Q4_K_M, dtype="bfloat16", quantization="auto", block_size=4, num_blocks=256,
                  log_stats_interval=0, batch_invariant=batch_invariant, **kw)
        runs[spec] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if spec:
            stats = llm.engine.make_stats()
    assert runs[True] == runs[False]
    assert stats.num_spec_accepted_tokens_total > 0
    # steps verifying drafts took the one-call path (batch-invariant: where its GEMM has a native kernel)
    assert calls["short"] > 0 or (batch_invariant and kernel_mode() == "none")
