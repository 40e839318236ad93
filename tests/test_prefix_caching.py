"""Prefix caching end to end on the default model (SmolLM2-135M-Instruct, float32, CPU).

A prefix-cache hit must never change what the model writes: every scenario compares greedy tokens with
caching on against the same prompts run with caching off, and checks the block pool afterwards
(``check_integrity``, usage back to 0). Scenarios: C01 (one long prompt twice off, twice on), prompts that
share 0, 1, several and all blocks, one whose length is an exact multiple of the block size (its last block
is recomputed, never hit whole), chunked prefill (budgets 16 and 37), a pool so small that requests are
preempted, eviction of a cached prefix followed by a resend, ``cache_salt`` isolation, and the server's
``usage.prompt_tokens_details.cached_tokens`` and ``cache_salt`` field. See /work/shared/cases/CASES.md.
"""

from __future__ import annotations

import httpx
import pytest

from goodserve import LLM, SamplingParams
from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.server.app import build_app
from server_fixtures import ServerThread

pytestmark = pytest.mark.slow

BS = 16  # block size (the engine default)
NEW = 8  # greedy tokens per request
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

SYSTEM = ("You are the support assistant of a small bicycle shop in Utrecht. The shop sells city bikes, "
          "cargo bikes and electric bikes, repairs any brand, and rents bikes by the day. Opening hours are "
          "nine to six on weekdays and ten to four on Saturdays; the shop is closed on Sundays. Repairs of a "
          "flat tyre take about twenty minutes; a full service takes one working day and costs eighty-five "
          "euros. Rentals cost twelve euros a day for a city bike and thirty-five for a cargo bike, with a "
          "deposit of fifty euros. Customers can book online or call the shop. Always answer politely, "
          "briefly and in plain English, and never promise a repair date that the workshop has not "
          "confirmed. If a question is about something the shop does not do, say so and suggest where "
          "the customer could go instead. Children's bikes and child seats are available on request, "
          "and every rental includes a lock, lights and a basic repair kit; helmets are free to borrow.")
STORY = ("Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who "
         "repaired every clock in the valley. Each morning he opened his shutters, wound the tall clock by "
         "the door and listened to its ticking before he ate his bread. One winter a girl arrived with a "
         "broken pocket watch that had belonged to her grandmother, and she asked whether he could make it "
         "run again before the new year. He turned it over in his hands, opened the back with a thin blade "
         "and found a folded note hidden under the spring.")
OTHER = ("The mitochondrion is an organelle found in most eukaryotic cells. It produces most of the "
         "chemical energy needed to power the cell's biochemical reactions, stored in a small molecule "
         "called adenosine triphosphate.")


def kv(llm: LLM):
    return llm.engine.core.scheduler.kv_cache_manager


def check_pool(llm: LLM) -> None:
    """The pool is consistent and nothing is left referenced."""
    kv(llm).check_integrity()
    assert kv(llm).usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def make_llm(**kw) -> LLM:
    args = dict(dtype="float32", num_blocks=256, max_num_batched_tokens=512, log_stats_interval=0)
    args.update(kw)
    return LLM(**args)


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llm_off():
    return make_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm_on():
    return make_llm()


@pytest.fixture(scope="module")
def sharing_prompts(llm_off):
    """Token-id prompts named by how much they share with ``a``: 0, 1, several, all blocks, exact multiple."""
    tok = llm_off.get_tokenizer()
    story, other = tok.encode(STORY), tok.encode(OTHER)
    q1 = tok.encode(" What did the clockmaker say to the girl?")
    q2 = tok.encode(" Describe the forest in one sentence.")
    assert len(story) >= 100 and story[16] != other[0] and story[80] != q2[0]
    a = story + q1
    prompts = {
        "a": a,                                # the first: everything else is compared with it
        "one_block": story[:BS] + other[:50],  # shares exactly block 0 with a
        "several": story[:5 * BS] + q2,        # shares blocks 0-4 with a
        "all": list(a),                        # identical to a
        "multiple": a[:(len(a) // BS) * BS],   # a prefix of a whose length is an exact multiple of BS
        "none": other,                         # shares nothing
    }
    assert len(a) % BS != 0 and len(prompts["multiple"]) % BS == 0
    return prompts


@pytest.fixture(scope="module")
def reference(llm_off, sharing_prompts):
    """Greedy tokens of every sharing prompt with prefix caching off."""
    outs = llm_off.generate(list(sharing_prompts.values()), GREEDY, use_tqdm=False)
    assert all(o.metrics.num_cached_tokens == 0 for o in outs)
    check_pool(llm_off)
    return {name: o.token_ids for name, o in zip(sharing_prompts, outs)}


def expected_hits(prompts: dict[str, list[int]]) -> dict[str, int]:
    """Cached prompt tokens of each prompt when ``a`` went first into an empty cache."""
    a = prompts["a"]
    return {"a": 0, "one_block": BS, "several": 5 * BS, "all": (len(a) - 1) // BS * BS,
            "multiple": len(prompts["multiple"]) - BS, "none": 0}


# -------------------------------------------------------------------------------------------- C01
def test_long_prompt_off_twice_on_twice_C01(llm_off, llm_on):
    """C01: identical token ids in all four runs; the second cached run reports cached prompt tokens."""
    prompt = llm_on.apply_chat_template([{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Can I rent a cargo bike on Sunday?"}])
    assert len(prompt) >= 200
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    kv(llm_on).reset_prefix_cache()
    runs = [llm.generate([prompt], params, use_tqdm=False)[0] for llm in (llm_off, llm_off, llm_on, llm_on)]
    assert len({tuple(r.token_ids) for r in runs}) == 1
    assert [r.metrics.num_cached_tokens for r in runs[:3]] == [0, 0, 0]
    assert runs[3].metrics.num_cached_tokens == (len(prompt) - 1) // BS * BS > 0
    assert kv(llm_off).prefix_cache_queries == 0  # off: nothing looked up
    check_pool(llm_off)
    check_pool(llm_on)


# ------------------------------------------------------------------------------ sharing + chunking
def test_shared_prefixes_batch(llm_on, sharing_prompts, reference):
    """One batch: later prompts hit the blocks of ``a`` that the same or an earlier step writes."""
    kv(llm_on).reset_prefix_cache()
    outs = llm_on.generate(list(sharing_prompts.values()), GREEDY, use_tqdm=False)
    assert {n: o.token_ids for n, o in zip(sharing_prompts, outs)} == reference
    assert {n: o.metrics.num_cached_tokens for n, o in zip(sharing_prompts, outs)} == \
        expected_hits(sharing_prompts)
    check_pool(llm_on)
    # Again, one at a time: every prompt now hits all its full blocks but the one holding its last token.
    for name, prompt in sharing_prompts.items():
        out = llm_on.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == reference[name], name
        assert out.metrics.num_cached_tokens == (len(prompt) - 1) // BS * BS, name
    check_pool(llm_on)


@pytest.mark.parametrize("budget", [16, 37])
def test_chunked_prefill_with_prefix_hits(budget, sharing_prompts, reference):
    """C02 with caching on: chunks and prefix hits together still give the caching-off tokens."""
    llm = make_llm(max_num_batched_tokens=budget)
    outs = llm.generate(list(sharing_prompts.values()), GREEDY, use_tqdm=False)
    assert {n: o.token_ids for n, o in zip(sharing_prompts, outs)} == reference
    assert {n: o.metrics.num_cached_tokens for n, o in zip(sharing_prompts, outs)} == \
        expected_hits(sharing_prompts)
    check_pool(llm)


# ------------------------------------------------------------------------- tiny pool: preemption
TINY_BLOCKS = 16  # 256 token slots


@pytest.fixture(scope="module")
def llm_tiny():
    return make_llm(num_blocks=TINY_BLOCKS, max_num_batched_tokens=64)


def test_preemption_with_prefix_caching(llm_tiny, llm_off, sharing_prompts):
    """C03 with caching on: requests preempted and recomputed (re-hitting their own freed blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=2 * NEW, ignore_eos=True)
    prompts = list(sharing_prompts.values()) * 2  # twice each: the pool cannot hold them all at once
    ref = [o.token_ids for o in llm_off.generate(prompts[:len(sharing_prompts)], params, use_tqdm=False)] * 2
    outs = llm_tiny.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert llm_tiny.engine.core.scheduler.num_preemptions_total > 0
    check_pool(llm_tiny)


def test_eviction_then_resend(llm_tiny, llm_off):
    """A cached prefix whose blocks were reused for other content: the resend hits only what is left.

    The pool frees a finished request's blocks deepest first to the LRU tail, so new content evicts the
    end of a cached prefix before its start: after ``j`` of its blocks are reused, the resend hits the
    remaining leading blocks, and after all are reused it misses.
    """
    tok = llm_tiny.get_tokenizer()
    p = tok.encode(STORY)[:100]  # 6 full blocks + 4 tokens; with its outputs it holds 7 blocks
    p_blocks = -(-(len(p) + NEW - 1) // BS)
    p_hittable = (len(p) - 1) // BS
    assert (p_blocks, p_hittable) == (7, 6)
    filler = tok.encode(" ".join([SYSTEM, OTHER, SYSTEM]))
    assert len(filler) >= TINY_BLOCKS * BS
    ref = llm_off.generate([p], GREEDY, use_tqdm=False)[0].token_ids
    kvm = kv(llm_tiny)
    kvm.reset_prefix_cache()

    first = llm_tiny.generate([p], GREEDY, use_tqdm=False)[0]
    assert first.token_ids == ref and first.metrics.num_cached_tokens == 0
    # The free queue is now [the 9 other blocks..., p's 7 blocks deepest first]. A filler needing
    # 9 + 3 blocks reuses p's 3 deepest blocks (its output block and prompt blocks 5 and 4).
    evicted = 3
    n_fill = (TINY_BLOCKS - p_blocks + evicted) * BS - NEW  # its K/V fills exactly 12 blocks
    out = llm_tiny.generate([filler[:n_fill]], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    again = llm_tiny.generate([p], GREEDY, use_tqdm=False)[0]
    assert again.token_ids == ref
    assert again.metrics.num_cached_tokens == (p_hittable - (evicted - 1)) * BS == 64
    check_pool(llm_tiny)

    # A filler of the whole pool (fresh tokens, so it hits nothing) reuses every block: a full miss.
    n_fill = TINY_BLOCKS * BS - NEW
    whole = list(reversed(filler))[:n_fill]
    out = llm_tiny.generate([whole], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    final = llm_tiny.generate([p], GREEDY, use_tqdm=False)[0]
    assert final.token_ids == ref and final.metrics.num_cached_tokens == 0
    check_pool(llm_tiny)


# ------------------------------------------------------------------------------------------- salts
def test_cache_salt_isolates(llm_on, llm_off):
    """Different salts never share blocks; the same salt does; outputs are the same for all."""
    tok = llm_on.get_tokenizer()
    prompt = tok.encode(SYSTEM + " Question: do you repair electric bikes?")
    ref = llm_off.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    kv(llm_on).reset_prefix_cache()
    full = (len(prompt) - 1) // BS * BS

    def run(salt):
        out = llm_on.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)[0]
        assert out.token_ids == ref
        return out.metrics.num_cached_tokens

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0
    assert run(None) == 0
    assert run("tenant-a") == full
    assert run("tenant-b") == full
    assert run(None) == full
    # Per-prompt salts in one call: the same prompt under a fresh salt twice in one batch shares.
    outs = llm_on.generate([prompt, prompt, prompt], GREEDY, use_tqdm=False,
                           cache_salt=["tenant-c", "tenant-c", "tenant-a"])
    assert [o.token_ids for o in outs] == [ref] * 3
    assert [o.metrics.num_cached_tokens for o in outs] == [0, full, full]
    with pytest.raises(ValueError, match="cache salts"):
        llm_on.generate([prompt], GREEDY, use_tqdm=False, cache_salt=["a", "b"])
    check_pool(llm_on)


# ------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(Engine(EngineArgs(dtype="float32", num_blocks=256, max_num_batched_tokens=256,
                                           max_model_len=512, log_stats_interval=0)))
    with ServerThread(build_app(engine, served_model_name="smol")) as srv:
        yield srv, engine
    engine.shutdown()


def test_server_cached_tokens_and_salt(server):
    """usage.prompt_tokens_details.cached_tokens on a repeat; the ``cache_salt`` body field isolates."""
    srv, engine = server
    body = {"model": "smol", "prompt": SYSTEM + " Question: when are you open?", "max_tokens": 4,
            "temperature": 0}
    chat = {"model": "smol", "messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "Hi!"}], "max_tokens": 4,
            "temperature": 0, "cache_salt": "tenant-z"}
    with httpx.Client(base_url=srv.base_url, timeout=120) as http:
        def post(path, payload):
            r = http.post(path, json=payload)
            assert r.status_code == 200, r.text
            r = r.json()
            text = r["choices"][0]["text"] if "text" in r["choices"][0] else r["choices"][0]["message"]["content"]
            return text, r["usage"]["prompt_tokens_details"]["cached_tokens"], r["usage"]["prompt_tokens"]

        text0, cached0, n_prompt = post("/v1/completions", body)
        text1, cached1, _ = post("/v1/completions", body)
        assert cached0 == 0 and cached1 == (n_prompt - 1) // BS * BS > 0 and text1 == text0
        salted = dict(body, cache_salt="tenant-x")
        text2, cached2, _ = post("/v1/completions", salted)
        text3, cached3, _ = post("/v1/completions", salted)
        assert (cached2, cached3) == (0, cached1) and text2 == text3 == text0
        chat0, c0, _ = post("/v1/chat/completions", chat)
        chat1, c1, _ = post("/v1/chat/completions", chat)
        chat2, c2, _ = post("/v1/chat/completions", dict(chat, cache_salt="tenant-y"))
        assert c0 == 0 and c1 > 0 and c2 == 0 and chat0 == chat1 == chat2
    idle, usage = engine.call(lambda e: (not e.has_unfinished_requests(), e.core.scheduler.kv_cache_manager.usage))
    assert idle and usage == 0.0
    engine.call(lambda e: e.core.scheduler.kv_cache_manager.check_integrity())
