"""KVCacheManager / BlockPool: exact block ids, ref counts, eviction order and prefix-cache hits."""

from __future__ import annotations

import pytest

from factories import create_requests
from goodserve.kv_cache import BlockPool, KVCacheManager
from goodserve.kv_cache.hashing import hash_block_tokens, hash_request_blocks
from goodserve.request_options import RequestOptions
from goodserve.request import Request
from goodserve.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], cache_salt=None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), arrival_time=0.0,
                   options=RequestOptions(cache_salt=cache_salt))


def refs(manager: KVCacheManager, ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in ids]


def admit(manager: KVCacheManager, req: Request) -> list[int]:
    """Prefix lookup + allocation for the whole prompt, the way the scheduler admits a request."""
    hits, num_hit = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return new


def test_allocate_exact_block_ids_and_growth():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    r = make_request("a", list(range(100, 110)))  # 10 tokens -> 3 blocks
    assert m.allocate_slots(r, 10) == [0, 1, 2]
    assert m.get_block_ids("a") == [0, 1, 2]
    assert refs(m, [0, 1, 2]) == [1, 1, 1]
    assert m.num_free_blocks == 7 and m.usage == pytest.approx(0.3)
    r.num_computed_tokens = 10
    for expected in ([], [], [3]):  # slots 11 and 12 fit in block 2, slot 13 needs block 3
        r.append_output_token(7)
        assert m.allocate_slots(r, 1) == expected
        r.num_computed_tokens += 1
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    m.check_integrity()
    m.free(r)
    assert m.num_free_blocks == 10 and m.usage == 0.0 and m.get_block_ids("a") == []
    m.check_integrity()


def test_allocate_is_atomic_when_pool_is_short():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = make_request("a", list(range(100, 112))), make_request("b", list(range(200, 208)))
    assert m.allocate_slots(a, 12) == [0, 1, 2]
    assert m.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert m.get_block_ids("b") == [] and m.num_free_blocks == 1
    assert m.allocate_slots(b, 4) == [3]
    m.check_integrity()


def test_free_queue_order_is_lru_and_deepest_block_first():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_request("a", list(range(100, 110))), make_request("b", list(range(200, 206)))
    assert m.allocate_slots(a, 10) == [0, 1, 2]
    assert m.allocate_slots(b, 6) == [3, 4]
    m.free(a)
    m.free(b)
    assert m.block_pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    c = make_request("c", list(range(300, 328)))  # 7 blocks
    assert m.allocate_slots(c, 28) == [5, 6, 7, 8, 9, 2, 1]
    assert m.block_pool.free_block_ids() == [0, 4, 3]
    m.check_integrity()


def test_eviction_keeps_the_lru_prefix_heads_longest():
    m = KVCacheManager(num_blocks=6, block_size=BS)
    a_tokens, b_tokens = list(range(100, 109)), list(range(200, 209))  # 9 tokens: 2 full blocks + 1
    a, b = make_request("a", a_tokens), make_request("b", b_tokens)
    admit(m, a)
    admit(m, b)
    assert m.get_block_ids("a") == [0, 1, 2] and m.get_block_ids("b") == [3, 4, 5]
    m.free(a)
    m.free(b)
    assert m.block_pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    c = make_request("c", list(range(300, 308)))
    assert m.allocate_slots(c, 8) == [2, 1]  # a's partial block, then a's deepest full block
    assert m.get_computed_blocks(make_request("a2", a_tokens)) == ([0], 4)
    assert m.get_computed_blocks(make_request("b2", b_tokens)) == ([3, 4], 8)
    m.check_integrity()


def test_prefix_hit_takes_references_and_leaves_free_queue():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(100, 110)))
    admit(m, a)
    b = make_request("b", list(range(100, 108)) + [999, 998, 997])
    hits, n = m.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 8)
    assert refs(m, [0, 1]) == [1, 1]  # lookup takes no reference
    assert m.allocate_slots(b, 3, hits) == [3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    m.free(a)
    assert refs(m, [0, 1, 2]) == [1, 1, 0]
    assert m.block_pool.free_block_ids()[-1] == 2
    m.check_integrity()
    m.free(b)
    m.check_integrity()
    # Both full blocks are free yet still cached: a third request hits them out of the free queue.
    c = make_request("c", list(range(100, 110)))
    hits, n = m.get_computed_blocks(c)
    assert (hits, n) == ([0, 1], 8)
    assert m.allocate_slots(c, 2, hits) is not None
    assert not m.block_pool.is_free(0) and not m.block_pool.is_free(1)
    m.check_integrity()


@pytest.mark.parametrize("tokens, expected", [
    ([1] + list(range(101, 117)), ([], 0)),                          # first token differs: 0 blocks
    (list(range(100, 104)) + [5, 5, 5, 5, 5], ([0], 4)),             # 1 block shared
    (list(range(100, 112)) + [5, 5], ([0, 1, 2], 12)),               # several
    (list(range(100, 117)), ([0, 1, 2, 3], 16)),                     # all full blocks
    (list(range(100, 116)), ([0, 1, 2], 12)),                        # exact multiple: last block left
    (list(range(100, 104)), ([], 0)),                                # one exact block: nothing cached
])
def test_prefix_hit_counts(tokens, expected):
    m = KVCacheManager(num_blocks=10, block_size=BS)
    admit(m, make_request("a", list(range(100, 117))))  # 17 tokens: 4 full blocks registered
    assert m.block_pool.num_cached_blocks == 4
    assert m.get_computed_blocks(make_request("b", tokens)) == expected


def test_hits_in_free_queue_count_as_free_when_allocating():
    m = KVCacheManager(num_blocks=5, block_size=BS)
    tokens = list(range(100, 117))
    a = make_request("a", tokens)
    admit(m, a)
    m.free(a)
    assert m.num_free_blocks == 5
    b = make_request("b", tokens)
    hits, n = m.get_computed_blocks(b)
    assert (hits, n) == ([0, 1, 2, 3], 16)
    assert m.allocate_slots(b, 1, hits) == [4]  # the hits are never handed out as new blocks
    assert m.num_free_blocks == 0
    m.check_integrity()


def test_stale_hash_never_resolves_after_reuse():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a_tokens = list(range(100, 109))
    a = make_request("a", a_tokens)
    admit(m, a)
    old_hashes = hash_request_blocks(a_tokens, BS, extra_keys=(None,))
    assert m.block_pool.get_cached_block(old_hashes[0]).block_id == 0
    m.free(a)
    c = make_request("c", list(range(500, 512)))
    assert sorted(m.allocate_slots(c, 12)) == [0, 1, 2]
    assert all(m.block_pool.get_cached_block(h) is None for h in old_hashes)
    assert m.get_computed_blocks(make_request("a2", a_tokens)) == ([], 0)
    m.check_integrity()


def test_different_cache_salt_never_shares():
    m = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = list(range(100, 113))
    admit(m, make_request("a", tokens, cache_salt="tenant-a"))
    assert m.get_computed_blocks(make_request("b", tokens, cache_salt="tenant-b")) == ([], 0)
    assert m.get_computed_blocks(make_request("n", tokens)) == ([], 0)
    assert m.get_computed_blocks(make_request("a2", tokens, cache_salt="tenant-a")) == ([0, 1, 2], 12)


def test_prefix_caching_disabled():
    m = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(100, 117))
    admit(m, make_request("a", tokens))
    assert m.get_computed_blocks(make_request("b", tokens)) == ([], 0)
    assert m.block_pool.num_cached_blocks == 0
    m.check_integrity()


def test_duplicate_content_keeps_first_block_as_cache_entry():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(100, 108))  # exact multiple: the second request recomputes block 1 itself
    admit(m, make_request("a", tokens))
    b = make_request("b", tokens)
    assert admit(m, b) == [2]
    assert m.get_block_ids("b") == [0, 2]
    assert m.block_pool.blocks[2].block_hash is None
    m.check_integrity()


def test_free_of_unwritten_blocks_drops_their_hash():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(100, 109))
    a = make_request("a", tokens)
    assert m.allocate_slots(a, 9) == [0, 1, 2]  # registered at allocation time
    m.free(a, num_valid_tokens=0)  # dropped before the step ran
    assert m.block_pool.num_cached_blocks == 0
    assert m.get_computed_blocks(make_request("b", tokens)) == ([], 0)
    m.check_integrity()


def test_reset_prefix_cache():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = list(range(100, 109))
    a = make_request("a", tokens)
    admit(m, a)
    m.reset_prefix_cache()
    assert m.get_computed_blocks(make_request("b", tokens)) == ([], 0)
    m.free(a)
    m.check_integrity()


def test_allocate_rejects_prefix_hits_for_request_with_blocks():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(100, 109)))
    admit(m, a)
    b = make_request("b", list(range(100, 109)))
    m.allocate_slots(b, 1)
    with pytest.raises(RuntimeError, match="already holds"):
        m.allocate_slots(b, 1, [0])
    with pytest.raises(ValueError):
        m.allocate_slots(b, -1)


def test_check_integrity_detects_corruption():
    def fresh():
        m = KVCacheManager(num_blocks=6, block_size=BS)
        admit(m, make_request("a", list(range(100, 109))))
        m.check_integrity()
        return m

    m = fresh()
    m.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(RuntimeError, match="block 0 has ref_cnt 2 but 1 owning"):
        m.check_integrity()

    m = fresh()
    m._req_blocks["a"][0].append(m.block_pool.blocks[0])
    with pytest.raises(RuntimeError, match=r"request a owns block\(s\) \[0\] more than once"):
        m.check_integrity()

    m = fresh()
    m.block_pool._free[1] = m.block_pool.blocks[1]  # in-use block put in the free queue
    with pytest.raises(RuntimeError, match="block 1 is in the free queue with ref_cnt 1"):
        m.check_integrity()

    m = fresh()
    del m.block_pool._free[4]  # a free block lost from the free queue
    with pytest.raises(RuntimeError, match="block 4 has ref_cnt 0 but is not in the free queue"):
        m.check_integrity()

    m = fresh()
    m.block_pool.blocks[0].block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="maps to block 0 whose hash is"):
        m.check_integrity()


def test_block_pool_errors():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(blocks[:1])


def test_block_hash_is_chained_and_stable_across_processes():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt",)) != h0
    assert len(h0) == 32
    # Golden value computed once in another process: sha256 of a pinned pickle, no per-process salt.
    assert hash_block_tokens(h0, [5, 6, 7, 8], ("s",)).hex() == (
        "ce0174da730edd3b06ca7def3a46c384203eaa68afcd6de661db6276c78f69cb")


def test_factory_requests_work_with_manager():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    reqs = create_requests(2, prompt_len=8, same_prompt=True)
    admit(m, reqs[0])
    assert m.get_computed_blocks(reqs[1]) == ([0], 4)
