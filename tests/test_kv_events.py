"""KV events (issue 35): the engine's prefix cache published as BlockStored / BlockRemoved / AllBlocksCleared,
the router's index built from them, the replay that repairs gaps and restarts, and the kv-aware cost."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from factories import create_requests, fake_step
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_events.config import KVEventsConfig
from goodserve.kv_events.events import (AllBlocksCleared, BlockRemoved, BlockStored, InstanceLoad, KVEventBatch,
                                        decode_batch, encode_batch)
from goodserve.kv_events.index import KVIndex
from goodserve.kv_cache.hashing import hash_request_blocks
from goodserve.router.policies import BackendState, KVAware, RouteRequest, predicted_ttft_s
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.step_time import StepCoefficients


def _scheduler(num_blocks: int = 12, block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                     CacheConfig(num_blocks=num_blocks, block_size=block_size, enable_kv_events=True))


def _cached(s: Scheduler) -> set[bytes]:
    return {h for h, _ in s.kv_cache_manager.block_pool.cached_items()}


def _run(s: Scheduler, reqs, now: float = 0.0) -> None:
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished_requests():
        fake_step(s, now)
        s.kv_cache_manager.check_integrity()


def _workload():
    """Requests sharing prefixes, then enough distinct ones to evict: (stage name, requests) pairs."""
    shared = list(range(100, 120))
    yield "first", create_requests(1, prompt_token_ids=shared + [5, 6], prefix="a")
    yield "hit", create_requests(2, prompt_token_ids=shared + [9, 9, 9], prefix="b")
    yield "evict", create_requests(3, prompt_len=22, prefix="c", start=7)


def test_events_rebuild_the_pool_exactly_through_hits_evictions_and_reset():
    s, index = _scheduler(), KVIndex(pending_ttl=0)
    seen = set()
    for stage, reqs in _workload():
        _run(s, reqs)
        events = s.kv_cache_manager.take_kv_events()
        seen.update(type(e).__name__ for e in events)
        index.apply("i0", KVEventBatch(0.0, tuple(events), stream_id="x"))
        assert index.instances["i0"].hashes == _cached(s), stage
    assert seen == {"BlockStored", "BlockRemoved"}  # the small pool evicted cached blocks
    s.kv_cache_manager.reset_prefix_cache()
    events = s.kv_cache_manager.take_kv_events()
    assert events == [AllBlocksCleared()]
    index.apply("i0", KVEventBatch(0.0, tuple(events), stream_id="x"))
    assert index.instances["i0"].hashes == set() == _cached(s)


def test_block_stored_carries_the_chain_parent_and_tokens():
    s = _scheduler(num_blocks=32)
    prompt = list(range(100, 110))  # 2 full blocks of 4 + 2 tokens
    _run(s, create_requests(1, prompt_token_ids=prompt, max_tokens=3))
    stored = [e for e in s.kv_cache_manager.take_kv_events() if isinstance(e, BlockStored)]
    hashes = hash_request_blocks(prompt + [7, 7, 7], 4, extra_keys=(None,))  # the fake model samples 7
    assert [h for e in stored for h in e.block_hashes] == hashes[:3]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 4
    for e in stored:
        assert len(e.token_ids) == 4 * len(e.block_hashes)
    assert stored[0].token_ids[:8] == tuple(prompt[:8])


def test_batches_round_trip_and_malformed_ones_are_refused():
    batch = KVEventBatch(1.5, (BlockStored((b"a" * 32, b"b" * 32), None, tuple(range(8)), 4),
                               BlockRemoved((b"a" * 32,)), AllBlocksCleared()),
                         InstanceLoad(0.25, 3, 1, 40, (0.01, 1e-4, 0.0, 0.0, 0.0, 0.0), 512), "abc")
    assert decode_batch(encode_batch(batch)) == batch
    import msgpack
    for bad in (b"\xc1", msgpack.packb([1.0, [["BlockStored", [b"x"], None, [1, 2, 3], 4]], None, "s", False]),
                msgpack.packb([1.0, [["Nope"]], None, "s", False]), msgpack.packb({"a": 1})):
        with pytest.raises(ValueError):
            decode_batch(bad)


def test_kv_events_config_parses_vllm_shape_and_refuses_bad_values():
    c = KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                '"endpoint": "tcp://127.0.0.1:5557", "buffer_steps": 8}')
    assert (c.enabled, c.endpoint, c.buffer_steps, c.replay_endpoint) == (True, "tcp://127.0.0.1:5557", 8,
                                                                           "tcp://127.0.0.1:*")
    assert KVEventsConfig.from_cli(None) is None
    assert not KVEventsConfig(publisher="null").enabled
    for bad, msg in (('{"endpoint": "http://x"}', "tcp://"), ('{"nope": 1}', "unknown key"), ("[1]", "JSON object"),
                     ('{"buffer_steps": 0}', "buffer_steps"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=msg):
            KVEventsConfig.from_cli(bad)


# ------------------------------------------------------------------------- over ZeroMQ: replay and restart
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def _publish_workload(s: Scheduler, pub) -> None:
    for _, reqs in _workload():
        _run(s, reqs)
        pub.publish(s.kv_cache_manager.take_kv_events(), InstanceLoad.of(s))


@pytest.mark.parametrize("buffer_steps", [100, 1])  # late join: replayed from the buffer / from a snapshot
def test_subscriber_replays_what_it_missed_and_follows_a_restarted_instance(buffer_steps):
    from goodserve.kv_events.publisher import ZmqEventPublisher
    from goodserve.kv_events.subscriber import KVEventSubscriber

    ports = _free_port(), _free_port()
    config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
                            buffer_steps=buffer_steps, load_interval=0)

    async def scenario():
        index = KVIndex()
        s, pub = _scheduler(), ZmqEventPublisher(config)
        _publish_workload(s, pub)  # all before anyone subscribed: PUB drops it
        await asyncio.sleep(0.2)
        sub = KVEventSubscriber("i0", pub.endpoint, pub.replay_endpoint, index, topic=config.topic)
        sub.start()
        await _until(lambda: sub.last_seq == 2)
        assert index.instances["i0"].hashes == _cached(s)
        assert sub.num_replays == 1 and sub.stream_id == pub.stream_id
        assert index.instances["i0"].load.num_running == 0
        # live: a new request's blocks, then a reset
        _run(s, create_requests(1, prompt_len=9, prefix="d", start=50))
        pub.publish(s.kv_cache_manager.take_kv_events(), InstanceLoad.of(s))
        await _until(lambda: sub.last_seq == 3)
        assert index.instances["i0"].hashes == _cached(s)
        s.kv_cache_manager.reset_prefix_cache()
        pub.publish(s.kv_cache_manager.take_kv_events())
        await _until(lambda: sub.last_seq == 4)
        assert index.instances["i0"].hashes == set()
        # the instance restarts on the same sockets: a new life, its cache rebuilt by the new events only
        pub.close()
        s2, pub2 = _scheduler(), ZmqEventPublisher(config)
        await asyncio.sleep(0.3)  # the SUB socket reconnects
        _run(s2, create_requests(1, prompt_len=13, prefix="e", start=60))
        pub2.publish(s2.kv_cache_manager.take_kv_events(), InstanceLoad.of(s2))
        await _until(lambda: sub.stream_id == pub2.stream_id and sub.last_seq == 0)
        assert index.instances["i0"].hashes == _cached(s2) and len(_cached(s2)) == 4  # 13 prompt + 3 computed outputs
        await sub.close()
        pub2.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------- the cost
COEFFS = StepCoefficients(overhead_s=0.01, per_token_s=1e-3, per_sampled_s=0.0, per_pair_s=0.0)


def _kv_aware_pair(prompt):
    """A kv-aware policy over two instances, ``a`` holding ``prompt``'s full blocks."""
    index = KVIndex(default_block_size=4, pending_ttl=0)
    hashes = hash_request_blocks(prompt, 4, extra_keys=(None,))
    index.apply("a", KVEventBatch(0.0, (BlockStored(tuple(hashes), None, tuple(prompt[:4 * len(hashes)]), 4),),
                                  stream_id="a"))
    index.apply("b", KVEventBatch(0.0, (), InstanceLoad(0.0, 0, 0, 0), stream_id="b"))
    return KVAware(index, coefficients=COEFFS, token_budget=256, min_match_tokens=8, clock=lambda: 0.0)


def test_kv_aware_prefers_the_longest_prefix_until_its_queue_outweighs_the_saved_prefill():
    prompt = tuple(range(1000, 1102))  # 102 tokens: a holds 100 (25 blocks of 4)
    policy, req = _kv_aware_pair(list(prompt)), RouteRequest(102, 10, token_ids=prompt)
    a, b = BackendState("a"), BackendState("b")
    assert policy.select([a, b], req) == 0
    assert policy.prefill_tokens(a, req) == 2 and policy.prefill_tokens(b, req) == 102
    # The hit saves 100 tokens = 0.1 s: a queue of 99 tokens on a still loses to none on b, 101 does not.
    assert predicted_ttft_s(COEFFS, 99, 1, 2, 100, 0, 256) == pytest.approx(0.01 + 0.101)
    assert predicted_ttft_s(COEFFS, 0, 0, 102, 0, 0, 256) == pytest.approx(0.01 + 0.102)
    a.start(RouteRequest(99, 1), 99)
    assert policy.select([a, b], req) == 0
    a.start(RouteRequest(2, 1), 2)  # 101 queued on a
    assert policy.select([a, b], req) == 1
    a.healthy = False
    assert policy.select([a, b], req) == 1


def test_kv_aware_ignores_short_matches_and_falls_back_without_ids_or_events():
    prompt = tuple(range(1000, 1100))
    policy = _kv_aware_pair(list(prompt[:4]) + [1] * 96)  # a holds only the first block (4 < 8 tokens)
    a, b = BackendState("a"), BackendState("b")
    a.outstanding_tokens = 1  # with hits ignored, the tie goes to fewer outstanding tokens
    assert policy.select([a, b], RouteRequest(100, 10, token_ids=prompt)) == 1
    text = RouteRequest(50, 10, text="x" * 200)  # no ids: the guessing index (prefix-affinity) decides
    assert policy.select([a, b], text) == policy._guess._fallback.select([a, b], text)
    silent = KVAware(KVIndex(), coefficients=COEFFS)
    assert silent.select([BackendState("p"), BackendState("q")], RouteRequest(8, 1, token_ids=tuple(range(8)))) == 0


def test_kv_aware_burst_follows_the_first_request_before_its_events():
    index = KVIndex(default_block_size=4, pending_ttl=5.0)
    for name in "ab":
        index.apply(name, KVEventBatch(0.0, (), InstanceLoad(0.0, 0, 0, 0), stream_id=name))
    now = [0.0]
    policy = KVAware(index, coefficients=COEFFS, token_budget=256, min_match_tokens=8, clock=lambda: now[0])
    a, b = BackendState("a"), BackendState("b")
    b.start(RouteRequest(68, 4), 68)  # b is busy too, a little less than a will be
    shared = tuple(range(64))
    first = RouteRequest(70, 4, token_ids=shared + (1,) * 6)
    assert policy.select([a, b], first) == 0
    a.start(first, policy.prefill_tokens(a, first))
    second = RouteRequest(70, 4, token_ids=shared + (2,) * 6)
    # The first's 16 blocks count as pending on a: 70 + 6 tokens to compute there, against 68 + 70 on b.
    assert policy.select([a, b], second) == 0 and policy.prefill_tokens(a, second) == 6
    now[0] = 6.0  # expired: a would compute 70 + 70 tokens, b 68 + 70
    assert policy.select([a, b], second) == 1


# ------------------------------------------------- HTTP: two real goodserve servers behind a kv-aware router
@pytest.fixture(scope="module")
def publishing_backends(tmp_path_factory):
    """Two servers over the same tiny random model, each publishing KV events: ``[(ServerThread, AsyncEngine)]``."""
    from goodserve.engine.args import EngineArgs
    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.server.app import build_app
    from server_fixtures import ServerThread
    from tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    out = []
    try:
        for _ in range(2):
            eng = AsyncEngine(Engine(EngineArgs(model=model, dtype="float32", num_blocks=24, block_size=4,
                                                max_num_batched_tokens=64, max_model_len=128, log_stats_interval=0,
                                                kv_events_config='{"load_interval": 0}')))
            out.append((ServerThread(build_app(eng, served_model_name="tiny")).__enter__(), eng))
        yield out
    finally:
        for srv, eng in out:
            srv.__exit__(None, None, None)
            eng.shutdown()
            eng.engine.core.close()


def _pool_hashes(eng) -> set[bytes]:
    return eng.call(lambda e: {h for h, _ in e.core.scheduler.kv_cache_manager.block_pool.cached_items()})


def test_router_index_equals_every_replicas_prefix_cache_and_routes_to_the_hit(publishing_backends):
    import httpx

    from goodserve.router.app import Router
    from server_fixtures import RouterServer, metric_samples

    (s0, e0), (s1, e1) = publishing_backends
    info = httpx.get(s0.base_url + "/v1/kv_events").json()
    assert info["block_size"] == 4 and info["endpoint"].startswith("tcp://127.0.0.1:")
    router = Router(replicas=[s0.base_url, s1.base_url], policy=KVAware(min_match_tokens=8), health_interval=0.05)
    with RouterServer(router) as http:
        def agree() -> bool:
            views = router.kv_events.index.instances
            return all(url in views and views[url].hashes == _pool_hashes(e)
                       for url, e in ((s0.base_url, e0), (s1.base_url, e1)))

        http.get("/health")  # starts the prober, which finds both publishers
        deadline = time.monotonic() + 10
        while len(router.kv_events.subscribers) < 2:
            assert time.monotonic() < deadline, "the router did not subscribe"
            time.sleep(0.02)
        shared = list(range(300, 340))  # 10 blocks
        usage, held = [], []
        for i in range(6):  # the long shared prefix, then distinct prompts that evict on a 24-block pool
            prompt = shared + [500 + i] * 3 if i % 2 == 0 else list(range(1000 + 60 * i, 1050 + 60 * i))
            index = router.kv_events.index
            held.append(4 * max(index.match(u, index.block_hashes(u, prompt)) for u in (s0.base_url, s1.base_url)))
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                    "temperature": 0})
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
            deadline = time.monotonic() + 10
            while not agree():
                assert time.monotonic() < deadline, ("the index did not converge on the pools", i, [
                    (len(router.kv_events.index.instances.get(u).hashes) if u in router.kv_events.index.instances
                     else None, len(_pool_hashes(e)), router.kv_events.describe(u))
                    for u, e in ((s0.base_url, e0), (s1.base_url, e1))])
                time.sleep(0.02)
        # every request went where its prefix was cached (both replicas idle: the hit wins), so it found
        # exactly what the index said was held somewhere; the shared prefix's second use: 40 of 43 tokens
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == held
        assert held[2] == 40
        body = http.get("/health").json()
        for b in body["backends"]:
            assert b["kv_events"]["publishes"] and b["kv_events"]["cached_blocks"] == len(
                router.kv_events.index.instances[b["url"]].hashes)
        samples = metric_samples(http)
        for url in (s0.base_url, s1.base_url):
            ours = samples[("goodserve:router_kv_index_blocks", frozenset({("backend", url)}))]
            theirs = samples[("goodserve:prefix_cache_blocks", frozenset({("instance", url)}))]
            assert ours == theirs == len(router.kv_events.index.instances[url].hashes)


def test_pd_decode_choice_reads_the_published_kv_usage():
    """The P/D decode pool goes by least KV usage: the usage each consumer published with its KV events."""
    from goodserve.router.app import Router

    router = Router(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2", "http://127.0.0.1:3"])
    pool = router.pools["decode"]
    for b, usage in zip(pool, (0.9, 0.2)):
        router.kv_events.index.apply(b.url, KVEventBatch(0.0, (), InstanceLoad(usage, 4, 0, 0), stream_id=b.url))
    router.refresh_kv_usage(pool)
    assert [b.state.kv_usage for b in pool] == [0.9, 0.2]
    assert router.policies["decode"].select([b.state for b in pool], RouteRequest(0, 0)) == 1
    router.kv_events.index.forget(pool[1].url)  # publishes nothing (any more): unknown usage counts as 0
    router.refresh_kv_usage(pool)
    assert pool[1].state.kv_usage is None
    assert router.policies["decode"].select([b.state for b in pool], RouteRequest(0, 0)) == 1


def test_router_tokenizer_gives_the_servers_token_ids_and_kv_aware_routes_chat_to_the_hit(publishing_backends):
    """With the model's tokenizer the router hashes text and chat prompts as the engine will: its ids equal
    the server's /tokenize, and chats sharing a long system prompt follow the replica that cached it."""
    import httpx

    from goodserve.router.app import Router
    from goodserve.router.tokenize import PromptTokenizer
    from server_fixtures import RouterServer

    (s0, e0), (s1, e1) = publishing_backends
    tok = PromptTokenizer.load(e0.model_path)
    system = {"role": "system", "content": "You answer in one word. " * 6}
    bodies = [{"prompt": "The capital of France is"},
              {"messages": [system, {"role": "user", "content": "Sky colour?"}]},
              {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                            {"role": "user", "content": "Hi"}]}]
    for body in bodies:
        want = httpx.post(s0.base_url + "/tokenize", json={"model": "tiny", **body}).json()["tokens"]
        assert list(tok.token_ids(body)) == want
    assert tok.token_ids({"messages": [{"role": "tool", "content": "x"}]}) is None  # the backend says why
    router = Router(replicas=[s0.base_url, s1.base_url], policy=KVAware(min_match_tokens=8), health_interval=0.05,
                    tokenizer=tok)
    with RouterServer(router) as http:
        http.get("/health")
        deadline = time.monotonic() + 10
        while len(router.kv_events.subscribers) < 2 or not all(router.kv_events.index.publishes(u)
                                                               for u in (s0.base_url, s1.base_url)):
            assert time.monotonic() < deadline, "the router did not subscribe"
            time.sleep(0.02)
        cached = []
        for q in ("Sky colour?", "Grass colour?", "Snow colour?"):
            r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                         "messages": [system, {"role": "user", "content": q}]})
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(0.2)  # the events of its blocks arrive
        assert cached[0] == 0 and cached[1] >= 32 and cached[2] >= 32
