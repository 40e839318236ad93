"""Cache-aware routing on Ray: replica actors behind the router, measured here and simulated at scale.

    flock /tmp/goodserve-bench.lock .venv/bin/python scripts/bench_ray.py --out /tmp/bench-ray
    flock /tmp/goodserve-bench.lock .venv/bin/python scripts/bench_ray.py --out /tmp/bench-ray-prefix \\
        --workload prefix-repetition --routings kv-aware,prefix-affinity,round-robin --skip-sim

1. Measured (this machine, default model SmolLM2-135M, everything on 127.0.0.1), one workload
   (``--workload``):

   * ``mooncake`` (default): the Mooncake FAST'25 conversation trace (``bench serve --dataset mooncake``:
     shared 512-token blocks kept as shared token ids, lengths scaled by ``--length-scale``, clipped by
     ``--max-input-len`` / ``--max-output-len``);
   * ``prefix-repetition``: ``--num-prefixes`` shared "system prompts" of ``--prefix-len`` tokens, each
     request one of them followed by its own ``--suffix-len``-token question, ``--output-len`` output tokens
     (``bench serve --dataset prefix-repetition``);

   against

   * ``goodserve serve --ray --replicas 2 --num-cpus-per-replica 1`` (two one-thread replica actors behind
     the router) with each ``--routing`` of ``--routings`` (default ``prefix-affinity,round-robin``), one
     server per policy, one after the other;
   * one ``goodserve serve --num-threads 2`` instance (unless ``--skip-one-instance``).

   The prefix-cache hit rate is read from the ingress's ``/metrics`` (every instance's
   ``goodserve:prefix_cache_hits_total`` / ``..._queries_total``, labelled ``instance``), as the difference
   over the measured requests (a few warm-up requests are sent before the first reading). After the run, and
   before the server stops, each backend's ``goodserve:router_kv_index_blocks{backend=URL}`` (the blocks the
   router's KV-event index holds for it) is compared with its own ``goodserve:prefix_cache_blocks``
   (``instance=URL``); the script waits up to ``--kv-settle-s`` seconds for the last KV events to arrive and
   reports the last reading and whether every backend agrees.
2. Simulated (unless ``--skip-sim``), each policy of ``--routings`` the simulator knows, on Llama-3-8B
   replicas of the ``h100`` preset (the simulator routes with the router's own policy classes): for the
   ``mooncake`` workload, the measured workload itself at 2 replicas (same requests, lengths, rate and seed:
   its hit rates go beside the measured ones; the simulator has no ``prefix-repetition`` dataset, so that
   workload has no such row); then, unless ``--skip-full-sim``, ``--sim-prompts`` requests of the Mooncake
   trace at full length on 2, 8 and 32 replicas, at ``--sim-rate-per-replica`` requests/s per replica.

Prints a markdown table of each part and writes every JSON result (and each server's log) under ``--out``.
Raises ``SystemExit`` (argparse) on a bad flag, and ``subprocess.CalledProcessError`` / ``RuntimeError`` when
a benchmark or server fails: read ``<label>.log`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

PY = sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become healthy in {timeout} s")
        time.sleep(0.5)


def warm_up(url: str) -> None:
    """Warm every instance behind ``url`` directly (each backend the router lists in
    ``goodserve:router_backend_healthy``, else ``url`` itself): short prompts and one of ~300 tokens, so no
    instance meets its first prefill in the measured window whatever the policy (through the router,
    kv-aware sent every warm-up to the first replica, and the second met its first prompts under load).
    Never part of the hit rate (read after)."""
    metrics = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    targets = [s.labels["backend"] for fam in metrics for s in fam.samples
               if s.name == "goodserve:router_backend_healthy"] or [url]
    for target in targets:
        for prompt in ["warm-up 0", "warm-up 1", " ".join(["warm-up"] * 100), "warm-up 2"]:
            httpx.post(target + "/v1/completions", timeout=120,
                       json={"model": "smollm2", "prompt": prompt, "max_tokens": 4}).raise_for_status()


def prefix_counts(url: str) -> tuple[float, float]:
    """Sum over instances of prefix-cache (hits, queries), from the server's (or ingress's) /metrics."""
    hits = queries = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "goodserve:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "goodserve:prefix_cache_queries_total":
                queries += s.value
    return hits, queries


def kv_blocks(url: str) -> dict[str, tuple[float, float]]:
    """Per backend URL: (router index blocks, the backend's own prefix_cache_blocks) from the ingress /metrics.

    A backend missing from either metric reads NaN there (so it never agrees)."""
    index: dict[str, float] = {}
    cached: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "goodserve:router_kv_index_blocks":
                index[s.labels["backend"]] = s.value
            elif s.name == "goodserve:prefix_cache_blocks" and "instance" in s.labels:
                cached[s.labels["instance"]] = s.value
    nan = float("nan")
    return {b: (index.get(b, nan), cached.get(b, nan)) for b in sorted(set(index) | set(cached))}


def settled_kv_blocks(url: str, settle_s: float) -> tuple[dict[str, tuple[float, float]], bool, float]:
    """Read :func:`kv_blocks` until every backend's two counts agree or ``settle_s`` seconds pass.

    Returns:
        (the last reading, whether every backend agreed in it, seconds waited)."""
    t0 = time.monotonic()
    while True:
        blocks = kv_blocks(url)
        agree = bool(blocks) and all(i == c for i, c in blocks.values())
        waited = time.monotonic() - t0
        if agree or waited >= settle_s:
            return blocks, agree, waited
        time.sleep(0.5)


def workload_flags(args: argparse.Namespace) -> list[str]:
    """``bench serve``'s dataset flags for ``--workload``."""
    if args.workload == "prefix-repetition":
        return ["--dataset", "prefix-repetition", "--prefix-len", str(args.prefix_len), "--suffix-len",
                str(args.suffix_len), "--num-prefixes", str(args.num_prefixes), "--output-len", str(args.output_len)]
    return ["--dataset", "mooncake", "--length-scale", str(args.length_scale), "--max-input-len",
            str(args.max_input_len), "--max-output-len", str(args.max_output_len)]


def run_real(label: str, serve_flags: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [PY, "-m", "goodserve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--served-model-name", "smollm2",
           "--log-stats-interval", "0", *serve_flags]
    log = open(os.path.join(args.out, f"{label}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, 600)
        warm_up(url)
        h0, q0 = prefix_counts(url)
        result = os.path.join(args.out, f"{label}.json")
        bench = [PY, "-m", "goodserve.cli", "bench", "serve", "--base-url", url, "--model", "smollm2",
                 "--label", label, *workload_flags(args), "--num-prompts", str(args.num_prompts),
                 "--request-rate", str(args.request_rate), "--num-warmups", "0", "--goodput", *args.goodput,
                 "--no-progress", "--save-result", result]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        h1, q1 = prefix_counts(url)
        blocks, agree, waited = settled_kv_blocks(url, args.kv_settle_s) if "--ray" in serve_flags else ({}, None, 0.0)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    s = json.load(open(result))["runs"][0]["summary"]
    return {"label": label, "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
            "ttft_p50_ms": s["ttft"]["median"] * 1e3, "ttft_p99_ms": s["ttft"]["p99"] * 1e3,
            "tpot_p50_ms": s["tpot"]["median"] * 1e3 if s["tpot"]["median"] is not None else None,
            "goodput": s["goodput"], "attainment": s["attainment"], "completed": s["completed"],
            "duration_s": s["duration"],
            "kv_blocks": {b: {"router_index": i, "prefix_cache_blocks": c} for b, (i, c) in blocks.items()},
            "kv_blocks_agree": agree, "kv_settle_waited_s": waited}


def kv_column(r: dict) -> str:
    """``index=/metrics`` per backend (by port) and whether all agree; blank for a server without a router."""
    if r["kv_blocks_agree"] is None:
        return ""
    cells = [f"{b.rsplit(':', 1)[-1]}: {v['router_index']:.0f}={v['prefix_cache_blocks']:.0f}"
             for b, v in r["kv_blocks"].items()]
    return f"{', '.join(cells) or 'no backends'} ({'agree' if r['kv_blocks_agree'] else 'DISAGREE'})"


def run_sim(replicas: int, routing: str, args: argparse.Namespace, measured_workload: bool = False) -> dict:
    name = "measured-workload" if measured_workload else "full"
    result = os.path.join(args.out, f"sim-{name}-{replicas}-{routing}.json")
    if measured_workload:
        workload = ["--num-prompts", str(args.num_prompts), "--length-scale", str(args.length_scale),
                    "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
                    "--request-rate", str(args.request_rate), "--max-model-len", str(args.max_model_len)]
    else:
        workload = ["--num-prompts", str(args.sim_prompts),
                    "--request-rate", str(args.sim_rate_per_replica * replicas)]
    cmd = [PY, "-m", "goodserve.cli", "--log-level", "WARNING", "simulate", "--model", "Llama-3-8B",
           "--hardware", "h100", "--dataset", "mooncake", *workload, "--replicas", str(replicas),
           "--routing", routing, "--goodput", *args.sim_goodput, "--save-result", result]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    run = json.load(open(result))["runs"][0]
    s = run["summary"]
    return {"workload": name, "replicas": replicas, "routing": routing, "hit_rate": run["config"]["prefix_cache_hit_rate"],
            "ttft_p50_ms": s["ttft"]["median"] * 1e3, "ttft_p99_ms": s["ttft"]["p99"] * 1e3,
            "goodput": s["goodput"], "attainment": s["attainment"]}


def main() -> int:
    from goodserve.router.policies import POLICIES
    from goodserve.sim.spec import ROUTING_POLICIES as SIM_POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/bench-ray")
    p.add_argument("--workload", default="mooncake", choices=["mooncake", "prefix-repetition"])
    p.add_argument("--routings", default="prefix-affinity,round-robin",
                   help=f"comma-separated Ray routing policies, one server each (of {', '.join(sorted(POLICIES))})")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=1.2, help="requests/s (Poisson)")
    p.add_argument("--length-scale", type=float, default=0.02, help="mooncake: lengths x this (this CPU)")
    p.add_argument("--max-input-len", type=int, default=512, help="mooncake: clip prompts (tokens)")
    p.add_argument("--max-output-len", type=int, default=16, help="mooncake: clip outputs (tokens)")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: each request's suffix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    p.add_argument("--output-len", type=int, default=16, help="prefix-repetition: output tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per replica (default: sized from memory); small enough that not every prefix "
                        "fits on every replica makes the run memory-bound")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:150"])
    p.add_argument("--kv-settle-s", type=float, default=10.0,
                   help="seconds to wait for the router's KV index to agree with the replicas' /metrics")
    p.add_argument("--sim-prompts", type=int, default=2000)
    p.add_argument("--sim-rate-per-replica", type=float, default=1.0)
    p.add_argument("--sim-goodput", nargs="+", default=["ttft:2000", "tpot:100"])
    p.add_argument("--skip-real", action="store_true", help="measure nothing on this machine")
    p.add_argument("--skip-one-instance", action="store_true", help="no one-instance (--num-threads 2) baseline")
    p.add_argument("--skip-full-sim", action="store_true", help="simulate only the measured workload")
    p.add_argument("--skip-sim", action="store_true", help="simulate nothing")
    args = p.parse_args()
    routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    bad = [r for r in routings if r not in POLICIES]
    if not routings or bad or len(set(routings)) != len(routings):
        p.error(f"--routings needs distinct names from {sorted(POLICIES)}, got {args.routings!r}")
    for name in ("num_prompts", "prefix_len", "suffix_len", "num_prefixes", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0 or args.kv_settle_s < 0:
        p.error("--request-rate must be > 0 and --kv-settle-s >= 0")
    os.makedirs(args.out, exist_ok=True)
    real = []
    if not args.skip_real:
        ray = ["--ray", "--replicas", "2", "--num-cpus-per-replica", "1",
               *(["--num-blocks", str(args.num_blocks)] if args.num_blocks else [])]
        real = [run_real(f"ray2-{routing}", ray + ["--routing", routing], args) for routing in routings]
        if not args.skip_one_instance:
            real.append(run_real("one-2-threads", ["--num-threads", "2"], args))
        print(f"workload: {args.workload}, {args.num_prompts} requests at {args.request_rate} req/s")
        print("| server | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | goodput (req/s) | "
              "attainment | completed | index = /metrics blocks (per replica port) |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for r in real:
            tpot = "" if r["tpot_p50_ms"] is None else f"{r['tpot_p50_ms']:.0f}"
            print(f"| {r['label']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                  f"{tpot} | {r['goodput']:.3f} | {r['attainment']:.1%} | {r['completed']} | {kv_column(r)} |")
    sims = []
    if not args.skip_sim:
        policies = [r for r in routings if r in SIM_POLICIES]
        if len(policies) < len(routings):
            print(f"not simulated (the simulator lacks them): {sorted(set(routings) - set(policies))}", file=sys.stderr)
        if args.workload == "mooncake":
            sims += [run_sim(2, routing, args, measured_workload=True) for routing in policies]
        if not args.skip_full_sim:
            sims += [run_sim(n, routing, args) for n in (2, 8, 32) for routing in policies]
    measured = {r["label"].split("-", 1)[1]: r["hit_rate"] for r in real if r["label"].startswith("ray2")}
    if sims:
        print("\n| workload | Llama-3-8B h100 replicas | routing | simulated hit rate | measured here (2 replicas) | "
              "TTFT p50 (ms) | TTFT p99 (ms) | goodput (req/s) | attainment |\n|---|---|---|---|---|---|---|---|---|")
    for r in sims:
        m = measured.get(r["routing"]) if r["workload"] == "measured-workload" else None
        print(f"| {r['workload']} | {r['replicas']} | {r['routing']} | {r['hit_rate']:.1%} | "
              f"{'' if m is None else f'{m:.1%}'} | "
              f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['goodput']:.2f} | {r['attainment']:.1%} |")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"real": real, "simulated": sims, "argv": sys.argv[1:]}, f, indent=1)
    return 0

if __name__ == "__main__":
    sys.exit(main())
