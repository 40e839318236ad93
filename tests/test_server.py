"""The OpenAI-compatible server, end to end: the real ``openai`` client (and raw ``httpx`` where the wire
format matters) against uvicorn in a thread, over the default model (SmolLM2-135M) on CPU.

Cases: C05/C06 (stop strings), C07 (max_tokens null), C08 (include_usage), C09 (errors before the stream),
C10 (UTF-8 deltas), C12 (abort on disconnect). See /work/shared/cases/CASES.md.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine
from goodserve.engine.engine import Engine
from goodserve.request_options import RequestOptions
from goodserve.scheduler.output import SchedulerStats
from goodserve.server.app import build_app
from goodserve.server.slo_classes import parse_slo_classes
from server_fixtures import ServerThread, metric_samples, wait_idle

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
MODEL = "smol"


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(Engine(EngineArgs(dtype="float32", num_blocks=256, max_num_batched_tokens=256,
                                        max_model_len=MAX_MODEL_LEN, log_stats_interval=0)))
    yield eng
    eng.shutdown()


def sse_events(lines) -> list:
    """Parse ``data:`` lines; ``[DONE]`` is kept as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------------------------------- basics
def test_models_health_tokenize(client, http, engine):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").status_code == 200
    tok = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat_tok = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > 2
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8 and full.usage.prompt_tokens > 0
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert text == full.choices[0].text and "Paris" in text


def test_stop_string_C05(client):
    """C05: stop=["Pari"] (not a token boundary) -> output before it, finish_reason "stop"."""
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["Pari"])
    out = client.completions.create(**kw).choices[0]
    assert "Pari" not in out.text and out.finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == out.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop_C06(client):
    """C06: chat "count from 1 to 10" with stop=["7"] ends before "7"."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count from 1 to 10, comma separated"}],
        temperature=0, max_tokens=40, stop=["7"])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert "7" not in choice.message.content and "6" in choice.message.content


def test_chat_stream_include_usage_C08(http, client):
    """C08: content chunks carry usage null; exactly one chunk with choices [] and the usage; then [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1]["choices"] == []
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    assert "cached_tokens" in usage["prompt_tokens_details"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    full = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=6, temperature=0)
    assert content == full.choices[0].message.content


def test_max_tokens_null_C07(http, engine):
    """C07: max_tokens null runs until EOS or the context limit (HTTP 200)."""
    prompt = list(engine.tokenizer.encode("one two three four " * 200))[:MAX_MODEL_LEN - 12]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": None,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN and body["usage"]["completion_tokens"] == 12


def test_prompt_cache_reports_cached_tokens(client):
    prompt = "You are a helpful assistant who answers in one word. " * 4 + "Question: what colour is the sky?"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("stream", [False, True])
def test_over_long_prompt_400_C09(http, client, stream):
    """C09: a prompt over the context is a 400 with an OpenAI error body, before any stream opens."""
    body = {"model": MODEL, "prompt": "hello " * (MAX_MODEL_LEN + 10), "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"] and err["type"]
    with pytest.raises(openai.BadRequestError, match="maximum context length is"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}],
                                       stream=stream)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0),
                                         ("prompt", ""), ("prompt", []), ("temperature", "hot"),
                                         ("max_tokens", 0), ("stop", [""]), ("top_k", -5)])
def test_invalid_params_400(http, field, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value}
    for stream in (False, True):
        r = http.post("/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_bad_requests_keep_serving(http, client):
    assert http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
                     ).status_code == 400
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]}).status_code == 400
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}).status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    r = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "Hi", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/nothing").status_code == 404
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------------- features, UTF-8
def test_cjk_emoji_stream_equals_non_stream_C10(client):
    """C10: every delta is valid text without U+FFFD; the deltas concatenate to the non-streaming text."""
    for prompt in ("请用中文写一首关于春天的短诗：", "🎉🎂🎈 Party time! Reply with only emoji: "):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, seed=1234)
        full = client.completions.create(**kw).choices[0].text
        deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == full


def test_n_seed_logprobs_echo(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0)
    multi = client.completions.create(n=2, seed=7, **kw)
    assert sorted(c.index for c in multi.choices) == [0, 1] and multi.usage.completion_tokens == 10
    single = client.completions.create(seed=7, **kw)
    assert single.choices[0].text == multi.choices[0].text  # choice i uses seed + i
    batch = client.completions.create(model=MODEL, prompt=["Once upon a time", "The capital of France is"],
                                      max_tokens=2, temperature=0)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1]
    assert batch.usage.completion_tokens == 4
    lp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0,
                                   logprobs=2, echo=True).choices[0]
    assert lp.text.startswith("Once upon a time")
    prompt_len = multi.usage.prompt_tokens
    assert len(lp.logprobs.tokens) == len(lp.logprobs.token_logprobs) == prompt_len + 3  # echo: prompt first
    assert lp.logprobs.token_logprobs[0] is None and lp.logprobs.top_logprobs[0] is None
    assert all(len(t) <= 2 for t in lp.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    assert len(chat.choices[0].logprobs.content) == 3
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, temperature=0, n=2, stream=True))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        assert text == chat.choices[i].message.content


# ----------------------------------------------------------------------------------- disconnects
def test_disconnect_aborts_and_frees_C12(server, http, engine):
    """C12: disconnect after the first chunk aborts within about a step; the same request then runs."""
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    before = metric_samples(http)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    closed = time.monotonic()
    deadline = closed + 10
    while engine.stats.num_running or engine.stats.num_waiting:
        assert time.monotonic() < deadline, "request was not aborted"
        time.sleep(0.02)
    wait_idle(engine)
    after = metric_samples(http)
    key = ("goodserve:request_success_total", frozenset({("finished_reason", "abort")}))
    assert after[key] == before[key] + 1
    generated = after[("goodserve:generation_tokens_total", frozenset())] - \
        before[("goodserve:generation_tokens_total", frozenset())]
    assert generated < 48
    again = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert again["choices"][0]["finish_reason"] == "length" and again["usage"]["completion_tokens"] == 48
    wait_idle(engine)


ABORTED = ("goodserve:request_success_total", frozenset({("finished_reason", "abort")}))


def test_non_streaming_disconnect_aborts(server, http, engine):
    body = {"model": MODEL, "prompt": "Tell me everything about the ocean.", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    before = metric_samples(http)[ABORTED]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    wait_idle(engine, timeout=10)
    assert metric_samples(http)[ABORTED] == before + 1


def test_32_concurrent_streams_half_disconnect(server, http, engine):
    """32 streaming clients share the batch; 16 leave midway; the rest match their greedy text; KV back to 0."""
    prompts = [f"Fact number {i}: the most interesting animal is" for i in range(32)]
    kw = {"model": MODEL, "max_tokens": 8, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            async def reference(p):
                r = await c.post("/v1/completions", json={**kw, "prompt": p})
                return r.json()["choices"][0]["text"]

            async def stream(i, p):
                text, n = "", 0
                async with c.stream("POST", "/v1/completions", json={**kw, "prompt": p, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line.endswith("[DONE]"):
                            continue
                        text += json.loads(line[6:])["choices"][0]["text"]
                        n += 1
                        if i % 2 and n == 2:
                            return None  # disconnect midway
                return text

            refs = await asyncio.gather(*(reference(p) for p in prompts[::2]))
            got = await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)))
            return refs, got

    before = metric_samples(http)[ABORTED]
    refs, got = asyncio.run(main())
    assert got[::2] == refs
    assert all(g is None for g in got[1::2])
    wait_idle(engine)
    assert metric_samples(http)[ABORTED] - before >= 8  # most leavers were aborted before their 8th token


# ------------------------------------------------------------------------------------------- metrics
def test_metrics_match_traffic(http, client, engine):
    wait_idle(engine)
    before = metric_samples(http)
    r1 = client.completions.create(model=MODEL, prompt="The capital of Italy is", max_tokens=4, temperature=0)
    r2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count from 1 to 10"}],
                                        max_tokens=30, temperature=0, stop=["3"])
    after = metric_samples(http)

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("goodserve:request_success_total", finished_reason="length") == 1
    assert delta("goodserve:request_success_total", finished_reason="stop") == 1
    assert delta("goodserve:prompt_tokens_total") == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert delta("goodserve:generation_tokens_total") == r1.usage.completion_tokens + r2.usage.completion_tokens
    assert delta("goodserve:time_to_first_token_seconds_count") == 2
    assert delta("goodserve:e2e_request_latency_seconds_count") == 2
    assert delta("goodserve:request_generation_tokens_sum") == r1.usage.completion_tokens + r2.usage.completion_tokens
    assert delta("goodserve:inter_token_latency_seconds_count") == \
        r1.usage.completion_tokens + r2.usage.completion_tokens - 2
    for name in ("goodserve:num_requests_running", "goodserve:num_requests_waiting", "goodserve:kv_cache_usage_perc",
                 "goodserve:num_tokens_waiting", "goodserve:num_preemptions_total",
                 "goodserve:prefix_cache_queries_total", "goodserve:prefix_cache_hits_total",
                 "goodserve:request_queue_time_seconds_count", "goodserve:request_prefill_time_seconds_count",
                 "goodserve:request_decode_time_seconds_count", "goodserve:request_prompt_tokens_count",
                 "goodserve:request_time_per_output_token_seconds_count", "goodserve:num_requests_shed_total",
                 "goodserve:num_deferred_decodes_total", "goodserve:step_time_predicted_seconds_total",
                 "goodserve:step_time_actual_seconds_total", "goodserve:step_time_margin"):
        assert (name, frozenset()) in after, name
    # No SLO set on this server: the default class's series exists and counts nothing.
    assert delta("goodserve:request_slo_attained_total", slo_class="default") == 0
    assert after[("goodserve:steps_observed_total", frozenset())] > before[("goodserve:steps_observed_total", frozenset())]
    assert after[("goodserve:kv_cache_usage_perc", frozenset())] == 0.0
    assert after[("goodserve:step_time_margin", frozenset())] >= 1.0


def test_grafana_dashboard_uses_served_metrics(http):
    """Every ``goodserve:`` series the dashboard queries is exported by /metrics."""
    path = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "goodserve.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"goodserve:[a-z0-9_]+", e)}
    exported = {name for name, _ in metric_samples(http)}
    assert used and used <= exported, used - exported


def test_waiting_queue_full_429_and_slo(engine, client):
    """429 with Retry-After while the waiting queue is full; admitted requests are unaffected."""
    app = build_app(engine, served_model_name=MODEL, max_waiting_requests=1,
                    slo_classes=parse_slo_classes(["relaxed:600000:600000", "tight:1:-"]))
    with ServerThread(app) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        engine.pause()
        result = {}
        try:
            t = threading.Thread(target=lambda: result.setdefault(
                "r", c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                          extra_body={"slo_class": "relaxed"})))
            t.start()
            deadline = time.monotonic() + 10
            while engine.num_waiting_total() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for stream in (False, True):
                r = httpx.post(srv.base_url + "/v1/completions",
                               json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": stream})
                assert r.status_code == 429 and r.headers["retry-after"]
                assert r.json()["error"]["type"] == "RateLimitError"
        finally:
            engine.resume()
        t.join(60)
        assert result["r"].choices[0].finish_reason == "length"
        # A TTFT SLO of 1 ms is missed; the per-request field overrides its class's TTFT.
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"slo_class": "tight"})
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                             extra_body={"slo_class": "tight", "slo_ttft_ms": 600000})
        c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"slo_ttft_ms": 600000})
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"slo_class": "nope"})
        assert e.value.body["param"] == "slo_class" and "relaxed, tight" in e.value.body["message"]
        m = metric_samples(httpx.Client(base_url=srv.base_url))
        assert m[("goodserve:request_slo_attained_total", frozenset({("slo_class", "relaxed")}))] == 1
        assert m[("goodserve:request_slo_missed_total", frozenset({("slo_class", "relaxed")}))] == 0
        assert m[("goodserve:request_slo_missed_total", frozenset({("slo_class", "tight")}))] == 1
        assert m[("goodserve:request_slo_attained_total", frozenset({("slo_class", "tight")}))] == 1
        assert m[("goodserve:request_slo_attained_total", frozenset({("slo_class", "custom")}))] == 1
        assert m[("goodserve:request_slo_attained_total", frozenset({("slo_class", "default")}))] == 0
    wait_idle(engine)


# ------------------------------------------------------------------------------------- engine death
class _BrokenEngine:
    """Just enough of an Engine for AsyncEngine; every step raises."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.chat_template, self.max_model_len = tokenizer, None, 64
        self.config = SimpleNamespace(model_path="/models/broken.gguf", request_options=lambda *a: RequestOptions())
        self._pending = False

    def tokenize(self, prompt):
        return [1, 2, 3]

    def add_request(self, *args, **kwargs):
        self._pending = True

    def has_unfinished_requests(self) -> bool:
        return self._pending

    def has_pending_kv_transfers(self) -> bool:
        return False

    def step(self):
        raise RuntimeError("boom")

    def close(self) -> None:
        pass

    def abort(self, ids) -> None:
        pass

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats.idle()


def test_engine_death_health_503(engine):
    broken = AsyncEngine(_BrokenEngine(engine.tokenizer))  # type: ignore[arg-type]
    with ServerThread(build_app(broken)) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": "broken", "prompt": "Hi"})
        assert r.status_code in (500, 503)
        deadline = time.monotonic() + 5
        while c.get("/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.post("/v1/completions", json={"model": "broken", "prompt": "Hi"}).status_code == 503


def test_serve_cli_parser():
    from goodserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9000", "--max-waiting-requests", "4", "--slo-ttft", "0.5",
                                      "--served-model-name", "m", "--num-blocks", "64"])
    assert args.func.__name__ == "run_serve" and args.port == 9000 and args.max_waiting_requests == 4
    assert EngineArgs.from_cli_args(args).num_blocks == 64
