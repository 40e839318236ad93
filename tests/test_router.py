"""The router: policies and P/D request rewriting as pure functions (exact expectations), then the HTTP router
end to end in front of two real goodserve servers over the tiny random model."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from goodserve.router.policies import (BackendState, LeastLoaded, NoHealthyBackendError, PrefixAffinity,
                                       RoundRobin, RouteRequest, make_policy)
from goodserve.router.protocol import RouterRequestError, decode_request_body, prefill_request_body
from test_layering import SRC, imported_modules


def states(*tokens: int, **kw) -> list[BackendState]:
    return [BackendState(name=f"b{i}", outstanding_tokens=t, **kw) for i, t in enumerate(tokens)]


def req(n: int = 8, max_tokens: int = 4, start: int = 0) -> RouteRequest:
    ids = tuple(range(start, start + n))
    return RouteRequest(prompt_tokens=n, max_tokens=max_tokens, token_ids=ids)


# ------------------------------------------------------------------------------------------ layering
@pytest.mark.parametrize("module", ["policies.py", "protocol.py"])
def test_pure_router_modules_import_no_framework(module):
    names = imported_modules(SRC / "router" / module)
    bad = [n for n in names if n.split(".")[0] in ("torch", "fastapi", "httpx", "starlette", "uvicorn")
           or n.startswith(("goodserve.engine", "goodserve.server", "goodserve.runner"))]
    assert not bad, f"router/{module} must stay torch- and I/O-free (the simulator drives it): {bad}"


# ------------------------------------------------------------------------------------------ policies
def test_round_robin_order_skips_unhealthy_and_raises_when_none():
    b = states(0, 0, 0)
    rr = RoundRobin()
    assert [rr.select(b, req()) for _ in range(5)] == [0, 1, 2, 0, 1]
    b[2].healthy = False
    assert [rr.select(b, req()) for _ in range(3)] == [0, 1, 0]
    for s in b:
        s.healthy = False
    with pytest.raises(NoHealthyBackendError):
        rr.select(b, req())


def test_least_outstanding_tokens_and_tie_breaks():
    p = make_policy("least-outstanding-tokens")
    assert p.select(states(30, 10, 20), req()) == 1
    b = states(10, 10, 10)
    b[0].outstanding_requests, b[1].outstanding_requests, b[2].outstanding_requests = 3, 1, 1
    assert p.select(b, req()) == 1  # tie on tokens -> fewer requests -> lower index
    b[1].healthy = False
    assert p.select(b, req()) == 2
    with pytest.raises(NoHealthyBackendError):
        p.select([BackendState("x", healthy=False)], req())


def test_pd_pool_metrics():
    b = states(100, 5, 50)
    for s, q, kv in zip(b, (0, 40, 10), (0.9, 0.2, 0.2)):
        s.queued_prefill_tokens, s.kv_usage = q, kv
    assert LeastLoaded("queued_prefill_tokens").select(b, req()) == 0
    assert LeastLoaded("kv_usage").select(b, req()) == 1  # kv tie 0.2 -> fewer outstanding tokens
    with pytest.raises(ValueError, match="metric"):
        LeastLoaded("queue")


def test_backend_state_accounting_returns_to_zero():
    s, r = BackendState("a"), req(n=10, max_tokens=6)
    s.start(r)
    assert (s.outstanding_requests, s.outstanding_tokens, s.queued_prefill_tokens) == (1, 16, 10)
    s.prefilled(r)
    assert s.queued_prefill_tokens == 0
    s.finish(r, prefilled=True)
    s.start(r)
    s.finish(r, prefilled=False)
    assert (s.outstanding_requests, s.outstanding_tokens, s.queued_prefill_tokens) == (0, 0, 0)


def test_route_request_from_openai_bodies():
    r = RouteRequest.from_openai_body({"prompt": [5, 6, 7], "max_tokens": 9})
    assert (r.prompt_tokens, r.max_tokens, r.token_ids, r.text) == (3, 9, (5, 6, 7), None)
    r = RouteRequest.from_openai_body({"prompt": ["abcdefghi", "x"], "max_completion_tokens": 2, "max_tokens": 7})
    assert (r.prompt_tokens, r.max_tokens, r.text) == (3, 2, "abcdefghi")  # ceil(9 bytes / 4)
    msgs = [{"role": "user", "content": "hi"}]
    r = RouteRequest.from_openai_body({"messages": msgs, "max_tokens": None})
    assert r.text == json.dumps(msgs, sort_keys=True) and r.max_tokens == 256
    assert RouteRequest.from_openai_body({"prompt": {"bad": 1}}).prompt_tokens == 0


def test_prefix_hashes_chain_over_full_blocks():
    p = PrefixAffinity(block_size=4, block_bytes=8)
    a, b = p.block_hashes(req(n=11)), p.block_hashes(req(n=8))
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    c = p.block_hashes(RouteRequest(8, 1, token_ids=(0, 1, 2, 3, 4, 9, 6, 7)))
    assert c[0] == a[0] and c[1] != a[1]
    d = p.block_hashes(RouteRequest(8, 1, token_ids=(9, 1, 2, 3, 4, 5, 6, 7)))
    assert d[0] != a[0] and d[1] != a[1]  # chained: same second block, different prefix
    text = p.block_hashes(RouteRequest(4, 1, text="x" * 17))
    assert len(text) == 2 and not set(text) & set(a)


def test_prefix_affinity_keeps_shared_prefixes_on_one_backend():
    p, b = PrefixAffinity(block_size=4), states(0, 0)
    P, Q = tuple(range(100, 164)), tuple(range(500, 564))  # two 64-token prefixes (16 blocks each)
    chosen = []
    for i in range(6):
        r = RouteRequest.from_openai_body({"prompt": list((P, Q)[i % 2] + (i,) * 5), "max_tokens": 8})
        k = p.select(b, r)
        b[k].start(r)  # in flight: the other prefix would go to the less loaded backend without affinity
        chosen.append(k)
    assert chosen == [0, 1, 0, 1, 0, 1]
    # chat: a conversation that grows by a turn keeps its backend (its canonical JSON keeps the prefix)
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "hello"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hi!"}, {"role": "user", "content": "more"}]
    first = p.select(b, RouteRequest.from_openai_body({"messages": turn1}))
    b[first].outstanding_tokens += 300  # loaded, but within the bound: affinity still wins
    assert p.select(b, RouteRequest.from_openai_body({"messages": turn2})) == first


def test_prefix_affinity_longest_match_load_bound_and_unhealthy_holder():
    p = PrefixAffinity(block_size=4, balance_slack=0.5, balance_abs_tokens=10)
    b = states(0, 0, 0)
    shared = tuple(range(100, 132))  # 8 blocks shared by every request below
    assert p.select(b, RouteRequest(40, 4, token_ids=shared + (1,) * 8)) == 0  # nothing known: least loaded
    b[0].outstanding_tokens = 5
    assert p.select(b, RouteRequest(40, 4, token_ids=shared + (2,) * 8)) == 0  # shared prefix held by b0
    b[0].outstanding_tokens = 61  # over 1.5 * mean (61 / 3) + 10 = 40.5: b0 is overloaded
    assert p.select(b, RouteRequest(40, 4, token_ids=shared + (3,) * 8)) == 1  # fallback: least loaded
    b[0].outstanding_tokens = 40  # at the bound (1.5 * 40 / 3 + 10 = 30 < 40): still overloaded
    assert p.is_overloaded(b, 0) and not p.is_overloaded(b, 1)
    b[0].outstanding_tokens = 5
    # the longest match wins: shared+(3,)*8 was last served by b1, shared+(2,)*8 by b0
    assert p.select(b, RouteRequest(48, 4, token_ids=shared + (3,) * 8 + (7,) * 8)) == 1
    assert p.select(b, RouteRequest(48, 4, token_ids=shared + (2,) * 8 + (7,) * 8)) == 0
    b[0].healthy = False  # the holder is down: least loaded among the healthy (b2, then b1 by index)
    b[1].outstanding_tokens = 3
    assert p.select(b, RouteRequest(40, 4, token_ids=shared + (2,) * 8)) == 2


def test_prefix_affinity_memory_is_bounded_lru():
    p = PrefixAffinity(block_size=4, max_entries=3)
    b = states(0, 0)
    p.select(b, req(n=8, start=0))  # 2 hashes -> b0
    b[0].outstanding_tokens = 50
    p.select(b, req(n=8, start=1000))  # 2 more -> b1 (least loaded); the first request's first hash is evicted
    assert len(p._owner) == 3
    b[0].outstanding_tokens, b[1].outstanding_tokens = 1, 0
    # b0 would win by affinity (1 token is within the bound), but the chain's first block was evicted
    assert p.select(b, req(n=8, start=0)) == 1
    with pytest.raises(ValueError):
        PrefixAffinity(block_size=0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


# ------------------------------------------------------------------------------------ P/D rewriting
def test_pd_request_rewriting_exact():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}, "n": 1, "temperature": 0}
    original = json.loads(json.dumps(body))
    assert prefill_request_body(body) == {
        "model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 1,
        "temperature": 0, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
              "remote_engine_id": "e0", "remote_host": "127.0.0.1", "remote_port": 5600}
    prefill_answer = {"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": params}
    assert decode_request_body(body, prefill_answer) == {**original, "kv_transfer_params": params}
    assert body == original  # neither function changes the client's body
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert prefill_request_body(chat) == {**chat, "max_tokens": 1, "stream": False,
                                          "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    with pytest.raises(RouterRequestError) as e:
        prefill_request_body({"prompt": "hi", "n": 2})
    assert e.value.param == "n" and "n must be 1" in e.value.message
    with pytest.raises(LookupError, match="kv_transfer_params"):
        decode_request_body(body, {"id": "cmpl-1", "choices": []})
    with pytest.raises(LookupError):
        decode_request_body(body, {"kv_transfer_params": None})


def test_router_refuses_bad_backend_lists():
    from goodserve.router.app import Router

    for kw in ({}, {"replicas": ["http://a"], "prefill": ["http://b"], "decode": ["http://c"]},
               {"prefill": ["http://b"]}, {"decode": ["http://c"]}):
        with pytest.raises(ValueError, match="either replicas"):
            Router(**kw)
    with pytest.raises(ValueError, match="http://"):
        Router(replicas=["127.0.0.1:8000"])
    r = Router(prefill=["http://p/"], decode=["http://d1", "http://d2"])
    assert [(b.url, b.role) for b in r.backends] == [("http://p", "prefill"), ("http://d1", "decode"),
                                                      ("http://d2", "decode")]


# ------------------------------------------------------------------ HTTP: two real goodserve servers
MODEL = "tiny"


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """Two goodserve servers over the same tiny random model: ``[(ServerThread, AsyncEngine), ...]``."""
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
            eng = AsyncEngine(Engine(EngineArgs(model=model, dtype="float32", num_blocks=128, block_size=4,
                                                max_num_batched_tokens=64, max_model_len=256,
                                                log_stats_interval=0)))
            srv = ServerThread(build_app(eng, served_model_name=MODEL)).__enter__()
            out.append((srv, eng))
        yield out
    finally:
        for srv, eng in out:
            srv.__exit__(None, None, None)
            eng.shutdown()


def dead_url() -> str:
    from server_fixtures import free_port

    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def RouterServer(**router_kwargs):
    """The router app over a fresh :class:`Router` built from ``router_kwargs`` (see server_fixtures)."""
    from goodserve.router.app import Router
    from server_fixtures import RouterServer as Server

    return Server(Router(**router_kwargs))


def finished_count(url: str, endpoint: str) -> float:
    from server_fixtures import metric_samples

    with httpx.Client(base_url=url) as c:
        return metric_samples(c).get(("goodserve:api_requests_finished_total",
                                      frozenset({("endpoint", endpoint)})), 0.0)


def router_count(http: httpx.Client, name: str, **labels: str) -> float:
    from server_fixtures import metric_samples

    return sum(v for (n, lab), v in metric_samples(http).items()
               if n == name and all((k, val) in lab for k, val in labels.items()))


def sse_answer(response: httpx.Response, chat: bool) -> tuple[str, dict]:
    """Concatenated text and the usage of an SSE stream (which must end with ``[DONE]``)."""
    lines = [ln[len("data: "):] for ln in response.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    text = "".join((c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"]
                   for c in chunks if c["choices"])
    return text, [c["usage"] for c in chunks if c.get("usage")][-1]


def counts(usage: dict) -> tuple:
    """Token counts of a usage object (``cached_tokens`` differs by which replica saw the prompt before)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


CASES = [("/v1/completions", {"prompt": "The capital of France is"}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}]})]


@pytest.mark.parametrize("path, fields", CASES)
def test_outputs_through_router_equal_one_instance(backends, path, fields):
    chat = "chat" in path
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **fields}
    direct = httpx.post(backends[0][0].base_url + path, json=body, timeout=60).json()
    want_text = direct["choices"][0]["message"]["content"] if chat else direct["choices"][0]["text"]
    with RouterServer(replicas=[s.base_url for s, _ in backends]) as http:
        for _ in range(2):  # round-robin: once through each replica
            r = http.post(path, json=body)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
            got = r.json()
            assert (got["choices"][0]["message"]["content"] if chat else got["choices"][0]["text"]) == want_text
            assert counts(got["usage"]) == counts(direct["usage"])
            stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", path, json=stream_body) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                text, usage = sse_answer(s, chat)
            assert text == want_text and counts(usage) == counts(direct["usage"])
        # a backend's error comes back unchanged, status and body
        bad = {**body, "temperature": -1}
        want = httpx.post(backends[0][0].base_url + path, json=bad, timeout=60)
        r = http.post(path, json=bad)
        assert want.status_code == r.status_code == 400 and r.json() == want.json()


def test_round_robin_alternates_across_backends(backends):
    urls = [s.base_url for s, _ in backends]
    before = [finished_count(u, "/v1/completions") for u in urls]
    with RouterServer(replicas=urls, policy=RoundRobin()) as http:
        for i in range(4):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 2})
            assert r.status_code == 200
        assert [finished_count(u, "/v1/completions") - b for u, b in zip(urls, before)] == [2, 2]
        for u in urls:
            assert router_count(http, "goodserve:router_requests_total", backend=u, outcome="ok") == 2
            assert router_count(http, "goodserve:router_in_flight_requests", backend=u) == 0
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        bad = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_dead_backend_is_skipped_and_only_dead_backends_answer_503(backends):
    dead, live = dead_url(), backends[0][0].base_url
    with RouterServer(replicas=[dead, live], connect_timeout=0.5) as http:
        for _ in range(3):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
        h = http.get("/health")
        assert h.status_code == 200
        assert [(b["url"], b["healthy"]) for b in h.json()["backends"]] == [(dead, False), (live, True)]
        assert router_count(http, "goodserve:router_requests_total", backend=dead, outcome="connect_error") == 1
        assert router_count(http, "goodserve:router_requests_total", backend=live, outcome="ok") == 3
        assert router_count(http, "goodserve:router_backend_healthy", backend=dead) == 0
    with RouterServer(replicas=[dead_url(), dead_url()], connect_timeout=0.5) as http:
        for stream in (False, True):
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": stream})
            assert time.monotonic() - t0 < 2.0
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and err["code"] == 503 and err["param"] is None
            assert "healthy" in err["message"]
        assert http.get("/health").status_code == 503 and http.get("/v1/models").status_code == 503


def test_dead_backend_comes_back_after_a_probe(backends):
    """A backend marked down (as after a refused connection) is probed back into rotation."""
    live = backends[1][0].base_url
    rs = RouterServer(replicas=[live], health_interval=0.2)
    with rs as http:
        assert http.get("/health").status_code == 200
        rs.router.set_health(rs.router.backends[0], False, "test")
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 503
        deadline = time.monotonic() + 5
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the backend was not probed back"
            time.sleep(0.05)
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_no_healthy_replica_503_carries_retry_after():
    """Retry-After is the health interval rounded up (2.5 s -> 3), on completions and on /v1/models."""
    with RouterServer(replicas=[dead_url()], connect_timeout=0.5, health_interval=2.5) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert (r.status_code, r.headers.get("retry-after")) == (503, "3")
        assert r.json() == {"error": {"message": "none of the 1 backends is healthy",
                                      "type": "service_unavailable", "param": None, "code": 503}}
        m = http.get("/v1/models")
        assert (m.status_code, m.headers.get("retry-after")) == (503, "3")
        assert router_count(http, "goodserve:router_local_errors_total", reason="no_healthy_backend") == 1


def wait_health(http: httpx.Client, index: int, healthy: bool) -> None:
    """Wait (up to 5 s) until the router's ``/health`` shows backend ``index`` as ``healthy``."""
    deadline = time.monotonic() + 5
    while http.get("/health").json()["backends"][index]["healthy"] != healthy:
        assert time.monotonic() < deadline, f"backend {index} did not become healthy={healthy}"
        time.sleep(0.02)


def test_probes_log_at_debug_and_a_backend_going_down_warns_once(caplog):
    """httpx's INFO line per request ("HTTP Request: GET .../health") is silenced and the router's own probe
    lines are DEBUG, so healthy probes log nothing at INFO; a backend going down logs one WARNING, however
    many failed probes follow."""
    from server_fixtures import FakeBackend

    caplog.set_level(logging.INFO)
    fake = FakeBackend()
    try:
        with RouterServer(replicas=[fake.url], health_interval=0.05) as http:
            http.get("/health")  # starts the prober
            deadline = time.monotonic() + 5
            while fake.probes < 4:
                assert time.monotonic() < deadline, "the router did not probe"
                time.sleep(0.02)
            ours = ("httpx", "httpcore", "goodserve")
            assert [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ours] == []
            fake.close()
            wait_health(http, 0, False)
            time.sleep(0.3)  # six more failed probes
        logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.split(".")[0] in ours]
        # refused, or (a probe caught by the shutdown) accepted and dropped
        assert logged in [[("WARNING", f"backend {fake.url} (replica) is down: /health failed: {e}")]
                          for e in ("ConnectError", "ReadError", "RemoteProtocolError")], logged
    finally:
        fake.close()


def test_client_disconnect_mid_stream_aborts_upstream_and_frees_blocks(backends):
    from server_fixtures import metric_samples, slow_steps, wait_idle

    srv, eng = backends[0]

    def aborted() -> float:
        with httpx.Client(base_url=srv.base_url) as c:
            return sum(v for (n, lab), v in metric_samples(c).items()
                       if n == "goodserve:api_requests_aborted_total")

    before = aborted()
    restore = slow_steps(eng, 0.05)
    try:
        with RouterServer(replicas=[srv.base_url]) as http:
            body = {"model": MODEL, "prompt": list(range(10, 30)), "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as s:
                assert s.status_code == 200
                next(s.iter_lines())  # the first event arrived: the request is decoding
            # leaving the block closed the client's connection to the router
            deadline = time.monotonic() + 10
            while aborted() != before + 1:
                assert time.monotonic() < deadline, "the backend did not abort the request"
                time.sleep(0.02)
            assert router_count(http, "goodserve:router_requests_total", backend=srv.base_url, outcome="aborted") == 1
            assert router_count(http, "goodserve:router_in_flight_requests", backend=srv.base_url) == 0
    finally:
        restore()
    wait_idle(eng)


def test_pd_mode_passes_the_prefill_instances_error_through(backends):
    """P/D in front of instances started without ``--kv-role``: the prefill instance refuses the first hop
    (400 naming ``kv_transfer_params``) and the router hands that error to the client unchanged; n > 1 is
    refused before any hop. (The whole hand-off through the router is in test_kv_transfer.py.)"""
    (p, _), (d, _) = backends
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    direct = httpx.post(p.base_url + "/v1/completions", json=prefill_request_body(body), timeout=60)
    assert direct.status_code == 400 and direct.json()["error"]["param"] == "kv_transfer_params"
    with RouterServer(prefill=[p.base_url], decode=[d.base_url]) as http:
        r = http.post("/v1/completions", json=body)
        assert (r.status_code, r.json()) == (direct.status_code, direct.json())
        r = http.post("/v1/completions", json={**body, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_pd_without_a_healthy_decode_answers_503_before_any_prefill_hop():
    """With the decode pool down the router sends the producer nothing (no hold waits for a consumer): 503 at
    once, Retry-After at least 1 s, counted as no_healthy_decode. With the prefill pool down: the same 503."""
    from server_fixtures import FakeBackend

    producer, consumer = FakeBackend(), FakeBackend()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        with RouterServer(prefill=[producer.url], decode=[dead_url()], health_interval=0.2) as http:
            wait_health(http, 1, False)  # the first /health starts the prober, which finds the decode down
            for stream in (False, True):
                r = http.post("/v1/completions", json={**body, "stream": stream})
                assert (r.status_code, r.headers.get("retry-after")) == (503, "1")
                assert r.json() == {"error": {"message": "no decode instance is healthy (0 of 1); the request was "
                                              "not sent to a prefill instance", "type": "service_unavailable",
                                              "param": None, "code": 503}}
            assert producer.posts == 0 and producer.probes > 0
            assert router_count(http, "goodserve:router_local_errors_total", status_code="503",
                                reason="no_healthy_decode") == 2
        with RouterServer(prefill=[dead_url()], decode=[consumer.url], health_interval=1.0) as http:
            r = http.post("/v1/completions", json=body)
            assert (r.status_code, r.headers.get("retry-after")) == (503, "1")
            assert r.json()["error"] == {"message": "none of the 1 backends is healthy",
                                         "type": "service_unavailable", "param": None, "code": 503}
            assert consumer.posts == 0
    finally:
        producer.close()
        consumer.close()


class DroppingBackend:
    """A TCP server on 127.0.0.1 that reads a request's first bytes and closes the connection unanswered (an
    instance killed after the request was sent, before any byte of the answer)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.recv(65536)
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_backend_lost_before_any_byte_is_retried_once_elsewhere_then_503(backends):
    """Round-robin over [dropping, live]: the request the dropping backend loses (sent, never answered) is
    retried on the live one and succeeds, streamed or not; the dropping backend is taken out. With only
    dropping backends the client gets a 503 naming the lost backend after one retry."""
    live = backends[0][0].base_url
    drop, drop2 = DroppingBackend(), DroppingBackend()
    try:
        for stream in (False, True):
            with RouterServer(replicas=[drop.url, live], health_interval=60) as http:
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                       "stream": stream})
                assert r.status_code == 200, r.text
                assert router_count(http, "goodserve:router_requests_total", backend=drop.url,
                                    outcome="backend_error") == 1
                assert router_count(http, "goodserve:router_requests_total", backend=live, outcome="ok") == 1
                assert [b["healthy"] for b in http.get("/health").json()["backends"]] == [False, True]
        with RouterServer(replicas=[drop.url, drop2.url], health_interval=60) as http:
            before = drop.accepted + drop2.accepted
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and "was lost before answering" in err["message"]
            assert drop.accepted + drop2.accepted - before == 2  # the request and its one retry
    finally:
        drop.close()
        drop2.close()
