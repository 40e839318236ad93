"""P/D faults end to end on the tiny model: stale and forged handles (C20), clients that leave during or
between the hops (C23), and the producer's release route. A producer is a ``goodserve serve`` subprocess, the
consumer and the router run in this process.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.server.app import build_app
from server_fixtures import ServeProcess, ServerThread, free_port, metric_samples, wait_idle
from tiny_models import make_tiny_hf_model

BS = 4
HELD, USAGE = ("goodserve:kv_transfer_blocks_held", frozenset()), ("goodserve:kv_cache_usage_perc", frozenset())
TIMEOUTS = ("goodserve:kv_transfer_timeouts_total", frozenset())
ABORTED_HOLDS = ("goodserve:kv_transfer_holds_released_total", frozenset({("reason", "aborted")}))
ABORTED_CALLS = ("goodserve:api_requests_aborted_total", frozenset({("endpoint", "/v1/completions")}))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def small_producer(tiny_model):
    """C20's producer: 128 blocks, holds expire after 2 s."""
    srv = ServeProcess(tiny_model, "--kv-role", "producer", "--kv-transfer-timeout", "2", "--num-blocks", "128")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def producer(tiny_model):
    """A producer whose holds would wait 30 s, with prefills slow enough to leave during: one token a step, so a
    1,000-token prompt takes 1,000 steps (a whole one at 16 tokens a step took 0.26 s here)."""
    srv = ServeProcess(tiny_model, "--kv-role", "producer", "--kv-transfer-timeout", "30",
                       "--max-num-batched-tokens", "1", "--num-blocks", "2048")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def consumer(tiny_model):
    args = EngineArgs(model=tiny_model, dtype="float32", num_blocks=512, block_size=BS, max_model_len=1024,
                      log_stats_interval=0, kv_role="consumer", kv_transfer_timeout=3)
    eng = AsyncEngine(Engine(args))
    with ServerThread(build_app(eng, served_model_name="tiny")) as srv:
        srv.engine = eng
        yield srv
    eng.shutdown()


def _metrics(url: str) -> dict:
    with httpx.Client(base_url=url) as http:
        return metric_samples(http)


def _wait_for(url: str, done, timeout: float) -> float:
    """Seconds until ``done(metrics)`` holds on the instance at ``url`` (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not done(_metrics(url)):
        assert time.monotonic() - t0 < timeout, f"{url}: not within {timeout} s: {_metrics(url)}"
        time.sleep(0.05)
    return time.monotonic() - t0


def _prefill(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _idle(producer_url: str, consumer) -> None:
    """Nothing held or in use on either side; the consumer's pool passes check_integrity()."""
    _wait_for(producer_url, lambda m: m[HELD] == 0 and m[USAGE] == 0, timeout=5)
    wait_idle(consumer.engine)


BODY = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


def test_c20_a_handle_whose_hold_expired_is_refused_never_answered_with_another_requests_text(
        small_producer, consumer):
    """C20: prefill A and keep its handle; its hold expires (2 s); a dozen other prompts reuse the pool's blocks
    (12 x 13 blocks > 128); the consumer given A's old handle answers an error naming the expired hold, not a
    200, and afterwards nothing is held or leaked on either side. A fresh handle for A still works."""
    url = small_producer.base_url
    before = _metrics(url)
    handle = _prefill(url, BODY)
    _wait_for(url, lambda m: m[TIMEOUTS] == before[TIMEOUTS] + 1 and m[HELD] == 0, timeout=10)
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(12):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1000 + 50 * i + j for j in range(48)],
                                                   "max_tokens": 2})
            assert r.status_code == 200, r.text
    r = httpx.post(consumer.base_url + "/v1/completions", json={**BODY, "kv_transfer_params": handle}, timeout=60)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "InternalServerError"
    assert f"the KV hold of request {handle['remote_request_id']} expired" in error["message"]
    assert handle["remote_engine_id"] in error["message"]
    _idle(url, consumer)
    ref = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    fresh = _prefill(url, BODY)
    r = httpx.post(consumer.base_url + "/v1/completions", json={**BODY, "kv_transfer_params": fresh}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    _idle(url, consumer)


@pytest.mark.parametrize("forge, match", [
    (lambda h: {**h, "remote_lease": "0" * 32}, "the lease does not match the KV hold of request"),
    (lambda h: {**h, "remote_block_ids": h["remote_block_ids"][::-1]}, "(a forged handle)"),
    (lambda h: {**h, "remote_request_id": "cmpl-nobody-0"}, "no KV hold of request cmpl-nobody-0"),
], ids=["wrong-nonce", "wrong-blocks", "unknown-id"])
def test_c20_a_forged_handle_is_refused_and_the_real_one_still_pulls(producer, consumer, forge, match):
    """C20: the consumer refuses (500, the producer's reason in the message) a handle whose lease, block ids or
    request id were changed, without ending the real hold: the real handle then answers the colocated text."""
    url = producer.base_url
    body = {**BODY, "prompt": f"{match}: a prompt the consumer has not cached"}  # so that it pulls every block
    ref = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    handle = _prefill(url, body)
    assert len(set(handle["remote_block_ids"])) > 1
    r = httpx.post(consumer.base_url + "/v1/completions", json={**body, "kv_transfer_params": forge(handle)},
                   timeout=60)
    assert r.status_code == 500 and match in r.json()["error"]["message"], r.text
    assert _metrics(url)[HELD] == len(handle["remote_block_ids"])
    r = httpx.post(consumer.base_url + "/v1/completions", json={**body, "kv_transfer_params": handle}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
    _idle(url, consumer)


def test_release_route_checks_the_lease_and_frees_at_once(producer):
    """``POST /v1/kv_transfer/release``: a forged lease is a 404 and frees nothing; the real handle frees the
    hold at once, counted as an abort, not a timeout; a second release is a 404 naming why."""
    url = producer.base_url
    before = _metrics(url)
    handle = _prefill(url, BODY)
    with httpx.Client(base_url=url) as http:
        r = http.post("/v1/kv_transfer/release", json={"kv_transfer_params": {**handle, "remote_lease": "1" * 32}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_hold_not_found"
        assert metric_samples(http)[HELD] == len(handle["remote_block_ids"])
        r = http.post("/v1/kv_transfer/release", json={"kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        r = http.post("/v1/kv_transfer/release", json={"kv_transfer_params": handle})
        assert r.status_code == 200 and r.json() == {"released": True}
        after = metric_samples(http)
        assert after[HELD] == 0 and after[USAGE] == 0
        assert after[ABORTED_HOLDS] == before[ABORTED_HOLDS] + 1 and after[TIMEOUTS] == before[TIMEOUTS]
        r = http.post("/v1/kv_transfer/release", json={"kv_transfer_params": handle})
        assert r.status_code == 404 and "was released (aborted)" in r.json()["error"]["message"]


def _router(**kw) -> ServerThread:
    from goodserve.router.app import Router, build_router_app

    return ServerThread(build_router_app(Router(**kw)))


def test_c23_clients_leaving_during_the_prefill_hop_are_aborted_by_the_producer_at_once(producer, consumer):
    """C23: six clients send a 1,000-token prompt (the tiny model's context is 1,024) through the router and
    disconnect 0.3-1.5 s later, while the producer still prefills. They start 50 ms apart, so the producer
    prefills them in the order they leave (FCFS, one token a step): each has at most 0.3 s of prefill before
    its client leaves, less than its 1,000 steps take. The router closes each prefill hop, the producer aborts each
    request at once (no hold waits for its 30 s timeout), KV usage on both instances is 0 within a few
    seconds, and the producer counts six aborts and no timeout."""
    url = producer.base_url
    before = _metrics(url)

    async def client(base: str, i: int) -> None:
        await asyncio.sleep(0.05 * i)
        delay = 0.3 + 0.24 * i
        async with httpx.AsyncClient(timeout=httpx.Timeout(delay, connect=5)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(base + "/v1/completions", json={
                    "model": "tiny", "prompt": [2000 + 100 * i + j for j in range(1000)], "max_tokens": 8})

    async def clients(base: str) -> None:
        await asyncio.gather(*(client(base, i) for i in range(6)))

    with _router(prefill=[url], decode=[consumer.base_url]) as router:
        asyncio.run(clients(router.base_url))
        elapsed = _wait_for(url, lambda m: m[USAGE] == 0 and m[HELD] == 0 and
                            m[ABORTED_CALLS] - before.get(ABORTED_CALLS, 0) == 6, timeout=5)
    assert elapsed < 5
    after = _metrics(url)
    assert after[TIMEOUTS] == before[TIMEOUTS] and after[ABORTED_HOLDS] == before[ABORTED_HOLDS]
    _idle(url, consumer)


class _LeavesAfterThePrefillHop:
    """The router's view of a client that stays for the prefill hop and is gone when it ends."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # nothing arrives while the hop runs
        return {}

    async def is_disconnected(self) -> bool:
        return True


def test_client_gone_between_the_hops_frees_the_hold_at_once(producer):
    """C23, between the hops: no decode hop is sent and the router asks the producer to free the hold, which
    it does at once (an abort, not a timeout)."""
    from goodserve.router.app import Router
    from goodserve.router.disaggregated import forward_disaggregated
    from goodserve.router.policies import RouteRequest

    url = producer.base_url
    before = _metrics(url)
    router = Router(prefill=[url], decode=[f"http://127.0.0.1:{free_port()}"])

    async def go():
        await router.start()
        try:
            return await forward_disaggregated(router, "/v1/completions", BODY, RouteRequest.from_openai_body(BODY),
                                               _LeavesAfterThePrefillHop())
        finally:
            await router.close()

    response = asyncio.run(go())
    assert response.status_code == 499
    after = _metrics(url)
    assert after[HELD] == 0 and after[ABORTED_HOLDS] == before[ABORTED_HOLDS] + 1
    assert after[TIMEOUTS] == before[TIMEOUTS]
    releases = router.metrics.kv_releases.labels(url, "released")._value.get()
    assert releases == 1


def test_decode_instance_down_frees_the_hold_at_once(producer):
    """No decode instance answers: the client gets a 503 at once, and the hold is freed then, not at the
    producer's 30 s timeout."""
    url = producer.base_url
    before = _metrics(url)
    with _router(prefill=[url], decode=[f"http://127.0.0.1:{free_port()}"]) as router:
        r = httpx.post(router.base_url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 503
    after = _metrics(url)
    assert after[HELD] == 0 and after[USAGE] == 0
    assert after[ABORTED_HOLDS] == before[ABORTED_HOLDS] + 1 and after[TIMEOUTS] == before[TIMEOUTS]
