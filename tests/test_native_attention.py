"""The native CPU paged decode-attention kernel (issue 15, part 3) against a float64 reference and against
the portable PyTorch backend, on every code path of the kernel: the compile-time shapes (head_dim 64 and
128), the generic AVX-512 path (head_dim a multiple of 16), the scalar path (any other head_dim), blocks
smaller and larger than 16 tokens, and a long lone request whose context is split across threads."""

import random

import pytest
import torch

from goodserve.models import native, native_build
from goodserve.models.attention import (AttentionMetadata, NativeAttentionBackend, TorchAttentionBackend,
                                        make_attention_backend)
from goodserve.models.short_rows import MAX_SHORT_CHUNK

pytestmark = pytest.mark.skipif(not native.load(), reason="the native kernel cannot be built here")


def _reference(q, k_cache, v_cache, tables, lens):
    """float64 softmax(q k^T / sqrt(d)) v of each request over its own tokens, read block by block."""
    n, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    group = heads // kv
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        rows = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(lens[i])])
        k = k_cache.reshape(-1, kv, d)[rows].double()  # [len, kv, d]
        v = v_cache.reshape(-1, kv, d)[rows].double()
        for h in range(heads):
            scores = k[:, h // group] @ q[i, h].double() / d ** 0.5
            out[i, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


def _case(n, lens, kv, group, d, bs, dtype, seed=0):
    """Scattered blocks for ``n`` requests of the given lengths; q is a strided slice, as in the model."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    per = [-(-length // bs) for length in lens]
    num_blocks = sum(per) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for p in per:
        tables.append(ids[at:at + p])
        at += p
    k_cache = torch.randn(num_blocks, bs, kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv, d, generator=gen).to(dtype)
    q = (2 * torch.randn(n, kv * group + kv, d, generator=gen)).to(dtype)[:, :kv * group]  # strided rows
    return q, k_cache, v_cache, tables


def _run(q, k_cache, v_cache, tables, lens):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return native.paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), max(lens))


@pytest.mark.parametrize("d, group", [(64, 3), (128, 4), (32, 2), (64, 5), (24, 3)],
                         ids=["fixed-64x3", "fixed-128x4", "wide-32", "wide-64x5", "scalar-24"])
@pytest.mark.parametrize("bs", [16, 4, 32])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_float64_attention(d, group, bs, dtype, tol):
    lens = [1, 7, 33, 100, 16]
    q, k_cache, v_cache, tables = _case(len(lens), lens, 2, group, d, bs, dtype)
    got = _run(q, k_cache, v_cache, tables, lens)
    assert got.shape == (len(lens), 2 * group, d) and got.dtype == dtype
    torch.testing.assert_close(got.double(), _reference(q, k_cache, v_cache, tables, lens), rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_long_lone_request_is_split_and_merged_exactly(threads):
    """One request at 3,000 tokens: its context is cut into splits (flash-decoding) that the kernel merges
    by their maxima and sums; the result is the same attention, whatever the thread count."""
    lens = [3000]
    assert native.num_splits(1, 3000, threads) > 1
    q, k_cache, v_cache, tables = _case(1, lens, 2, 3, 64, 16, torch.float32, seed=1)
    k_cache[tables[0][0]] += 4  # the largest scores in the first split, so the others are rescaled
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(q, k_cache, v_cache, tables, lens)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), _reference(q, k_cache, v_cache, tables, lens), rtol=1e-5, atol=1e-5)


def test_num_splits():
    assert native.num_splits(8, 4096, 2) == 1  # 8 work items already
    assert native.num_splits(1, 100, 2) == 1  # too short to split
    assert native.num_splits(1, 4096, 2) == 8  # 8 items wanted
    assert native.num_splits(3, 4096, 2) == 3  # ceil(8 / 3)
    assert native.num_splits(1, 600, 2) == 3  # capped by 600 / 256


def test_native_backend_equals_the_torch_backend_on_a_mixed_step():
    """Decodes of different lengths plus a prefill chunk over cached context, one flat batch: the native
    backend's output and cache writes equal the PyTorch backend's (float32)."""
    bs, kv, heads, d = 4, 2, 6, 64
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(40, bs, kv, d), torch.randn(40, bs, kv, d)
    dec_tables, dec_lens = [[3, 9], [1, 7, 20, 5]], [6, 15]
    chunk = (5, 3, [30, 31, 32])  # 5 tokens cached, 3 new
    slots = [9 * bs + 1, 5 * bs + 2] + [31 * bs + 1, 31 * bs + 2, 31 * bs + 3]
    q, k, v = torch.randn(5, heads, d), torch.randn(5, kv, d), torch.randn(5, kv, d)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), NativeAttentionBackend()):
        meta = AttentionMetadata.build(bs, dec_tables, dec_lens, [chunk], torch.tensor(slots), torch.device("cpu"),
                                       decode_groups=backend.uses_decode_groups)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend(q, k, v, kc, vc, meta))
        caches.append((kc, vc))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_short_chunks_are_attended_as_decodes_and_equal_the_chunk_path():
    """Issue 33: chunks of at most MAX_SHORT_CHUNK new tokens after a cached context (rows verifying drafts)
    are one decode query per token for the native backend, each attending its position + 1 tokens; a fresh
    chunk and a longer one keep the chunk path. Output and cache writes equal the PyTorch backend's."""
    bs, kv, heads, d = 4, 2, 6, 64
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(60, bs, kv, d), torch.randn(60, bs, kv, d)
    long_new = MAX_SHORT_CHUNK + 1
    chunks = [(6, 3, [10, 11, 12]), (0, 2, [20]), (2, long_new, [30, 31, 32, 33, 34, 35]), (9, 1, [40, 41, 42])]
    slots = [11 * bs + 2, 11 * bs + 3, 12 * bs] + [20 * bs, 20 * bs + 1]
    slots += [(30 + p // bs) * bs + p % bs for p in range(2, 2 + long_new)]  # its table is blocks 30..35
    slots += [42 * bs + 1]
    n = 1 + 3 + 2 + long_new + 1  # one decode first
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv, d), torch.randn(n, kv, d)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), NativeAttentionBackend()):
        meta = AttentionMetadata.build(bs, [[1, 2]], [7], chunks, torch.tensor([2 * bs + 2] + slots),
                                       torch.device("cpu"), decode_groups=backend.uses_decode_groups)
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend(q, k, v, kc, vc, meta))
        caches.append((kc, vc, meta))
    rows = caches[1][2].short_rows
    assert caches[0][2].short_rows is None
    assert rows.index.tolist() == [1, 2, 3, n - 1]  # after the decode: the 3-token chunk, and the last one
    assert rows.seq_lens.tolist() == [7, 8, 9, 10] and rows.max_len == 10
    assert rows.block_tables.tolist() == [[10, 11, 12]] * 3 + [[40, 41, 42]]
    assert [c.short for c in caches[1][2].prefills] == [True, False, False, True]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_metadata_for_the_native_backend_holds_one_padded_table():
    meta = AttentionMetadata.build(4, [[3, 9], [1, 7, 20]], [6, 11], [], torch.tensor([0, 1]), torch.device("cpu"),
                                   decode_groups=False)
    assert meta.decode_groups == []
    assert meta.decode_block_tables.tolist() == [[3, 9, 0], [1, 7, 20]]
    assert meta.decode_block_tables.dtype == torch.int32 and meta.decode_seq_lens.tolist() == [6, 11]
    assert meta.max_decode_len == 11
    # Built for decode groups, it holds no padded table (the one-call decode step keys on it).
    grouped = AttentionMetadata.build(4, [[3, 9], [1, 7, 20]], [6, 11], [], torch.tensor([0, 1]), torch.device("cpu"))
    assert grouped.decode_block_tables is None and grouped.decode_seq_lens is None and len(grouped.decode_groups) == 1


def test_bad_inputs_are_refused_with_a_clear_error():
    q, k_cache, v_cache, tables = _case(1, [5], 2, 3, 64, 16, torch.float32)
    bt = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="share a dtype"):
        native.paged_decode_attention(q.double(), k_cache, v_cache, bt, lens, 5)
    with pytest.raises(ValueError, match="int32"):
        native.paged_decode_attention(q, k_cache, v_cache, bt.long(), lens, 5)
    with pytest.raises(ValueError, match="contiguous"):
        strided = k_cache.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, not contiguous
        native.paged_decode_attention(q, strided, v_cache, bt, lens, 5)


def test_choosing_a_backend():
    cpu = torch.device("cpu")
    assert isinstance(make_attention_backend("auto", cpu), NativeAttentionBackend)
    assert type(make_attention_backend("torch", cpu)) is TorchAttentionBackend
    assert isinstance(make_attention_backend("native", cpu), NativeAttentionBackend)
    with pytest.raises(ValueError, match="CPU only"):
        make_attention_backend("native", torch.device("cuda"))
    assert type(make_attention_backend("auto", torch.device("cuda"))) is TorchAttentionBackend
    with pytest.raises(ValueError, match="one of"):
        make_attention_backend("flash", cpu)


def test_without_the_kernel_auto_falls_back_and_native_is_refused(monkeypatch):
    monkeypatch.setattr(native_build, "_loaded", None)  # loaded again, under the switch
    monkeypatch.setenv("GOODSERVE_NATIVE_KERNELS", "0")
    cpu = torch.device("cpu")
    assert type(make_attention_backend("auto", cpu)) is TorchAttentionBackend
    with pytest.raises(RuntimeError, match="not available"):
        make_attention_backend("native", cpu)
