"""The decoder and the paged attention backend against HF ``transformers`` on tiny random models.

Logits must match HF's for a whole prompt, for the same prompt split into chunks over the paged cache
(C02: each chunk attends to all earlier KV at the right positions), and for decodes batched with others.
"""

import pytest
import torch
import transformers

from goodserve.config import ModelConfig
from goodserve.models.llama import LlamaForCausalLM, rope_inv_freq
from goodserve.models import native
from goodserve.models.attention import AttentionMetadata, TorchAttentionBackend, make_attention_backend

BLOCK = 4


def _tiny(arch: str):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0)
    if arch == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "llama3":
        hf_cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    else:
        hf_cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    cfg = ModelConfig(
        architecture=arch, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=hf_cfg.num_key_value_heads, head_dim=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=hf_cfg.rope_scaling if arch == "llama3" else None,
        attention_bias=arch == "qwen2", tie_word_embeddings=hf_cfg.tie_word_embeddings)
    ours = LlamaForCausalLM(cfg)
    weights = dict(hf.state_dict())
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    ours.load_weights(weights)
    return hf, ours, cfg


def _caches(cfg, num_blocks=32):
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]


def _slots(table, start, end):
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3"])
def test_prefill_chunks_and_decodes_match_hf(arch):
    """C02: chunked prefill over the paged cache gives HF's logits at every position."""
    hf, ours, cfg = _tiny(arch)
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (23,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [23, vocab]
    attn = TorchAttentionBackend()
    caches = _caches(cfg)
    table = [5, 2, 9, 0, 7, 11]  # deliberately scattered blocks
    got = []
    # chunks of 7, 7, 9 tokens (not block aligned)
    for start, end in ((0, 7), (7, 14), (14, 23)):
        meta = AttentionMetadata.build(BLOCK, [], [], [(start, end - start, table)],
                                       torch.tensor(_slots(table, start, end)), torch.device("cpu"))
        with torch.no_grad():
            h = ours(ids[start:end], torch.arange(start, end), caches, meta, attn)
            got.append(ours.compute_logits(h))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_batched_decodes_with_a_prefill_match_hf(backend):
    """Two decodes of different context lengths plus one fresh prefill in one flat batch, on the portable
    backend and on the native kernel (which reads the decodes' blocks in place)."""
    if backend == "native" and not native.load():
        pytest.skip("the native kernel cannot be built here")
    hf, ours, cfg = _tiny("llama")
    torch.manual_seed(2)
    a, b, c = torch.randint(0, 97, (10,)), torch.randint(0, 97, (17,)), torch.randint(0, 97, (6,))
    attn = make_attention_backend(backend, torch.device("cpu"))
    grouped = attn.uses_decode_groups
    caches = _caches(cfg)
    ta, tb, tc = [1, 3, 4], [6, 8, 10, 12, 14], [20, 21]
    # prefill a[:-1] and b[:-1] first
    meta = AttentionMetadata.build(BLOCK, [], [], [(0, 9, ta), (0, 16, tb)],
                                   torch.tensor(_slots(ta, 0, 9) + _slots(tb, 0, 16)), torch.device("cpu"))
    with torch.no_grad():
        ours(torch.cat([a[:9], b[:16]]), torch.cat([torch.arange(9), torch.arange(16)]), caches, meta, attn)
        # now: decode a's and b's last token, together with c's whole prefill
        meta = AttentionMetadata.build(BLOCK, [ta[:3], tb[:5]], [10, 17], [(0, 6, tc)],
                                       torch.tensor(_slots(ta, 9, 10) + _slots(tb, 16, 17) + _slots(tc, 0, 6)),
                                       torch.device("cpu"), decode_groups=grouped)
        h = ours(torch.cat([a[9:], b[16:], c]), torch.cat([torch.tensor([9, 16]), torch.arange(6)]),
                 caches, meta, attn)
        logits = ours.compute_logits(h)
        torch.testing.assert_close(logits[0], hf(a[None]).logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[1], hf(b[None]).logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[2:], hf(c[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_unknown_rope_scaling_is_refused():
    cfg = ModelConfig("llama", 10, 8, 8, 1, 1, 1, 8, 16, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        rope_inv_freq(cfg)


def test_decode_groups_bound_padding():
    """Sorted decodes are cut where padding to the group's longest would exceed 25% of real blocks."""
    from goodserve.models.attention import group_decodes

    assert group_decodes([1, 1, 1, 2, 2, 10, 10, 11]) == [(0, 3), (3, 5), (5, 8)]
    assert group_decodes([4, 4, 4]) == [(0, 3)]
    assert group_decodes([]) == []
    with pytest.raises(ValueError, match="sorted"):
        group_decodes([3, 1])


def test_padded_rows_change_nothing_and_never_touch_the_cache(monkeypatch):
    """A 131-token prefill runs on 144 GEMM rows; logits equal HF's and the KV cache holds exactly the 131
    prompt tokens (the 13 padding rows skip attention, so no slot beyond them is written)."""
    from goodserve.models import llama

    assert [llama.padded_num_tokens(n) for n in (1, 128, 129, 131, 144, 145, 1000)] == [1, 128, 144, 144, 144,
                                                                                     160, 1008]
    hf, ours, cfg = _tiny("llama")
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (131,))
    table = list(range(33))  # 132 slots
    seen = []
    real_forward = llama.DecoderLayer.forward

    def spy(self, x, *args):
        seen.append(x.shape[0])
        return real_forward(self, x, *args)

    monkeypatch.setattr(llama.DecoderLayer, "forward", spy)
    caches = _caches(cfg, num_blocks=34)
    meta = AttentionMetadata.build(BLOCK, [], [], [(0, 131, table)], torch.tensor(_slots(table, 0, 131)),
                                   torch.device("cpu"))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, torch.arange(131), caches, meta, TorchAttentionBackend()))
        ref = hf(ids[None]).logits[0]
    assert seen == [144, 144] and logits.shape == (131, 97)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    k_cache = caches[0][0].view(-1, cfg.num_key_value_heads, cfg.head_dim)
    assert k_cache[:131].abs().sum(dim=(1, 2)).gt(0).all() and k_cache[131:].abs().sum() == 0


def test_lone_decode_on_consecutive_blocks_reads_the_cache_in_place():
    """Issue 15: a single decode whose blocks are consecutive ids attends over a view of the cache (no
    gather); the result equals the gathered path's, and scattered or batched decodes still gather."""
    torch.manual_seed(3)
    nkv, hd, heads = 2, 16, 4
    k_cache, v_cache = torch.randn(12, BLOCK, nkv, hd), torch.randn(12, BLOCK, nkv, hd)
    q, k, v = torch.randn(1, heads, hd), torch.randn(1, nkv, hd), torch.randn(1, nkv, hd)
    seq_len = 3 * BLOCK - 1
    slot = torch.tensor([(5 + 2) * BLOCK + (seq_len - 1) % BLOCK])
    meta = AttentionMetadata.build(BLOCK, [[5, 6, 7]], [seq_len], [], slot, torch.device("cpu"))
    assert meta.decode_groups[0].first_block == 5
    backend = TorchAttentionBackend()
    got = backend(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    meta.decode_groups[0].first_block = None  # force the gather
    want = backend(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    assert torch.equal(got, want)
    # A lone decode has no mask: its context is cut to seq_len, the same as masking the padded blocks.
    assert meta.decode_groups[0].mask is None and meta.decode_groups[0].seq_len == seq_len
    kc, vc = k_cache.clone(), v_cache.clone()
    backend(q, k, v, kc, vc, meta)  # writes the new token
    ctx_k, ctx_v = kc[5:8].reshape(1, 3 * BLOCK, nkv, hd), vc[5:8].reshape(1, 3 * BLOCK, nkv, hd)
    mask = (torch.arange(3 * BLOCK) < seq_len)[None, None, None, :]
    torch.testing.assert_close(got.double(), _reference_decode_attention(q, ctx_k, ctx_v, mask), rtol=1e-5, atol=1e-5)
    scattered = AttentionMetadata.build(BLOCK, [[5, 7, 6]], [seq_len], [], slot, torch.device("cpu"))
    batched = AttentionMetadata.build(BLOCK, [[1, 2], [5, 6]], [2 * BLOCK, 2 * BLOCK], [],
                                      torch.tensor([0, 1]), torch.device("cpu"))
    assert scattered.decode_groups[0].first_block is None
    assert all(g.first_block is None for g in batched.decode_groups)


def _reference_decode_attention(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(d)) v per query head over its KV head (head h reads KV head h // group)."""
    n, ctx, kv, d = k.shape
    group = q.shape[1] // kv
    k = k.double().repeat_interleave(group, dim=2).permute(0, 2, 3, 1)  # [n, heads, d, ctx]
    v = v.double().repeat_interleave(group, dim=2).transpose(1, 2)  # [n, heads, ctx, d]
    scores = (q.double()[:, :, None, :] @ k)[:, :, 0] / d ** 0.5  # [n, heads, ctx]
    scores = scores.masked_fill(~mask[:, 0], float("-inf"))
    return (torch.softmax(scores, -1)[:, :, None, :] @ v)[:, :, 0]  # [n, heads, d]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_is_grouped_query_attention(dtype, tol):
    from goodserve.models.attention import decode_attention

    torch.manual_seed(0)
    n, ctx, kv, group, d = 3, 40, 3, 3, 64
    q, k, v = torch.randn(n, kv * group, d), torch.randn(n, ctx, kv, d), torch.randn(n, ctx, kv, d)
    lens = torch.tensor([40, 17, 1])
    mask = (torch.arange(ctx)[None, :] < lens[:, None])[:, None, None, :]
    got = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    want = _reference_decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert got.shape == (n, kv * group, d) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)

