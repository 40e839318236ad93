"""goodserve on Ray: instance actors behind the router (``goodserve serve --ray``), on a local Ray at 127.0.0.1
with the tiny random model (fp32, greedy). One Ray and one pair of replica actors serve the module."""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import pytest

# ray itself is imported only by init_ray, which first puts Ray in its single-machine mode (node at 127.0.0.1)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs goodserve[ray]")

from goodserve.cluster.ray_instances import LOCAL_NODE_IP, RayInstances, init_ray  # noqa: E402
from goodserve.engine.args import EngineArgs  # noqa: E402
from goodserve.router.policies import make_policy  # noqa: E402
from server_fixtures import RouterServer, metric_samples  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

MODEL = "tiny"
BS = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def engine_args(model: str) -> EngineArgs:
    return EngineArgs(model=model, dtype="float32", num_blocks=512, block_size=BS, max_num_batched_tokens=256,
                      max_model_len=1100, log_stats_interval=0)


@pytest.fixture(scope="module")
def ray_local():
    init_ray(num_cpus=4)
    import ray

    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(ray_local, tiny_model):
    inst = RayInstances(engine_args(tiny_model), replicas=2, served_model_name=MODEL)
    yield inst
    inst.shutdown()


def Ingress(instances: RayInstances, policy: str = "round-robin") -> RouterServer:
    """The router over Ray instances, on uvicorn in a thread (entering gives an httpx client)."""
    return RouterServer(instances.router(policy=make_policy(policy), health_interval=0.2))


def reference(model: str, prompt, max_tokens: int) -> str:
    from goodserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", block_size=BS, num_blocks=64, log_stats_interval=0)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)[0].text


def count(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and all((k, x) in lab for k, x in labels.items()))


def test_instances_are_actors_on_loopback(ray_local, replicas):
    """Every Ray node and instance server is at 127.0.0.1; each actor reserves one CPU."""
    assert {n["NodeManagerAddress"] for n in ray_local.nodes()} == {LOCAL_NODE_IP}
    assert [u.split(":")[1] for u in replicas.urls["replica"]] == ["//127.0.0.1", "//127.0.0.1"]
    assert len(set(replicas.urls["replica"])) == 2
    assert ray_local.available_resources().get("CPU", 0) <= 4 - 2
    assert [s.engine_kwargs["num_threads"] for s in replicas.specs] == [1, 1]


def test_two_replicas_answer_as_one_instance_and_metrics_aggregate(tiny_model, replicas):
    """Round-robin through two replica actors: both answers equal one in-process instance's (greedy, fp32).
    The ingress's /metrics has the router's samples and each instance's, labelled instance=<url>; /health
    lists both with their own /health answer."""
    prompt = "The capital of France is"
    want = reference(tiny_model, prompt, 12)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    urls = replicas.urls["replica"]
    with Ingress(replicas) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        m = metric_samples(http)
        for url in urls:
            assert count(m, "goodserve:router_requests_total", backend=url, outcome="ok") == 1
            assert count(m, "goodserve:api_requests_finished_total", instance=url, endpoint="/v1/completions") >= 1
        time.sleep(0.5)  # a probe round
        h = http.get("/health")
        assert h.status_code == 200
        assert [(b["url"], b["healthy"], b["health"]["status_code"]) for b in h.json()["backends"]] == \
            [(urls[0], True, 200), (urls[1], True, 200)]


def wait_subscribed(http) -> list[dict]:
    """Wait until the ingress follows every instance's KV events (the first probes find them); their states."""
    deadline = time.monotonic() + 30
    while True:
        states = [b["kv_events"] for b in http.get("/health").json()["backends"]]
        if all(s["publishes"] and s["stream_id"] for s in states):
            return states
        assert time.monotonic() < deadline, f"the router did not follow the instances' KV events: {states}"
        time.sleep(0.1)


def test_prefix_affinity_keeps_a_shared_prefix_on_one_instance(replicas):
    """Four prompts sharing a 64-token prefix (16 blocks), distinct 4-token tails: prefix affinity and
    kv-aware (on the instances' published KV events) send the three repeats where the first went, each finding
    all 64 tokens cached; round-robin (a fresh prefix) alternates, so only its third and fourth requests hit."""
    def cached(policy: str, base: int) -> list[int]:
        out = []
        with Ingress(replicas, policy) as http:
            wait_subscribed(http)
            for i in range(4):
                prompt = list(range(base, base + 64)) + [900 + 10 * i + t for t in range(4)]
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                out.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return out

    assert cached("prefix-affinity", 1000) == [0, 64, 64, 64]
    assert cached("kv-aware", 3000) == [0, 64, 64, 64]
    assert cached("round-robin", 5000) == [0, 0, 64, 64]


def test_prefill_decode_on_ray_equals_colocated(tiny_model, ray_local):
    """One producer and one consumer actor behind the ingress (P/D hops, KV over NIXL on loopback) give the
    colocated answer; the handle names the producer's node IP (127.0.0.1)."""
    pytest.importorskip("nixl_cu12")
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    want = reference(tiny_model, prompt, 10)
    pd = RayInstances(engine_args(tiny_model), prefill=1, decode=1, served_model_name=MODEL)
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        first = httpx.post(pd.urls["prefill"][0] + "/v1/completions", timeout=60,
                           json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert first.status_code == 200 and first.json()["kv_transfer_params"]["remote_host"] == LOCAL_NODE_IP
        with Ingress(pd) as http:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            m = metric_samples(http)
            assert count(m, "goodserve:router_requests_total", role="prefill", outcome="ok") == 1
            assert count(m, "goodserve:router_requests_total", role="decode", outcome="ok") == 1
    finally:
        pd.shutdown()


def test_killed_instance_ends_its_stream_cleanly_and_rejoins_after_restart(ray_local, replicas):
    """ray.kill mid-stream: the client's stream ends at once with an error event (code 503) and [DONE]; the
    router takes the instance out; Ray restarts the actor (a new process, same URL); the health probe brings
    it back (seen in the ingress's /health) and a later request succeeds on it."""
    actor, url = replicas.actor("replica", 0), replicas.urls["replica"][0]
    old_pid = ray_local.get(actor.pid.remote())
    body = {"model": MODEL, "prompt": list(range(10, 30)), "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with Ingress(replicas) as http:
        old_stream = wait_subscribed(http)[0]["stream_id"]
        t0 = time.monotonic()
        with http.stream("POST", "/v1/completions", json=body) as s:  # round-robin: the first goes to replica 0
            assert s.status_code == 200
            lines = s.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            ray_local.kill(actor, no_restart=False)
            rest = [ln[6:] for ln in lines if ln.startswith("data: ")]
        assert time.monotonic() - t0 < 30
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable" and url in err["message"]
        m = metric_samples(http)
        assert count(m, "goodserve:router_requests_total", backend=url, outcome="backend_error") == 1
        assert count(m, "goodserve:router_in_flight_requests", backend=url) == 0
        deadline = time.monotonic() + 60
        while True:
            backend = next(b for b in http.get("/health").json()["backends"] if b["url"] == url)
            if backend["healthy"] and backend["health"] == {"status_code": 200, "body": None}:
                break
            assert time.monotonic() < deadline, f"the instance did not rejoin: {backend}"
            time.sleep(0.2)
        assert ray_local.get(actor.pid.remote()) != old_pid
        # the router follows the restarted instance's new publisher (another life: new stream_id)
        deadline = time.monotonic() + 30
        while wait_subscribed(http)[0]["stream_id"] == old_stream:
            assert time.monotonic() < deadline, "the router did not follow the restarted instance's KV events"
            time.sleep(0.1)
        for _ in range(2):  # round-robin: one of them on the restarted instance
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
        m = metric_samples(http)
        assert count(m, "goodserve:router_requests_total", backend=url, outcome="ok") == 1
        # the restarted process's own counters start again: this one request
        assert count(m, "goodserve:api_requests_finished_total", instance=url, endpoint="/v1/completions") == 1


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "2"], "need --ray"),
    (["--ray"], "either --replicas N, or both"),
    (["--ray", "--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"], "either --replicas N, or both"),
    (["--ray", "--prefill-replicas", "1"], "either --replicas N, or both"),
    (["--ray", "--replicas", "0"], "instance counts must be >= 1"),
    (["--ray", "--replicas", "1", "--kv-role", "producer"], "--kv-role is set per pool"),
    (["--ray", "--replicas", "1", "--num-cpus-per-replica", "0"], "--num-cpus-per-replica and --health-interval"),
])
def test_serve_ray_refuses_bad_flags_before_starting_anything(flags, message, capsys):
    from goodserve.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
