"""One bad request never stops the engine (C19), and the server tells the truth about its health.

Faults are injected at every place one request's processing can raise: invalid Unicode in every text field,
a tokenizer that raises an arbitrary exception type, a detokenizer and a sampler row that raise mid-batch,
clients that disconnect at each point of a request's life, and an engine step that raises (the loop dies:
every in-flight request gets an error at once and ``/health`` turns 503). A tiny random model keeps it fast.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import httpx
import pytest

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine, EngineDeadError, InjectedStepFault
from goodserve.engine.engine import Engine
from goodserve.runner import sampler as sampler_mod
from goodserve.sampling_params import SamplingParams
from goodserve.server.app import build_app
from server_fixtures import ServerThread, metric_samples, slow_steps, wait_idle
from tiny_models import make_tiny_hf_model

MODEL = "tiny"
BAD = "ok \ud800 not"  # a lone surrogate: valid JSON ("\ud800"), not valid Unicode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def _args(model: str, **kw) -> EngineArgs:
    base = dict(model=model, dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=64,
                max_model_len=256, log_stats_interval=0)
    base.update(kw)
    return EngineArgs(**base)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = AsyncEngine(Engine(_args(tiny_model)))
    yield eng
    eng.shutdown()


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON with lone surrogates written as ``\\udXXX`` escapes (as any JSON encoder does)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def api_count(http: httpx.Client, kind: str, **labels: str) -> float:
    """Sum of ``goodserve:api_requests_<kind>_total`` over samples matching ``labels``."""
    name = f"goodserve:api_requests_{kind}_total"
    return sum(v for (n, lab), v in metric_samples(http).items()
               if n == name and all((k, val) in lab for k, val in labels.items()))


def assert_healthy_and_idle(http: httpx.Client, engine: AsyncEngine, timeout: float = 20.0) -> None:
    """The engine serves (a normal request completes), then drains: nothing waiting, no KV block in use."""
    assert http.get("/health").status_code == 200
    r = post(http, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    wait_idle(engine, timeout)


# ------------------------------------------------------------------------------------ C19: bad text
TEXT_FIELDS = [
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", BAD]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "fine", "stop": BAD}, "stop"),
    ("/v1/completions", {"prompt": "fine", "stop": ["x", BAD]}, "stop[1]"),
    ("/v1/completions", {"prompt": "fine", "stream": True}, None),  # the control: a normal streamed request
    ("/v1/completions", {"prompt": BAD, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": "fine", "user": BAD}, "user"),
    ("/v1/completions", {"prompt": "fine", "cache_salt": BAD}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": BAD, "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [BAD], "stream": True},
     "stop[0]"),
    ("/tokenize", {"prompt": BAD}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
]


@pytest.mark.parametrize("path,fields,param", TEXT_FIELDS)
def test_invalid_unicode_is_a_400_in_every_text_field_C19(http, engine, path, fields, param):
    """C19: a lone surrogate in any text field is a prompt 400 naming the field; the engine serves on."""
    before = api_count(http, "failed", status_code="400", reason="invalid_unicode")
    body = {"model": MODEL, "max_tokens": 3, **fields}
    r = post(http, path, body)
    if param is None:
        assert r.status_code == 200
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == "invalid_unicode" and err["param"] == param
        assert "not valid Unicode" in err["message"] and "U+D800" in err["message"]
        assert api_count(http, "failed", status_code="400", reason="invalid_unicode") == before + 1
    assert_healthy_and_idle(http, engine)


def test_lone_surrogate_prompt_then_normal_request_C19(http, engine):
    """The case as filed: ``"prompt": "\\ud800"``, then a normal request succeeds and /health stays 200."""
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\\ud800"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert_healthy_and_idle(http, engine)


def test_engine_and_offline_api_refuse_invalid_unicode_C19(engine):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        engine.call(lambda e: e.add_request("\udfff"))
    with pytest.raises(ValueError, match=r"stop\[0\] is not valid Unicode"):
        SamplingParams(stop=["\ud800"])
    assert engine.call(lambda e: e.has_unfinished_requests()) is False


def test_malformed_json_is_a_400_without_a_character_position(http, engine):
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and err["param"] is None and "not valid JSON" in err["message"]
    r = http.post("/v1/completions", content=b'\xff\xfe{"prompt": 1}', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert_healthy_and_idle(http, engine)


# --------------------------------------------------------------------- one request's processing raises
class _FaultyTokenizer:
    """Delegates to a real tokenizer, but ``encode`` raises ``KeyError`` (not a ValueError) on one text."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def encode(self, text, *args, **kwargs):
        if "TRIGGER" in text:
            raise KeyError("a tokenizer bug")
        return self._real.encode(text, *args, **kwargs)


def test_tokenizer_raising_any_exception_fails_that_request_alone(http, engine):
    real = engine.engine.tokenizer
    engine.call(lambda e: setattr(e, "tokenizer", _FaultyTokenizer(real)))
    try:
        before = api_count(http, "failed", status_code="500")
        for stream in (False, True):
            r = post(http, "/v1/completions", {"model": MODEL, "prompt": "TRIGGER", "stream": stream})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "InternalServerError" and "KeyError" in err["message"]
        assert api_count(http, "failed", status_code="500") == before + 2
        assert_healthy_and_idle(http, engine)
    finally:
        engine.call(lambda e: setattr(e, "tokenizer", real))


def _solo(http: httpx.Client, prompt: list[int], n: int = 8) -> list[int]:
    r = post(http, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                       "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


NEIGHBOURS = [[100, 200, 300], [7, 8, 9, 10, 11], [4000, 12, 5]]


def _concurrently(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
            return await asyncio.gather(*(c.post(p, json=b) for p, b in bodies))
    return asyncio.run(run())


def test_detokenizer_fault_fails_one_request_not_its_batch(http, engine, server, monkeypatch):
    """A detokenizer that raises mid-generation fails its request (500, or an error event when streamed);
    requests in the same batches produce exactly the tokens they produce alone."""
    from goodserve.engine import output_processor as engine_mod

    alone = [_solo(http, p) for p in NEIGHBOURS]
    real = engine_mod.IncrementalDetokenizer

    class Faulty(real):
        def __init__(self, tokenizer, prompt_token_ids, *args, **kwargs):
            super().__init__(tokenizer, prompt_token_ids, *args, **kwargs)
            self._faulty, self._n = prompt_token_ids[0] == 4242, 0

        def add_token(self, token_id, check_stop=True):
            self._n += 1
            if self._faulty and self._n == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().add_token(token_id, check_stop)

    monkeypatch.setattr(engine_mod, "IncrementalDetokenizer", Faulty)
    common = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    bodies = [("/v1/completions", {**common, "prompt": p, "logprobs": 0}) for p in NEIGHBOURS]
    bodies += [("/v1/completions", {**common, "prompt": [4242, 1, 2]}),
               ("/v1/completions", {**common, "prompt": [4242, 3, 4], "stream": True})]
    rs = _concurrently(server.base_url, bodies)
    assert [r.json()["choices"][0]["text"] for r in rs[:3]] == alone
    assert rs[3].status_code == 500 and "UnicodeDecodeError" in rs[3].json()["error"]["message"]
    events = [line[6:] for line in rs[4].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "InternalServerError"
    assert_healthy_and_idle(http, engine)


def test_sampler_row_fault_fails_one_request_not_its_batch(http, engine, server, monkeypatch):
    """One row whose sampling raises (say a logit processor): the batch is resampled row by row, so its
    neighbours get the same greedy tokens as alone and only that request fails."""
    alone = [_solo(http, p) for p in NEIGHBOURS]
    real = sampler_mod.SamplingMetadata.from_requests.__func__

    def faulty(cls, rows, *args, **kwargs):
        if any(r.params.seed == 666 for r in rows):
            raise RuntimeError("a logit processor failed")
        return real(cls, rows, *args, **kwargs)

    monkeypatch.setattr(sampler_mod.SamplingMetadata, "from_requests", classmethod(faulty))
    common = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    bodies = [("/v1/completions", {**common, "prompt": p, "logprobs": 0}) for p in NEIGHBOURS]
    bodies.append(("/v1/completions", {**common, "prompt": [5, 6], "temperature": 1.0, "seed": 666}))
    rs = _concurrently(server.base_url, bodies)
    assert [r.json()["choices"][0]["text"] for r in rs[:3]] == alone
    assert rs[3].status_code == 500 and "a logit processor failed" in rs[3].json()["error"]["message"]
    assert_healthy_and_idle(http, engine)


# ------------------------------------------------------------------------ disconnects at every point
def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


POINTS = ["while_engine_accepts", "while_queued", "mid_prefill", "mid_decode"]


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so the test decides exactly when the client goes away)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("point", POINTS)
def test_client_disconnect_at_each_point_aborts_and_frees(http, engine, server, point, stream):
    """A client that leaves at any point of its request's life: the request is aborted, its blocks are freed,
    and the call counts once as aborted."""
    endpoint = "/v1/completions"
    before = api_count(http, "aborted", endpoint=endpoint)
    release = threading.Event()
    restore = None
    if point == "while_engine_accepts":  # the engine thread is busy: the add command waits in its queue
        threading.Thread(target=lambda: engine.call(lambda e: release.wait(10)), daemon=True).start()
        _wait(lambda: not engine._engine_thread._commands)
    elif point == "while_queued":
        engine.pause()
    else:
        restore = slow_steps(engine, 0.05)
    prompt = list(range(10, 10 + (150 if point == "mid_prefill" else 6)))  # 150 tokens: 3 chunks of 64
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": stream,
            "cache_salt": f"{point}-{stream}"}  # no prefix-cache hit from an earlier case
    sock = _raw_post(server.port, endpoint, body)
    try:
        if point == "while_engine_accepts":
            _wait(lambda: len(engine._engine_thread._commands) > 0)
        elif point == "while_queued":
            _wait(lambda: engine.stats.num_waiting == 1)
        elif point == "mid_prefill":
            _wait(lambda: engine.stats.num_running == 1)
            assert engine.stats.num_tokens_waiting > 0  # still prefilling
        else:
            _wait(lambda: engine.stats.num_running == 1 and engine.stats.num_tokens_waiting == 0)
    finally:
        sock.close()  # the client goes away
        release.set()
        engine.resume()
    _wait(lambda: api_count(http, "aborted", endpoint=endpoint) == before + 1)
    if restore is not None:
        restore()
    assert_healthy_and_idle(http, engine)


# ---------------------------------------------------------------------------------- engine death
def test_a_command_that_kills_the_loop_never_leaves_a_caller_hanging(tiny_model):
    """The loop dies while applying a batch of commands: every command of that batch still gets an answer."""
    deaths = []
    eng = AsyncEngine(Engine(_args(tiny_model)), on_dead=deaths.append)
    try:
        gate = threading.Event()
        threading.Thread(target=lambda: eng.call(lambda e: gate.wait(10)), daemon=True).start()
        _wait(lambda: not eng._engine_thread._commands)
        eng.engine.abort = lambda ids: (_ for _ in ()).throw(RuntimeError("abort bug"))
        eng.abort("nobody")  # queued behind the busy call, with the add below

        async def add():
            task = asyncio.create_task(eng.add_request("Hello", SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.wait_for(task, 10)

        with pytest.raises(EngineDeadError, match="abort bug"):
            asyncio.run(add())
        _wait(lambda: len(deaths) == 1)
        assert not eng.is_healthy() and isinstance(eng.error, RuntimeError)
    finally:
        eng.shutdown()


def test_step_fault_errors_every_in_flight_request_at_once(tiny_model):
    """An engine step raises: every in-flight request gets a 503 at once, /health is 503, on_dead fires."""
    deaths = []
    eng = AsyncEngine(Engine(_args(tiny_model)), on_dead=deaths.append, inject_step_fault=20)
    with ServerThread(build_app(eng, served_model_name=MODEL)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "ignore_eos": True}
        t0 = time.monotonic()
        rs = _concurrently(srv.base_url, [("/v1/completions", {**body, "stream": i % 2 == 1}) for i in range(4)])
        assert time.monotonic() - t0 < 10
        for i, r in enumerate(rs):
            if i % 2 == 0:
                assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
            else:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert json.loads(events[-2])["error"]["type"] == "ServiceUnavailableError" and events[-1] == "[DONE]"
        assert c.get("/health").status_code == 503
        assert c.post("/v1/completions", json=body).status_code == 503
        assert len(deaths) == 1 and isinstance(deaths[0], InjectedStepFault)
        assert api_count(c, "failed", status_code="503") == 5
    eng.shutdown()


# ------------------------------------------------------------------------------- review: edge cases
def test_tiny_temperature_is_greedy_with_finite_logprobs_C14(http, engine):
    """C14: temperature 1e-40 (the API allows it) samples like temperature 0; no NaN reaches a logprob, and
    it is never a 4xx."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    greedy = post(http, "/v1/completions", {**body, "temperature": 0})
    for logprobs in (None, 1):
        r = post(http, "/v1/completions", {**body, "temperature": 1e-40, "logprobs": logprobs})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == greedy.json()["choices"][0]["text"]
        if logprobs:
            assert all(math.isfinite(v) for v in choice["logprobs"]["token_logprobs"])
    assert_healthy_and_idle(http, engine)


def test_only_api_calls_are_counted(http):
    before = {k: api_count(http, k) for k in ("finished", "aborted", "rejected", "failed")}
    assert http.get("/nope").status_code == 404
    assert http.post("/health").status_code == 405
    assert http.get("/v1/models").status_code == 200
    assert {k: api_count(http, k) for k in before} == before


def test_wrong_content_type_bad_utf8_and_empty_messages_are_clear_400s(http):
    r = http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(http, "/tokenize", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(http, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.0, "n": 1.0})
    assert r.status_code == 200  # 2.0 is an integer (JSON Schema); 2.5 and "2" are not
    assert post(http, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}).status_code == 400


def test_shutdown_timeout_must_be_finite():
    from goodserve.cli import build_parser

    for value in ("inf", "nan", "0"):
        args = build_parser().parse_args(["serve", "--shutdown-timeout", value])
        with pytest.raises(ValueError, match="shutdown-timeout"):
            args.func(args)


# ------------------------------------------------------------------- issue #11: hammered with bad inputs
_BAD_INPUTS = [
    ("/v1/completions", {"prompt": "def f(", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokenz": 3}, "max_tokenz"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi " * 300}, None),
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema",
                                                            "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}, "audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
]


def test_bad_inputs_hammered_concurrently_leave_normal_requests_unaffected(server, http, engine):
    """Issue #11: every bad input of the issue, sent many times concurrently with normal requests (some of
    them constrained, biased or at a tiny temperature), gets its 400 naming the field; the normal requests
    get exactly what they get alone; the engine stays healthy and no KV block leaks."""
    normal = [{"model": MODEL, "prompt": f"Request {i} says", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
              for i in range(8)]
    unusual = [{"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 1e-40, "logprobs": 3},
               {"model": MODEL, "prompt": "y", "max_tokens": 4, "logit_bias": {"42": 100}, "temperature": 1.0},
               {"model": MODEL, "prompt": "z", "max_tokens": 200, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "boolean"}}}}]

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            async def call(path, body, raw=None, content_type="application/json"):
                content = raw if raw is not None else json.dumps(body)
                return await c.post(path, content=content, headers={"content-type": content_type})

            alone = [(await call("/v1/completions", b)).json()["choices"][0]["text"] for b in normal]
            jobs = []
            for round_ in range(3):
                jobs += [call("/v1/completions", b) for b in normal]
                jobs += [call("/v1/completions", b) for b in unusual]
                jobs += [call(path, {"model": MODEL, "max_tokens": 2, "stream": bool(round_ % 2), **body})
                         for path, body, _ in _BAD_INPUTS]
                jobs += [call("/v1/completions", None, raw=b'{"prompt": '),
                         call("/v1/completions", None, raw=b'{"prompt": "hi"}', content_type="text/plain")]
            return alone, await asyncio.gather(*jobs)

    alone, results = asyncio.run(main())
    per_round = len(normal) + len(unusual) + len(_BAD_INPUTS) + 2
    for r in range(3):
        got = results[r * per_round:(r + 1) * per_round]
        assert [g.json()["choices"][0]["text"] for g in got[:len(normal)]] == alone
        ok = got[len(normal):len(normal) + len(unusual)]
        assert all(g.status_code == 200 for g in ok), [g.text for g in ok]
        assert json.loads(ok[2].json()["choices"][0]["text"]) in (True, False)
        assert set(ok[1].json()["choices"][0]["text"]) <= set(engine.tokenizer.decode([42]))
        bad = got[len(normal) + len(unusual):]
        for g, (_, _, param) in zip(bad, _BAD_INPUTS):
            assert g.status_code == 400, g.text
            err = g.json()["error"]
            assert err["param"] == param, err
        assert bad[-2].status_code == 400 and bad[-2].json()["error"]["code"] == "invalid_json"
        assert bad[-1].status_code == 415
    assert_healthy_and_idle(http, engine)
