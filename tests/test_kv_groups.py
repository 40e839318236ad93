"""KV-cache groups (issue 31, vLLM's hybrid KV-cache manager): a model mixing local and global layers keeps one block
table per group, all from one pool; a sliding group frees its blocks before the window as a request decodes, a full
group keeps them; prefix hits need every group's blocks (a sliding group's inside the window only); the layout's
groups are of one kind and size; Gemma 3 on such a pool equals transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goodserve import LLM
from goodserve.config import CacheConfig, ModelConfig, SchedulerConfig
from goodserve.engine.kv_pool import engine_kv_layout
from goodserve.kv_cache.hashing import is_block_hash
from goodserve.kv_cache.layout import KVCacheLayout, max_blocks_needed, plan_layout, uniform_layout
from goodserve.kv_cache.manager import KVCacheManager
from goodserve.kv_cache.sliding import NULL_BLOCK_ID
from goodserve.kv_cache.spec import KVCacheGroup, KVCacheSpec
from goodserve.kv_events.events import BlockRemoved, BlockStored
from goodserve.scheduler.scheduler import Scheduler
from factories import create_requests, fake_step, run_to_completion
from test_gemma3 import GREEDY, LAYER_TYPES, NEW, W, make_tiny_gemma3
from tiny_models import EQUALITY_PROMPTS, hf_greedy

BS = 4
HYBRID = (None, W)  # a full group, then a sliding group of window W


def _scheduler(num_blocks=64, budget=64, windows=HYBRID, events=False):
    layout = KVCacheLayout(windows, tuple((g, 0) for g in range(len(windows))), 1)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=1024),
                     CacheConfig(num_blocks=num_blocks, block_size=BS, enable_kv_events=events, layout=layout))


def _held(windows, num_tokens):
    """Blocks a request whose next query is at ``num_tokens - 1`` holds, per the spec's formula."""
    return sum(KVCacheGroup("full" if w is None else "sliding", 1, 1, 1, w).blocks_kept(num_tokens, BS)
               for w in windows)


# ------------------------------------------------------------------ the layout (no model)


def test_plan_layout_groups_of_one_kind_and_size():
    """Gemma-3-1B's 26 layers (every sixth global: 4 full, 22 local) give groups of 4 layers: 1 full and 6 local,
    the last local group padded by 2 (7.7% of the layers); Gemma-3-27B's 62 (10 full, 52 local) would pad 8
    (12.9%) at 10, so 6 (4 padded) it is; equal kinds need no padding; one kind is one group."""
    def gemma(n):
        return [None if (i + 1) % 6 == 0 else 512 for i in range(n)]

    small = plan_layout(gemma(26))
    assert (small.num_slots, small.group_windows) == (4, (None,) + (512,) * 6)
    assert [small.layer_slots[i] for i in (5, 11, 17, 23)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert small.layer_slots[:5] == ((1, 0), (1, 1), (1, 2), (1, 3), (2, 0))
    assert small.layer_slots[25] == (6, 1)  # the 22nd local layer: the last group's second slot
    big = plan_layout(gemma(62))
    assert (big.num_slots, big.num_groups) == (6, 2 + 9)
    assert plan_layout([None, 8, None, 8]).layer_slots == ((0, 0), (1, 0), (0, 1), (1, 1))
    assert plan_layout([8, 8, 8]) == uniform_layout(3, 8) and uniform_layout(2).group_windows == (None,)
    with pytest.raises(ValueError, match="share one group's slot"):
        KVCacheLayout((None,), ((0, 0), (0, 0)), 1)


def test_layout_spec_prices_each_group_and_the_page():
    """The spec of a layout has one group per KV-cache group, each of num_slots layers (padding is memory): one
    pool block (page) is block_size tokens of one group; a request's bytes are each group's kept blocks."""
    layout = plan_layout([None, 8, 8, 8])  # slots 1: a full group and three sliding groups
    spec = layout.spec("float32", num_kv_heads=2, head_dim=16)
    per_layer = 2 * 2 * 16 * 4
    assert spec.page_bytes(BS) == BS * per_layer
    assert spec.bytes_for_request(64, BS) == (16 + 3 * 2) * BS * per_layer  # the window keeps 2 blocks of 4
    # a step of 4 from position 60 holds 53..63 in each sliding group: 4 blocks
    assert max_blocks_needed(layout.group_windows, BS, 64, 4) == 16 + 3 * 4
    assert plan_layout([None, 8, 8, 8, None, 8, 8, 8]).spec("int8", 1, 8).describe() == \
        "int8: full x2 (1 x 8), 3 groups of sliding x2 (1 x 8, window 8)"
    planner = KVCacheSpec("float32", (KVCacheGroup("full", 1, 2, 16), KVCacheGroup("sliding", 3, 2, 16, 8)))
    with pytest.raises(ValueError, match="unequal bytes per token"):
        planner.page_bytes(BS)  # a planner's spec of unpadded groups is no pool


def test_draft_and_kv_transfer_keep_one_group():
    """A draft model's shared blocks and KV transfer handle one group: Gemma 3 then keeps every block."""
    gemma = ModelConfig(architecture="gemma3_text", vocab_size=8, hidden_size=32, intermediate_size=8,
                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        max_position_embeddings=64, sliding_window=W, layer_types=tuple(LAYER_TYPES))
    assert engine_kv_layout(gemma).group_windows == (None, W, W, W)
    assert engine_kv_layout(gemma, draft=gemma).group_windows == (None,)
    assert engine_kv_layout(gemma, kv_transfer=object()).group_windows == (None,)


# ------------------------------------------------------------------ the KV cache manager (no model)


def test_blocks_per_group_as_a_request_decodes():
    """One request of 17 prompt tokens decoding 40 (fake model): after every decode step at c the pool holds exactly
    the full group's blocks of c + 1 tokens plus the sliding group's blocks overlapping the window; its flat table
    interleaves the groups, the sliding group's freed entries reading NULL_BLOCK_ID; integrity after every step."""
    s = _scheduler()
    kv = s.kv_cache_manager
    (req,) = create_requests(1, prompt_len=17, max_tokens=40)
    s.add_request(req)
    now, seen_null = 0.0, False
    while s.has_unfinished_requests():
        c = req.num_computed_tokens  # the step's query: a decode at c from the second step on
        fake_step(s, now)
        now += 1.0
        kv.check_integrity()
        if s.has_unfinished_requests() and c > 0:
            assert kv.num_blocks - kv.num_free_blocks == _held(HYBRID, c + 1), c
            flat = kv.get_block_ids(req.request_id)
            assert NULL_BLOCK_ID not in flat[0::2]  # the full group keeps every block
            seen_null |= NULL_BLOCK_ID in flat[1::2]
    assert seen_null and kv.num_free_blocks == kv.num_blocks


def test_prefix_hit_needs_every_group():
    """A repeated prompt (6 blocks; 5 may hit) hits as far as the full group's chain and the sliding group's window
    blocks are both cached: evicting a full-group block cuts the hit there; a sliding block outside the window of
    the hit's first query (k = 5 reads blocks 3, 4) costs nothing; evicting sliding block 3 leaves k = 3 (blocks
    1, 2)."""
    for evict, expected in ((None, 20), ((1, 1), 20), ((0, 1), 4), ((0, 4), 16), ((1, 3), 12)):
        s = _scheduler()
        kv = s.kv_cache_manager
        a, b = create_requests(2, prompt_len=24, max_tokens=1, same_prompt=True)
        s.add_request(a)
        run_to_completion(s)
        if evict is not None:  # (group, block): drop that group's block from the prefix cache
            group, block = evict
            hashes = kv._block_hashes(b)
            key = hashes[block] if group == 0 else hashes[block] + group.to_bytes(2, "little")
            kv.block_pool.uncache_block(kv.block_pool.get_cached_block(key))
        ids, num_hit = kv.get_computed_blocks(b)
        assert num_hit == expected, evict
        assert len(ids) == 2 * num_hit // BS and NULL_BLOCK_ID not in ids[0::2]
        s.add_request(b)
        run_to_completion(s)
        assert b.num_cached_tokens == expected
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks


def test_all_or_nothing_across_groups_and_trim():
    """allocate_slots takes a block per group per new row or nothing; trim (rejected drafts) frees whole rows."""
    kv = KVCacheManager(7, BS, group_windows=HYBRID)
    (req,) = create_requests(1, prompt_len=16, max_tokens=8)
    assert kv.allocate_slots(req, 16) is None  # 4 rows x 2 groups = 8 blocks > 7
    assert kv.num_free_blocks == 7 and kv.get_block_ids(req.request_id) == []
    assert len(kv.allocate_slots(req, 8)) == 4
    req.num_computed_tokens = 8
    assert kv.trim(req, 8) is None
    assert len(kv.allocate_slots(req, 1)) == 2 and kv.num_free_blocks == 1
    assert kv.trim(req, 8) == 4 and kv.num_free_blocks == 3  # 2 rows of 2 groups kept
    kv.check_integrity()
    assert kv.max_blocks_needed(64, 4) == 16 + 4


def test_kv_events_publish_the_first_group_only():
    """Only the first group's blocks are published (plain block hashes), stored and removed alike."""
    s = _scheduler(num_blocks=12, events=True)
    for r in create_requests(3, prompt_len=16, max_tokens=2):
        s.add_request(r)
        run_to_completion(s)
    events = s.kv_cache_manager.take_kv_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(stored) == 3 * 4 and removed and all(map(is_block_hash, stored + removed))


# ------------------------------------------------------------------ Gemma 3 on a grouped pool, against transformers


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_dir = make_tiny_gemma3(tmp_path_factory.mktemp("g3"))
    return model_dir, hf_greedy(model_dir, EQUALITY_PROMPTS, NEW)



def test_gemma3_frees_local_blocks_step_by_step(gemma3):
    """The real engine, one request of 17 prompt tokens decoding 12 on Gemma 3 (a full group and three one-layer
    sliding groups): after each step the pool holds exactly the full group's blocks plus each sliding group's
    window blocks; the tokens equal transformers'; the cache tensors are one per slot, shared by the groups."""
    model_dir, refs = gemma3
    llm = LLM(model_dir, dtype="float32", block_size=BS, num_blocks=64, log_stats_interval=0)
    engine = llm.engine
    kv = engine.core.scheduler.kv_cache_manager
    runner = engine.core.runner
    assert runner.kv_cache_bytes == 64 * engine.config.model.kv_cache_spec("float32").page_bytes(BS)
    rid = engine.add_request(list(EQUALITY_PROMPTS[1]), GREEDY)
    req = engine.core.scheduler._requests[rid]
    tokens = []
    while engine.core.scheduler.has_unfinished_requests():
        c = req.num_computed_tokens
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids)
        kv.check_integrity()
        if engine.core.scheduler.has_unfinished_requests() and c > 0:
            assert kv.num_blocks - kv.num_free_blocks == _held((None, W, W, W), c + 1), c
    assert tokens == refs[1]
    assert kv.num_free_blocks == kv.num_blocks


def test_gemma3_grouped_holds_more_requests_and_speculates(gemma3):
    """A 1,024-token Gemma 3 request costs 256 full-group blocks plus 2 per sliding group on the grouped pool, 4 x 256
    layer-blocks on one full group: x3.9 the requests in the same memory. Run on a pool of 30 four-layer blocks'
    memory, the batch equals transformers, and so does it with n-gram speculation (drafts trimmed per group)."""
    model_dir, refs = gemma3
    config = ModelConfig.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    grouped, single = (config.kv_cache_spec("float32", hybrid).bytes_for_request(1024, BS) for hybrid in (True, False))
    per_layer_block = 2 * 2 * 16 * 4 * BS
    assert (grouped, single) == ((256 + 3 * 2) * per_layer_block, 4 * 256 * per_layer_block)
    args = dict(dtype="float32", block_size=BS, log_stats_interval=0, kv_cache_memory=30 * 4 * per_layer_block)
    llm = LLM(model_dir, **args)
    assert llm.engine.core.scheduler.kv_cache_manager.num_blocks == 120
    assert [o.token_ids for o in llm.generate(EQUALITY_PROMPTS, GREEDY, use_tqdm=False)] == refs
    spec = LLM(model_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
               speculative_length="3", **args)
    assert [o.token_ids for o in spec.generate(EQUALITY_PROMPTS, GREEDY, use_tqdm=False)] == refs
    spec.engine.core.scheduler.kv_cache_manager.check_integrity()
    one = LLM(model_dir, disable_hybrid_kv_cache_manager=True, **args)  # vLLM's flag: one full group
    assert one.engine.config.cache.group_windows == (None,) and one.engine.config.cache.num_blocks == 30
    assert [o.token_ids for o in one.generate(EQUALITY_PROMPTS, GREEDY, use_tqdm=False)] == refs
