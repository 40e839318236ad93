"""The KV-cache spec: bytes per token for every group kind and dtype, blocks a sliding window keeps."""

import pytest

from goodserve.kv_cache.spec import KVCacheGroup, KVCacheSpec, dense_spec, kv_row_bytes, mla_spec


def test_bytes_per_token_every_group_kind_and_dtype():
    # SmolLM2-135M: 30 layers x 3 KV heads x 64: 2 * 30 * 3 * 64 * b, an int8 row adds a 4-byte scale
    assert dense_spec(30, 3, 64, "bfloat16").bytes_per_token() == 23_040
    assert dense_spec(30, 3, 64, "float32").bytes_per_token() == 46_080
    assert dense_spec(30, 3, 64, "int8").bytes_per_token() == 2 * 30 * 3 * 68
    # DeepSeek-V2: 60 layers x (512 + 64) latent elements, one row, no heads
    assert mla_spec(60, 512, 64, "bfloat16").bytes_per_token() == 69_120
    assert mla_spec(60, 512, 64, "int8").bytes_per_token() == 60 * 580
    sliding = KVCacheGroup("sliding", 5, 2, 32, window=64)
    full = KVCacheGroup("full", 1, 2, 32)
    spec = KVCacheSpec("bfloat16", (sliding, full))
    assert spec.bytes_per_token() == 2 * 6 * 2 * 32 * 2


def test_sliding_window_keeps_only_blocks_overlapping_the_window():
    g = KVCacheGroup("sliding", 1, 1, 8, window=10)
    # block size 4; the window of the last token (position n - 1) is [n - 10, n)
    assert [g.blocks_kept(n, 4) for n in (0, 1, 4, 5, 10, 11, 12, 13, 14, 15, 100)] == \
        [0, 1, 1, 2, 3, 3, 3, 4, 3, 3, 3]
    full = KVCacheGroup("full", 1, 1, 8)
    assert full.blocks_kept(100, 4) == 25
    spec = KVCacheSpec("float32", (g, full))
    assert spec.bytes_for_request(100, 4) == 3 * 4 * g.bytes_per_token("float32") + 25 * 4 * full.bytes_per_token("float32")


@pytest.mark.parametrize("bad", [dict(kind="local", num_layers=1, num_kv_heads=1, head_dim=1),
                                 dict(kind="sliding", num_layers=1, num_kv_heads=1, head_dim=1),
                                 dict(kind="full", num_layers=1, num_kv_heads=1, head_dim=1, window=4),
                                 dict(kind="mla", num_layers=1, num_kv_heads=2, head_dim=8),
                                 dict(kind="full", num_layers=0, num_kv_heads=1, head_dim=1)])
def test_bad_groups_refused(bad):
    with pytest.raises(ValueError):
        KVCacheGroup(**bad)


def test_unknown_dtype_refused_by_name():
    with pytest.raises(ValueError, match="int4"):
        kv_row_bytes(8, "int4")
    with pytest.raises(ValueError, match="int4"):
        dense_spec(1, 1, 8, "int4")
