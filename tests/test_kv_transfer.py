"""Prefill/decode disaggregation: a producer prefills, a consumer pulls the prompt's K/V over NIXL and decodes.

The scheduler's side is checked on hand-made steps (exact block counts, states, timeouts); the whole hand-off
between two real processes (a ``goodserve serve --kv-role producer`` subprocess and a consumer server in this
process) is checked token for token against colocated serving, with the bytes moved equal to
``2 · L · n_kv · d_head · b`` per pulled token.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from goodserve import LLM, SamplingParams
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.kv_transfer import KVConnectorOutput, KVTransferConfig, KVTransferParams
from goodserve.kv_transfer.factory import create_connector_scheduler
from goodserve.request_options import RequestOptions
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import SampledToken
from goodserve.scheduler.scheduler import Scheduler
from goodserve.server.app import build_app
from goodserve.validation import ParamError
from server_fixtures import ServeProcess, ServerThread, metric_samples, wait_idle
from tiny_models import make_tiny_hf_model

BS = 4  # block size of every instance here


# ------------------------------------------------------------------------------------- scheduler, by hand
def _scheduler(role: str, num_blocks: int = 16, timeout: float = 5.0, prefix: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=prefix),
                     kv_connector=create_connector_scheduler(
                         KVTransferConfig(role, engine_id="p0", port=5555, timeout=timeout), BS))


def _request(rid: str, prompt: list[int], max_tokens: int, kv: dict | None) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), 0.0,
                   options=RequestOptions(kv_transfer_params=None if kv is None else KVTransferParams.from_dict(kv)))


def _step(s: Scheduler, now: float, kv_output: KVConnectorOutput | None = None, token: int = 7):
    out = s.schedule(now)
    sampled = {r.request_id: SampledToken(token) for r in out.sampling()}
    return out, s.update_from_output(out, sampled, now, kv_output)


def _handle(rid: str, block_ids: list[int], num_tokens: int, lease: str = "0" * 32) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5555,
            "remote_block_ids": block_ids, "remote_request_id": rid, "remote_num_tokens": num_tokens,
            "remote_lease": lease}


def test_producer_holds_blocks_until_pulled_or_timeout():
    s = _scheduler("producer", timeout=5.0)
    kv = s.kv_cache_manager
    s.add_request(_request("a", list(range(10)), 1, {"do_remote_decode": True}))  # 10 tokens: 3 blocks
    s.add_request(_request("b", list(range(20, 26)), 1, {"do_remote_decode": True}))  # 6 tokens: 2 blocks
    _, outs = _step(s, 1.0)
    handles = {o.request_id: o.kv_transfer_params for o in outs}
    assert [o.finish_reason for o in outs] == ["length", "length"]
    lease_a = handles["a"]["remote_lease"]
    assert handles["a"] == _handle("a", [0, 1, 2], 10, lease_a) | {"do_remote_decode": False}
    assert len(lease_a) == 32 and int(lease_a, 16) >= 0 and handles["b"]["remote_lease"] != lease_a
    assert handles["b"]["remote_block_ids"] == [3, 4] and handles["b"]["remote_num_tokens"] == 6
    assert not s.has_unfinished_requests() and s.has_pending_kv_transfers()
    assert s.make_stats().num_blocks_held_for_pull == 5 and kv.num_free_blocks == 16 - 5
    _step(s, 2.0, KVConnectorOutput(finished_sending=["a"]))  # the consumer pulled a
    assert s.make_stats().num_blocks_held_for_pull == 2 and kv.num_free_blocks == 16 - 2
    _step(s, 5.9)
    assert s.make_stats().num_blocks_held_for_pull == 2  # b's hold ends at 1.0 + 5.0
    _step(s, 6.0)
    st = s.make_stats()
    assert st.num_blocks_held_for_pull == 0 and st.num_kv_transfer_timeouts_total == 1
    assert kv.num_free_blocks == 16 and not s.has_pending_kv_transfers()
    kv.check_integrity()


def test_producer_frees_at_once_on_abort_and_error():
    s = _scheduler("producer")
    s.add_request(_request("a", list(range(10)), 1, {"do_remote_decode": True}))
    s.schedule(0.0)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 16 and not s.has_pending_kv_transfers()


def test_consumer_pulls_all_but_the_last_prompt_token_then_decodes():
    s = _scheduler("consumer")
    kv = s.kv_cache_manager
    prompt = list(range(10))
    s.add_request(_request("c", prompt, 3, _handle("r", [5, 6, 7], 10)))
    out, outs = _step(s, 1.0)
    assert not out.scheduled and outs == []
    (load,) = out.kv_loads
    assert (load.request_id, load.block_ids, load.start, load.end) == ("c", [0, 1, 2], 0, 9)
    assert load.remote.remote_block_ids == (5, 6, 7)
    st = s.make_stats()
    assert st.num_kv_transfers_in_flight == 1 and st.num_running == 0 and kv.num_free_blocks == 13
    assert kv.get_computed_blocks(_request("x", prompt, 1, None)) == ([], 0)  # not registered before the pull
    out, outs = _step(s, 1.1)  # pull in flight: nothing to run
    assert not out.scheduled and not out.kv_loads
    out, outs = _step(s, 1.2, KVConnectorOutput(finished_recving={"c": (4608, 0.01)}))
    assert outs == [] and s.make_stats().num_kv_transfers_in_flight == 0
    out, outs = _step(s, 1.3)  # the last prompt token is computed here and samples the first output token
    (sr,) = out.scheduled
    assert (sr.num_computed_tokens, sr.num_new_tokens, sr.sample, sr.new_block_ids) == (9, 1, True, [0, 1, 2])
    assert out.num_prefix_cached_tokens == 0
    assert outs[0].new_token_ids == [7] and outs[0].kv_transfer == (4608, 0.01)
    assert kv.get_computed_blocks(_request("x", prompt + [1], 1, None))[1] == 8  # registered once pulled
    _step(s, 1.4)
    _, outs = _step(s, 1.5)
    assert outs[0].finish_reason == "length" and outs[0].kv_transfer is None
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_consumer_keeps_local_prefix_hits_and_pulls_the_rest():
    s = _scheduler("consumer")
    s.add_request(_request("warm", list(range(8)) + [99], 1, None))  # caches blocks [0..3], [4..7]
    _step(s, 0.0)
    s.add_request(_request("c", list(range(8)) + [50, 51, 52], 1, _handle("r", [1, 2, 3], 11)))
    out, _ = _step(s, 1.0)
    (load,) = out.kv_loads
    assert (load.start, load.end) == (8, 10) and out.num_prefix_cached_tokens == 8
    _step(s, 1.1, KVConnectorOutput(finished_recving={"c": (1024, 0.01)}))
    out, outs = _step(s, 1.2)
    assert out.scheduled[0].num_computed_tokens == 10 and outs[0].finish_reason == "length"
    assert outs[0].num_cached_tokens == 8
    s.kv_cache_manager.check_integrity()


def test_consumer_failed_pull_fails_the_request_and_frees_its_blocks():
    s = _scheduler("consumer")
    s.add_request(_request("c", list(range(10)), 3, _handle("r", [0, 1, 2], 10)))
    _step(s, 1.0)
    _, outs = _step(s, 1.1, KVConnectorOutput(failed_recving={"c": "producer gone"}))
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [("c", "error", "producer gone")]
    st = s.make_stats()
    assert st.num_kv_transfer_failures_total == 1 and s.kv_cache_manager.num_free_blocks == 16
    assert not s.has_unfinished_requests() and not s.has_pending_kv_transfers()


def test_consumer_abort_during_pull_frees_blocks_only_when_the_pull_ends():
    """The pull may still write into the blocks: they stay allocated until the connector reports its end."""
    s = _scheduler("consumer")
    s.add_request(_request("c", list(range(10)), 3, _handle("r", [0, 1, 2], 10)))
    _step(s, 1.0)
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.has_pending_kv_transfers()
    assert s.kv_cache_manager.num_free_blocks == 13
    s.kv_cache_manager.check_integrity()
    _, outs = _step(s, 1.1, KVConnectorOutput(finished_recving={"c": (4608, 0.01)}))
    assert outs == [] and s.kv_cache_manager.num_free_blocks == 16 and not s.has_pending_kv_transfers()
    s.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("role, kv, match", [
    (None, {"do_remote_decode": True}, "needs an instance started with --kv-role producer"),
    ("consumer", {"do_remote_decode": True}, "producer or both"),
    ("producer", _handle("r", [0, 1, 2], 10), "consumer or both"),
    ("consumer", _handle("r", [0, 1, 2], 9), "holds K/V for 9 tokens but this prompt has 10"),
    ("consumer", _handle("r", [0, 1], 10), "2 remote blocks cannot hold 10 tokens"),
])
def test_kv_transfer_params_the_instance_cannot_serve_are_refused(role, kv, match):
    s = _scheduler(role) if role else Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(16, BS))
    with pytest.raises(ParamError, match=match):
        s.add_request(_request("c", list(range(10)), 1, kv))
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("body, match", [
    ([], "must be an object"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "exactly one"),
    ({}, "exactly one"),
    ({"do_remote_decode": "yes"}, "do_remote_decode must be a boolean"),
    ({"do_remote_decode": True, "bogus": 1}, r"unknown field\(s\) \['bogus'\]"),
    ({"do_remote_prefill": True, "remote_engine_id": "p"}, "missing"),
    ({**_handle("r", [0, -1], 5)}, "remote_block_ids"),
    ({**_handle("r", [0], 5), "remote_port": 0}, "remote_port must be a positive integer"),
])
def test_kv_transfer_params_are_checked(body, match):
    with pytest.raises(ParamError, match=match) as e:
        KVTransferParams.from_dict(body)
    assert e.value.param == "kv_transfer_params"


# ------------------------------------------------------------------------- two processes, real transfers
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def _args(model: str, **kw) -> EngineArgs:
    return EngineArgs(model=model, dtype="float32", num_blocks=512, block_size=BS, max_model_len=1024,
                      log_stats_interval=0, **kw)


@pytest.fixture(scope="module")
def producer(tiny_model):
    srv = ServeProcess(tiny_model, "--kv-role", "producer", "--kv-transfer-timeout", "3")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def consumer(tiny_model):
    eng = AsyncEngine(Engine(_args(tiny_model, kv_role="consumer", kv_transfer_timeout=3)))
    with ServerThread(build_app(eng, served_model_name="tiny")) as srv:
        srv.engine = eng
        yield srv
    eng.shutdown()


def _bytes_per_token(engine: AsyncEngine) -> int:
    m = engine.engine.config.model
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 4  # fp32


def _disaggregated(producer_url: str, consumer_url: str, body: dict) -> tuple[dict, dict]:
    """The two hops a router makes: prefill (one token) on the producer, then the request with its handle."""
    first = httpx.post(producer_url + "/v1/completions", timeout=60,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    handle = first.json()["kv_transfer_params"]
    assert handle["do_remote_prefill"] is True
    second = httpx.post(consumer_url + "/v1/completions", json={**body, "kv_transfer_params": handle}, timeout=60)
    assert second.status_code == 200, second.text
    return handle, second.json()


def _wait_released(producer_url: str, timeout: float = 10.0) -> None:
    """The producer holds no blocks: every pull released its hold (or the hold timed out)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=producer_url) as http:
        while True:
            m = metric_samples(http)
            if m[("goodserve:kv_transfer_blocks_held", frozenset())] == 0 and \
                    m[("goodserve:kv_cache_usage_perc", frozenset())] == 0:
                return
            assert time.monotonic() < deadline, "the producer still holds blocks"
            time.sleep(0.05)


@pytest.mark.parametrize("prompt, residue", [
    ("The capital of France is a city where many people live", 3),  # 11 tokens: ends mid-block
    ("one two three four five six seven eight nine ten eleven twelve", 0),  # 12 tokens: on a block boundary
], ids=["mid-block", "block-boundary"])
def test_disaggregated_greedy_equals_colocated(tiny_model, producer, consumer, prompt, residue):
    """Producer process + consumer process = colocated output, token for token (fp32); the bytes moved are
    ``2·L·n_kv·d_head·4`` per pulled token; a repeat finds the prompt in the consumer's prefix cache and pulls
    only the rest; nothing stays held on either side."""
    llm = LLM(tiny_model, dtype="float32", block_size=BS, num_blocks=64, log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = llm.generate([prompt], params, use_tqdm=False)[0]
    num_prompt = len(ref.prompt_token_ids)
    assert num_prompt % BS == residue
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    per_token = _bytes_per_token(consumer.engine)
    with httpx.Client(base_url=consumer.base_url) as http:
        before = metric_samples(http)
        handle, out = _disaggregated(producer.base_url, consumer.base_url, body)
        assert handle["remote_num_tokens"] == num_prompt
        assert out["choices"][0]["text"] == ref.text
        assert out["usage"]["prompt_tokens"] == num_prompt and out["usage"]["completion_tokens"] == 16
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        after = metric_samples(http)
        moved = after[("goodserve:kv_transfer_bytes_sum", frozenset())] - \
            before[("goodserve:kv_transfer_bytes_sum", frozenset())]
        assert moved == per_token * (num_prompt - 1)
        # Again: the consumer now holds the prompt's full blocks but the last one's, and pulls only the rest.
        _, out = _disaggregated(producer.base_url, consumer.base_url, body)
        assert out["choices"][0]["text"] == ref.text
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (num_prompt - 1) // BS * BS > 0
        again = metric_samples(http)
        moved = again[("goodserve:kv_transfer_bytes_sum", frozenset())] - \
            after[("goodserve:kv_transfer_bytes_sum", frozenset())]
        assert moved == per_token * (num_prompt - 1 - cached)
    wait_idle(consumer.engine)
    _wait_released(producer.base_url)


def test_kv_layouts_match_bytes_for_bytes(tiny_model, producer, consumer):
    """The pulled K/V is the producer's own: the consumer's blocks equal what a colocated prefill writes."""
    prompt = "Pack my box with five dozen liquor jugs"
    _, out = _disaggregated(producer.base_url, consumer.base_url,
                            {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    eng = Engine(_args(tiny_model))
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id="ref")
    eng.step()  # the whole prompt: its K/V is written
    ref_ids, n = eng.core.scheduler.kv_cache_manager.get_block_ids("ref"), len(eng.tokenize(prompt)) - 1

    def table(engine: Engine) -> list[int]:  # the consumer's cached blocks of the prompt, by its hashes
        req = Request("probe", engine.tokenize(prompt) + [0], SamplingParams(max_tokens=1), 0.0)
        return engine.core.scheduler.kv_cache_manager.get_computed_blocks(req)[0]

    got_ids = consumer.engine.call(table)
    full = n // BS
    assert len(got_ids) == full > 0
    for (k, v), (rk, rv) in zip(consumer.engine.engine.core.runner.kv_caches, eng.core.runner.kv_caches):
        assert k[got_ids].equal(rk[ref_ids[:full]]) and v[got_ids].equal(rv[ref_ids[:full]])


@pytest.mark.parametrize("known", [False, True], ids=["new-producer", "known-producer"])
def test_consumer_fails_cleanly_when_the_producer_is_gone(tiny_model, consumer, known):
    """Producer killed after the prefill (its handle in flight): the consumer's request fails with a clear
    error naming the producer, within the transfer timeout, and frees its blocks; the consumer serves on. With
    ``known``, the consumer pulled from it before (it has its layout, so the READ itself meets the dead peer)."""
    srv = ServeProcess(tiny_model, "--kv-role", "producer", "--kv-transfer-timeout", "30")
    body = {"model": "tiny", "prompt": "A request whose producer dies", "max_tokens": 4, "temperature": 0}
    try:
        if known:
            _disaggregated(srv.base_url, consumer.base_url, {**body, "prompt": "a first pull"})
        first = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                           json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        handle = first.json()["kv_transfer_params"]
    finally:
        srv.close()
    t0 = time.monotonic()
    r = httpx.post(consumer.base_url + "/v1/completions", json={**body, "kv_transfer_params": handle}, timeout=60)
    assert time.monotonic() - t0 < 3 + 5
    assert r.status_code == 500, r.text
    assert handle["remote_engine_id"] in r.json()["error"]["message"]
    wait_idle(consumer.engine)
    with httpx.Client(base_url=consumer.base_url) as http:
        assert metric_samples(http)[("goodserve:kv_transfer_failures_total", frozenset())] >= 1
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "still serving", "max_tokens": 2})
        assert ok.status_code == 200


def test_producer_frees_an_unpulled_hold_after_the_timeout(producer):
    """A handle nobody pulls (client gone between the hops, decode instance down): the producer frees the blocks
    after ``--kv-transfer-timeout`` and counts it."""
    with httpx.Client(base_url=producer.base_url, timeout=60) as http:
        before = metric_samples(http)[("goodserve:kv_transfer_timeouts_total", frozenset())]
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "nobody pulls this", "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200
        assert metric_samples(http)[("goodserve:kv_transfer_blocks_held", frozenset())] > 0
    _wait_released(producer.base_url, timeout=3 + 5)
    with httpx.Client(base_url=producer.base_url) as http:
        assert metric_samples(http)[("goodserve:kv_transfer_timeouts_total", frozenset())] == before + 1


def test_kv_transfer_params_refused_with_a_400_naming_the_field(consumer):
    with httpx.Client(base_url=consumer.base_url) as http:
        for extra in ({"kv_transfer_params": {"do_remote_decode": True}},  # a consumer is not a producer
                      {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    wait_idle(consumer.engine)


# -------------------------------------------------------------------------------------- through the router
@pytest.fixture(scope="module")
def colocated(tiny_model):
    """What one colocated instance answers (the reference)."""
    eng = AsyncEngine(Engine(_args(tiny_model)))
    with ServerThread(build_app(eng, served_model_name="tiny")) as srv:
        yield srv
    eng.shutdown()


def _router(**kw) -> ServerThread:
    from goodserve.router.app import Router, build_router_app

    return ServerThread(build_router_app(Router(**kw)))


def _sse_text(r: httpx.Response, chat: bool) -> tuple[str, dict]:
    import json

    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and
              line != "data: [DONE]"]
    text = "".join((e["choices"][0]["delta"].get("content") or "") if chat else e["choices"][0]["text"]
                   for e in events if e["choices"])
    return text, events[-1]["usage"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_router_prefill_decode_equals_colocated(producer, consumer, colocated, chat):
    """``goodserve router --prefill P --decode D``: the client gets the decode instance's answer, equal to a
    colocated instance's, streamed or not, with usage counting the whole request; nothing stays held."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "Tell me about caches"}]} if chat else
               {"prompt": "Tell me about caches and"})}
    ref = httpx.post(colocated.base_url + path, json=body, timeout=60).json()
    ref_text = ref["choices"][0]["message"]["content"] if chat else ref["choices"][0]["text"]
    with _router(prefill=[producer.base_url], decode=[consumer.base_url]) as router, \
            httpx.Client(base_url=router.base_url, timeout=60) as http:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["choices"][0]["message"]["content"] if chat else out["choices"][0]["text"]) == ref_text
        assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == 12
        r = http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        text, use = _sse_text(r, chat)
        assert text == ref_text and use["completion_tokens"] == 12
    wait_idle(consumer.engine)
    _wait_released(producer.base_url)


def test_router_answers_503_at_once_when_the_decode_instance_is_down(producer):
    """The prefill hop succeeds, no decode instance answers: 503 with an OpenAI error body at once; the producer
    frees the held blocks when its transfer timeout passes."""
    from server_fixtures import free_port

    with _router(prefill=[producer.base_url], decode=[f"http://127.0.0.1:{free_port()}"]) as router:
        t0 = time.monotonic()
        r = httpx.post(router.base_url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "no decoder", "max_tokens": 4})
        assert time.monotonic() - t0 < 2.0
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    _wait_released(producer.base_url, timeout=3 + 5)


@pytest.fixture(scope="module")
def producer_int8(tiny_model):
    srv = ServeProcess(tiny_model, "--kv-role", "producer", "--kv-transfer-timeout", "3", "--kv-cache-dtype", "int8")
    yield srv
    srv.close()


def test_disaggregated_on_int8_pools(tiny_model, producer_int8, consumer):
    """P/D between int8 pools (rows ``[.., head_dim + 4]`` with their scales): the consumer's blocks are the
    producer's bytes, the bytes moved per pulled token are the spec's int8 bytes per token, the output is the
    colocated int8 engine's; a float32 consumer refuses the int8 producer's layout by name."""
    prompt = "The capital of France is a city where many people live"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ref = LLM(tiny_model, dtype="float32", kv_cache_dtype="int8", block_size=BS, num_blocks=64,
              log_stats_interval=0).generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                             use_tqdm=False)[0]
    eng = AsyncEngine(Engine(_args(tiny_model, kv_role="consumer", kv_transfer_timeout=3, kv_cache_dtype="int8")))
    try:
        with ServerThread(build_app(eng, served_model_name="tiny")) as srv, httpx.Client(base_url=srv.base_url) as http:
            before = metric_samples(http)
            handle, out = _disaggregated(producer_int8.base_url, srv.base_url, body)
            assert out["choices"][0]["text"] == ref.text
            moved = metric_samples(http)[("goodserve:kv_transfer_bytes_sum", frozenset())] - \
                before[("goodserve:kv_transfer_bytes_sum", frozenset())]
            m = eng.engine.config.model
            assert moved == m.kv_cache_spec("int8").bytes_per_token() * (handle["remote_num_tokens"] - 1)
            local = Engine(_args(tiny_model, kv_cache_dtype="int8"))
            local.add_request(prompt, SamplingParams(temperature=0, max_tokens=2), request_id="ref")
            local.step()
            ref_ids = local.core.scheduler.kv_cache_manager.get_block_ids("ref")
            full = (len(local.tokenize(prompt)) - 1) // BS
            probe = Request("probe", local.tokenize(prompt) + [0], SamplingParams(max_tokens=1), 0.0)
            got_ids = eng.call(lambda e: e.core.scheduler.kv_cache_manager.get_computed_blocks(probe)[0])
            assert len(got_ids) == full > 0
            for (k, v), (rk, rv) in zip(eng.engine.core.runner.kv_caches, local.core.runner.kv_caches):
                assert k.dtype == torch.int8 and k[got_ids].equal(rk[ref_ids[:full]]) and \
                    v[got_ids].equal(rv[ref_ids[:full]])
            wait_idle(eng)
    finally:
        eng.shutdown()
    first = httpx.post(producer_int8.base_url + "/v1/completions", timeout=60,  # to the float32 consumer
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    r = httpx.post(consumer.base_url + "/v1/completions", timeout=60,
                   json={**body, "kv_transfer_params": first.json()["kv_transfer_params"]})
    assert r.status_code == 500 and "KV layouts differ" in r.json()["error"]["message"], r.text
    wait_idle(consumer.engine)
    _wait_released(producer_int8.base_url)
