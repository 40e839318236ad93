"""The router: policies and P/D request rewriting as pure functions (exact expectations), then the HTTP router
end to end in front of two real goodserve servers over the tiny random model."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

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
