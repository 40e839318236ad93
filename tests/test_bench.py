"""The serving benchmark: metric maths, arrival processes, dataset loaders, and one real run.

Case C11 (see /work/shared/cases/CASES.md): inter-token latencies are the gaps between chunks *after the
first*; TTFT is never counted as an ITL. ``test_metrics_hand_made_timeline`` checks it on exact timelines.
"""

from __future__ import annotations

import json
import math

import pytest

from goodserve.bench.datasets import BenchRequest, build_workload, load_jsonl, load_sharegpt
from goodserve.workload import arrivals as A
from goodserve.workload.datasets import (RequestSpec, clip_specs, load_azure, load_mooncake,
                                         synthesise_shared_prompts)
from goodserve.workload.metrics import RequestRecord, Stat, percentile, record_from_timeline, summarize
from goodserve.workload.report import RunResult, format_ratios, format_summary, format_sweep, max_rate_meeting
from goodserve.workload.slo import parse_slos


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_hand_made_timeline():
    """C11: 4 chunks at 0.5, 0.6, 0.8, 1.1 s after sending -> TTFT 0.5, ITLs [0.1, 0.2, 0.3] (no TTFT)."""
    r = record_from_timeline(10.0, [10.5, 10.6, 10.8, 11.1], end=11.2, prompt_tokens=7, output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert len(r.itls) == 3  # n chunks -> n - 1 ITLs; TTFT is not one of them
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)

    r2 = record_from_timeline(0.0, [2.0, 2.5], prompt_tokens=3, output_tokens=2)  # TTFT 2.0, TPOT 0.5
    single = record_from_timeline(0.0, [0.3], prompt_tokens=5, output_tokens=1)  # TPOT undefined
    assert single.tpot is None and single.itls == []
    failed = RequestRecord(prompt_tokens=9, error="HTTP 500: boom")
    s = summarize([r, r2, single, failed], duration=4.0, slos=parse_slos(["ttft:1000", "tpot:300"]))

    assert (s.num_requests, s.completed, s.failed, s.errors) == (4, 3, 1, ("HTTP 500: boom",))
    assert s.total_input_tokens == 15 and s.total_output_tokens == 7  # failed requests add no tokens
    assert s.request_throughput == pytest.approx(3 / 4) and s.output_throughput == pytest.approx(7 / 4)
    assert s.total_token_throughput == pytest.approx(22 / 4)
    assert s.ttft.mean == pytest.approx((0.5 + 2.0 + 0.3) / 3) and s.ttft.median == pytest.approx(0.5)
    assert s.itl.count == 4 and s.itl.mean == pytest.approx((0.1 + 0.2 + 0.3 + 0.5) / 4)  # only real gaps
    assert s.tpot.count == 2 and s.tpot.median == pytest.approx((0.7 / 3 + 0.5) / 2)
    assert s.e2el.p90 == pytest.approx(percentile([0.3, 1.2, 2.5], 90))
    # r meets both; r2 misses TTFT (2 s) and TPOT (500 ms); single meets TTFT, TPOT undefined; failed misses
    assert s.attainment == pytest.approx(2 / 4)  # the failed request counts as a miss
    assert s.goodput == pytest.approx(2 / 4.0)
    assert summarize([r, r2], 2.0).attainment == 1.0  # no SLO: every success counts


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    vals = sorted([0.013, 5.0, 0.2, 0.21, 7.5, 1.0, 3.3])
    for q in (0, 50, 90, 99, 100):
        assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))
    st = Stat.of([4.0, 1.0, 3.0, 2.0])
    assert (st.mean, st.median, st.p90, st.p99) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    assert math.isnan(Stat.of([]).mean)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_parse_slos_and_errors():
    assert parse_slos(["ttft:2000", "TPOT:150", "e2el:30000"]) == {"ttft": 2.0, "tpot": 0.15, "e2el": 30.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    with pytest.raises(ValueError):
        summarize([], 0.0)
    with pytest.raises(ValueError):
        summarize([], 1.0, {"foo": 1.0})


def test_report_table_and_sweep():
    recs = [record_from_timeline(0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], output_tokens=2) for i in range(10)]
    slos = {"ttft": 0.55}
    runs = [RunResult("a", 1.0, summarize(recs, 5.0, slos), recs),  # 50% meet TTFT <= 0.55 s
            RunResult("a", 2.0, summarize(recs[:5], 5.0, slos), recs[:5]),  # 100%
            RunResult("b", 1.0, summarize(recs[:5], 5.0, slos), recs[:5]), RunResult("b", 2.0, summarize(recs[5:], 5.0, slos), recs[5:])]
    assert "SLO attainment" in format_summary(runs[0].summary, "a")
    assert max_rate_meeting(runs, "a", 0.5) == 2.0 and max_rate_meeting(runs, "b", 0.9) == 1.0
    assert "highest rate" in format_sweep(runs) and "x" in format_ratios(runs, "a", "b")


def test_plot_and_json(tmp_path):
    pytest.importorskip("matplotlib")
    from goodserve.workload.report import plot, save_json

    recs = [record_from_timeline(0, [0.1 * (i + 1), 0.2 * (i + 1)], output_tokens=2) for i in range(6)]
    recs.append(RequestRecord(error="boom"))
    runs = [RunResult(lbl, rate, summarize(recs, 3.0, {"ttft": 0.3}), recs) for lbl in ("a", "b") for rate in (1.0, 2.0)]
    plot(str(tmp_path / "p.png"), runs, "t")
    assert (tmp_path / "p.png").stat().st_size > 1000
    save_json(str(tmp_path / "r.json"), runs)
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["runs"]) == 4 and len(data["runs"][0]["requests"]) == 7
    assert data["runs"][0]["requests"][-1]["error"] == "boom"


def test_request_body_and_url():
    from goodserve.bench.client import Target, request_body

    t = Target("http://h:1/v1/", "/v1/completions", "m")
    assert t.url == "http://h:1/v1/completions"
    body = request_body(t, BenchRequest((300, 301), 2, 5))
    assert body["prompt"] == [300, 301] and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    chat = request_body(Target("http://h:1", "/v1/chat/completions"), BenchRequest("hi", 1, 3))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "model" not in chat


# ----------------------------------------------------------------------------------------------- arrivals
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_rate_and_burstiness(burstiness):
    n, rate = 4000, 5.0
    t = A.gamma_arrivals(n, rate, burstiness, seed=1)
    assert len(t) == n and all(b >= a for a, b in zip(t, t[1:]))
    assert n / t[-1] == pytest.approx(rate, rel=0.08)  # mean rate
    assert A.gaps_cv(t) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)  # CV = 1/sqrt(B)
    assert A.gamma_arrivals(n, rate, burstiness, seed=1) == t  # reproducible


def test_arrivals_inf_trace_and_errors():
    assert A.gamma_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    assert A.poisson_arrivals(5, 2.0, seed=3) == A.gamma_arrivals(5, 2.0, 1.0, seed=3)
    assert A.trace_arrivals([10.0, 11.0, 13.0], 0.5) == [0.0, 0.5, 1.5]
    assert A.parse_rate("inf") == math.inf and A.parse_rate("0.5") == 0.5
    for bad in (lambda: A.gamma_arrivals(3, 0.0), lambda: A.gamma_arrivals(3, 1.0, 0.0),
                lambda: A.trace_arrivals([2.0, 1.0]), lambda: A.parse_rate("-1")):
        with pytest.raises(ValueError):
            bad()


# ----------------------------------------------------------------------------------------------- datasets
class FakeTokenizer:
    """Whitespace tokenizer: one token per word, ids = word lengths + 300."""

    def encode(self, text, add_special_tokens=False):
        return [300 + len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("w" * (i - 300 if i > 300 else 1) for i in ids)

    def __len__(self):
        return 1000


def test_azure_clip_to_context_and_limits():
    specs = clip_specs(load_azure("azure-conv", 200, max_model_len=8192), 1024, max_input_len=512, max_output_len=128)
    assert all(1 <= s.prompt_len <= 512 and 1 <= s.output_len <= 128 for s in specs)
    assert all(s.prompt_len + s.output_len <= 1024 for s in specs)
    assert max(s.prompt_len for s in specs) == 512  # the conversation trace has longer prompts
    tight = clip_specs([RequestSpec(5000, 3000, 0.0)], 1000)
    assert (tight[0].prompt_len, tight[0].output_len) == (1, 999)
    arrivals = [s.arrival for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_mooncake_scaling_and_prefix_sharing():
    raw = load_mooncake(8)
    scaled = load_mooncake(8, length_scale=0.1)
    assert raw[0][0].prompt_len == 6758 and raw[0][0].output_len == 500  # first line of the trace
    for (r, h), (s, h2) in zip(raw, scaled):
        assert s.prompt_len == max(1, round(r.prompt_len * 0.1)) and s.output_len == max(1, round(r.output_len * 0.1))
        assert h == h2 and s.arrival == r.arrival
    reqs = build_workload("mooncake", 8, tokenizer=FakeTokenizer(), vocab_size=1000, max_model_len=600,
                          length_scale=0.1, seed=0)
    assert all(r.prompt_len + r.output_len <= 600 and len(r.prompt) == r.prompt_len for r in reqs)
    # the first requests of the trace all start with hash id 0 -> the same first 51-token block
    assert reqs[0].prompt[:51] == reqs[1].prompt[:51] and reqs[0].prompt[51:102] != reqs[1].prompt[51:102]
    shared = synthesise_shared_prompts([(RequestSpec(6, 1), (7, 8)), (RequestSpec(5, 1), (7, 9))], 1000, 3)
    assert shared[0].prompt_token_ids[:3] == shared[1].prompt_token_ids[:3]


def test_sharegpt_file(tmp_path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "hello there my friend"},
                                      {"from": "gpt", "value": "hi how are you"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "x " * 50},
                                      {"from": "gpt", "value": "too long prompt"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "one two"}, {"from": "gpt", "value": "a b c d e f"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = load_sharegpt(str(path), 2, FakeTokenizer(), max_model_len=40, max_output_len=5)
    assert reqs == [BenchRequest("hello there my friend", 4, 4), BenchRequest("one two", 2, 5)]
    with pytest.raises(ValueError):
        load_sharegpt(str(path), 3, FakeTokenizer(), max_model_len=40)


def test_jsonl_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a bb ccc", "output_len": 3}\n\n'
                    '{"prompt_len": 5, "output_len": 2, "arrival": 1.5}\n'
                    '{"prompt": [301, 302], "output_len": 4, "timestamp": 2500}\n')
    reqs = load_jsonl(str(path), 3, FakeTokenizer(), vocab_size=1000)
    assert reqs[0] == BenchRequest("a bb ccc", 3, 3)
    assert reqs[1].prompt_len == 5 and len(reqs[1].prompt) == 5 and reqs[1].arrival == 1.5
    assert reqs[2] == BenchRequest((301, 302), 2, 4, 2.5)
    with pytest.raises(ValueError):
        build_workload("jsonl", 3, tokenizer=FakeTokenizer(), vocab_size=1000, max_model_len=100)


def test_random_workload_exact_lengths_and_text_prompts():
    reqs = build_workload("random", 5, tokenizer=FakeTokenizer(), vocab_size=1000, max_model_len=100,
                          input_len=20, output_len=8, seed=2)
    assert all(len(r.prompt) == r.prompt_len == 20 and r.output_len == 8 for r in reqs)
    assert all(256 <= t < 1000 for r in reqs for t in r.prompt)
    text = build_workload("random", 2, tokenizer=FakeTokenizer(), vocab_size=1000, max_model_len=100,
                          input_len=4, output_len=2, text_prompts=True)
    assert all(isinstance(r.prompt, str) for r in text)


def test_prefix_repetition_structure_determinism_and_errors():
    """10 requests over 3 prefixes of 12 tokens + 5-token suffixes: every prompt is one of 3 prefixes (used 4, 3,
    3 times, distinct first tokens) plus its own suffix; the same seed gives the same prompts."""
    kw = dict(tokenizer=FakeTokenizer(), vocab_size=1000, max_model_len=40, prefix_len=12, suffix_len=5,
              num_prefixes=3, output_len=7)
    reqs = build_workload("prefix-repetition", 10, seed=3, **kw)
    assert len(reqs) == 10
    assert all(len(r.prompt) == r.prompt_len == 17 and r.output_len == 7 and r.arrival == 0.0 for r in reqs)
    assert all(256 <= t < 1000 for r in reqs for t in r.prompt)
    prefixes = sorted({r.prompt[:12] for r in reqs})
    assert len(prefixes) == 3 and len({p[0] for p in prefixes}) == 3  # no two share a leading token
    assert sorted(sum(r.prompt[:12] == p for r in reqs) for p in prefixes) == [3, 3, 4]
    assert len({r.prompt[12:] for r in reqs}) == 10  # every suffix is the request's own
    assert build_workload("prefix-repetition", 10, seed=3, **kw) == reqs
    assert build_workload("prefix-repetition", 10, seed=4, **kw) != reqs
    text = build_workload("prefix-repetition", 10, seed=3, text_prompts=True, **kw)
    assert text[0] == BenchRequest(FakeTokenizer().decode(list(reqs[0].prompt)), 17, 7)  # same ids, decoded
    with pytest.raises(ValueError, match=r"prefix_len \+ suffix_len \+ output_len = 12 \+ 5 \+ 7 = 24 tokens "
                                         r"exceeds max_model_len 23"):
        build_workload("prefix-repetition", 10, **{**kw, "max_model_len": 23})
    assert len(build_workload("prefix-repetition", 10, **{**kw, "max_model_len": 24})) == 10  # exactly fits
    with pytest.raises(ValueError, match="suffix_len must be >= 1, got 0"):
        build_workload("prefix-repetition", 10, **{**kw, "suffix_len": 0})
    with pytest.raises(ValueError, match=r"num_prefixes \(11\) must be <= num_prompts \(10\)"):
        build_workload("prefix-repetition", 10, **{**kw, "num_prefixes": 11})
    with pytest.raises(ValueError, match="fewer than num_prefixes"):
        build_workload("prefix-repetition", 10, **{**kw, "vocab_size": 258})
    with pytest.raises(ValueError, match=r"only 744 distinct 1-token suffixes, fewer than num_prompts \(745\)"):
        build_workload("prefix-repetition", 745, **{**kw, "suffix_len": 1})


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_bench_serve_end_to_end(tmp_path, capsys):
    """6 requests x 8 forced output tokens at rate inf against a real ``goodserve serve`` app."""
    from goodserve.cli import build_parser
    from goodserve.engine.args import EngineArgs
    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.server.app import build_app
    from server_fixtures import ServerThread

    engine = AsyncEngine(Engine(EngineArgs(dtype="float32", num_blocks=64, max_num_batched_tokens=256,
                                           max_model_len=256, log_stats_interval=0)))
    try:
        with ServerThread(build_app(engine, served_model_name="smol")) as srv:
            out = tmp_path / "res.json"
            args = build_parser().parse_args([
                "bench", "serve", "--base-url", srv.base_url, "--dataset", "random", "--num-prompts", "6",
                "--input-len", "24", "--output-len", "8", "--request-rate", "inf", "--goodput", "ttft:60000",
                "tpot:60000", "--save-result", str(out), "--no-progress"])
            assert args.func(args) == 0
    finally:
        engine.shutdown()
    text = capsys.readouterr().out
    assert "Goodput (req/s)" in text
    run = json.loads(out.read_text())["runs"][0]
    assert run["summary"]["completed"] == 6 and run["summary"]["failed"] == 0
    assert run["summary"]["total_output_tokens"] == 48 and run["summary"]["attainment"] == 1.0
    for r in run["requests"]:
        assert r["success"] and r["output_tokens"] == 8 and r["prompt_tokens"] == 24
        assert r["ttft"] > 0 and r["e2e"] >= r["ttft"] and len(r["itls"]) <= 7


@pytest.mark.slow
@pytest.mark.parametrize("prompts,hits", [("fresh", False), ("same", True)])
def test_bench_sweep_fresh_prompts_find_nothing_cached(tmp_path, capsys, prompts, hits):
    """Issue 15 item 6: with ``--prompts fresh`` no rate finds an earlier rate's (or the warm-up's) prompts in
    the server's prefix cache; with ``--prompts same`` the second rate finds them all."""
    import httpx

    from goodserve.cli import build_parser
    from goodserve.engine.args import EngineArgs
    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.engine.engine import Engine
    from goodserve.server.app import build_app
    from server_fixtures import ServerThread, metric_samples

    engine = AsyncEngine(Engine(EngineArgs(dtype="float32", num_blocks=128, max_num_batched_tokens=256,
                                           max_model_len=256, log_stats_interval=0)))
    try:
        with ServerThread(build_app(engine, served_model_name="smol")) as srv:
            out = tmp_path / "res.json"
            args = build_parser().parse_args([
                "bench", "sweep", "--base-url", srv.base_url, "--dataset", "random", "--num-prompts", "3",
                "--input-len", "40", "--output-len", "2", "--request-rates", "inf,inf", "--num-warmups", "2",
                "--prompts", prompts, "--save-result", str(out), "--no-progress"])
            assert args.func(args) == 0
            with httpx.Client(base_url=srv.base_url) as http:
                cached = sum(v for (name, _), v in metric_samples(http).items()
                             if name == "goodserve:prefix_cache_hits_total")
    finally:
        engine.shutdown()
    text = capsys.readouterr().out
    assert ("prompts: fresh per rate" if prompts == "fresh" else "prompts: same at every rate") in text
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["seed"] for r in runs] == ([1, 2] if prompts == "fresh" else [0, 0])
    # 40-token prompts fill two 16-token blocks: the same prompts again hit 2 blocks each (3 x 32 tokens
    # at the second rate, plus the 2 warm-up prompts measured again at the first rate).
    assert cached == (32 * (3 + 2) if hits else 0)


@pytest.mark.parametrize("interleave", [False, True])
def test_compare_runs_each_servers_sweep_or_interleaves_rate_by_rate(monkeypatch, interleave):
    """``bench compare`` runs server A's sweep and then B's; with ``--interleave`` each rate on A and then on
    B, warming each server up before each of its runs. Both give the results by server, then by rate, each
    rate with the same prompts on both servers."""
    from types import SimpleNamespace

    from goodserve.bench import serve as S

    calls = []
    monkeypatch.setattr(S, "build_from_server", lambda args, url, seed: SimpleNamespace(
        requests=[], config={"mean_prompt_len": 0.0, "mean_output_len": 0.0, "seed": seed}))
    monkeypatch.setattr(S, "warm_up", lambda args, url, workload: calls.append(("warm", url)))

    def run_one(args, label, url, workload, rate):
        calls.append((label, rate, workload.config["seed"]))
        return SimpleNamespace(label=label, rate=rate, config={},
                               summary=SimpleNamespace(goodput=0.0, attainment=0.0, failed=0))

    monkeypatch.setattr(S, "run_one", run_one)
    args = SimpleNamespace(seed=0, prompts="fresh")
    servers = [S.ServerSpec("slo", "http://a"), S.ServerSpec("fcfs", "http://b")]
    results = S.run_servers(args, servers, [1.0, 2.0], interleave=interleave)
    assert [(r.label, r.rate) for r in results] == [("slo", 1.0), ("slo", 2.0), ("fcfs", 1.0), ("fcfs", 2.0)]
    if interleave:
        assert calls == [("warm", "http://a"), ("slo", 1.0, 1), ("warm", "http://b"), ("fcfs", 1.0, 1),
                         ("warm", "http://a"), ("slo", 2.0, 2), ("warm", "http://b"), ("fcfs", 2.0, 2)]
    else:
        assert calls == [("warm", "http://a"), ("slo", 1.0, 1), ("slo", 2.0, 2),
                         ("warm", "http://b"), ("fcfs", 1.0, 1), ("fcfs", 2.0, 2)]


def test_launch_failure_is_reported_fast():
    from goodserve.bench.serve import LaunchedServer

    with pytest.raises(RuntimeError, match="exited"):
        with LaunchedServer("{python} -c 'import sys; print({port}); sys.exit(3)'", 30.0, "t"):
            pass


def test_server_flags_validated():
    from goodserve.cli import build_parser

    parser = build_parser()
    for argv in (["bench", "serve"], ["bench", "compare", "--base-url", "http://x"],
                 ["bench", "sweep", "--base-url", "http://x", "--launch", "y"],
                 ["bench", "serve", "--base-url", "http://x", "--goodput", "foo:1"]):
        args = parser.parse_args(argv)
        with pytest.raises(ValueError):
            args.func(args)
