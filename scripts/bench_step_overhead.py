"""Engine step time and the serving path's per-step overhead, for comparing two versions of goodserve.

    flock /tmp/goodserve-bench.lock sh -c 'PYTHONPATH=OLD/src .venv/bin/python scripts/bench_step_overhead.py; \
                                          PYTHONPATH=NEW/src .venv/bin/python scripts/bench_step_overhead.py'

1. **Engine step** (no server): ``batch`` requests decode with ``--context`` tokens of context; the median of
   ``--steps`` steps of ``Engine.step()``, and of the model runner's ``execute`` inside it. Their difference is
   what the engine adds around the model (scheduling, updates, detokenisation, building outputs).
2. **Serving path at batch 64**: the real server (uvicorn in a thread, the engine on its engine thread) with
   64 streaming clients in another process. On the engine thread, each decode step's cycle (from one step's
   start to the next) is timed against the runner's ``execute``: the difference is everything the serving
   path adds per step (scheduler, output processing, handing outputs to the event loop, and the event loop's
   SSE work competing for the GIL).

Works on any version that has ``Engine.run_step`` (or, older, ``Engine.step`` and ``Engine.last_schedule``)
and a model runner (``engine.runner`` or ``engine.core.runner``); prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import goodserve
from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine
from goodserve.sampling_params import SamplingParams


def runner_of(engine: Engine):
    return getattr(engine, "core", engine).runner


def step_of(engine: Engine):
    """One step: ``(outputs, the step computed or None)``, on this version's API."""
    if hasattr(engine, "run_step"):
        step = engine.run_step()
        return step.outputs, step.schedule
    return engine.step(), engine.last_schedule


class Timer:
    """Wraps a callable and records how long each call took (seconds)."""

    def __init__(self, obj, name: str) -> None:
        self.times: list[float] = []
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(obj, name, timed)


def prompts(n: int, context: int, vocab: int) -> list[list[int]]:
    return [[256 + (i * 7919 + j * 31) % (vocab - 256) for j in range(context)] for i in range(n)]


def engine_step(engine: Engine, batch: int, context: int, steps: int) -> dict:
    runner = runner_of(engine)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = []
    for p in prompts(batch, context, engine.config.model.vocab_size):
        added = engine.add_request(p, params)
        ids.append(added if isinstance(added, str) else added.request_id)  # older versions return the Request
    for _ in range(40):  # prefill, then a few decode steps to warm up
        _, shape = step_of(engine)
        if shape is not None and shape.num_prefill_tokens == 0:
            break
    execute = Timer(runner, "execute")
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    del runner.execute
    engine.abort(ids)
    step, model = statistics.median(step_times), statistics.median(execute.times)
    return {"batch": batch, "step_ms": 1e3 * step, "execute_ms": 1e3 * model,
            "engine_overhead_ms": 1e3 * (step - model)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLIENT = """
import asyncio, httpx, json, sys
url, n, context, max_tokens, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
async def one(c, i):
    body = {"prompt": [256 + (i * 7919 + j * 31) % (vocab - 256) for j in range(context)], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass
async def main():
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=n + 4)) as c:
        await asyncio.gather(*(one(c, i) for i in range(n)))
asyncio.run(main())
"""


def serving_path(args: argparse.Namespace) -> dict:
    import uvicorn

    from goodserve.engine.async_engine import AsyncEngine
    from goodserve.server.app import build_app

    eargs = EngineArgs(model=args.model, dtype=args.dtype, num_blocks=2048, max_num_seqs=64,
                       max_num_batched_tokens=2048, log_stats_interval=0, enable_prefix_caching=False)
    cycles: list[tuple[float, float, int]] = []  # (cycle s, execute s, decodes) per step

    def build() -> Engine:
        engine = Engine(eargs)
        runner = runner_of(engine)
        new_api = hasattr(engine, "run_step")  # the serving loop calls run_step (older versions: step)
        real_execute, real_step = runner.execute, (engine.run_step if new_api else engine.step)
        state = {"execute": 0.0, "start": None, "decodes": 0}

        def execute(out):
            t0 = time.perf_counter()
            try:
                return real_execute(out)
            finally:
                state["execute"] = time.perf_counter() - t0

        def step():
            now = time.perf_counter()
            if state["start"] is not None:  # the previous cycle ends where this step starts
                cycles.append((now - state["start"], state["execute"], state["decodes"]))
            state["start"] = now
            result = real_step()
            shape = result.schedule if new_api else engine.last_schedule
            state["decodes"] = shape.num_decode_tokens if shape is not None and not shape.num_prefill_tokens else 0
            return result

        runner.execute = execute
        setattr(engine, "run_step" if new_api else "step", step)
        return engine

    engine = AsyncEngine(build=build)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    vocab = engine.engine.config.model.vocab_size
    subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(args.batch), str(args.context),
                    str(args.serve_tokens), str(vocab)], check=True)
    server.should_exit = True
    thread.join(10)
    engine.shutdown()
    full = [(c, e) for c, e, d in cycles if d == args.batch]
    cycle = statistics.median(c for c, _ in full)
    model = statistics.median(e for _, e in full)
    return {"batch": args.batch, "decode_steps": len(full), "cycle_ms": 1e3 * cycle, "execute_ms": 1e3 * model,
            "serving_overhead_ms": 1e3 * (cycle - model)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="streams of the serving-path run")
    p.add_argument("--serve-tokens", type=int, default=128, help="tokens each stream generates")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M; a tiny model shows the overhead best")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-serving", action="store_true", help="measure the engine step only")
    args = p.parse_args()
    engine = Engine(EngineArgs(model=args.model, dtype=args.dtype, num_blocks=2048, max_num_seqs=64,
                               max_num_batched_tokens=2048, log_stats_interval=0, enable_prefix_caching=False))
    result = {"goodserve": goodserve.__file__, "engine_step": [engine_step(engine, b, args.context, args.steps)
                                                               for b in (1, 64)]}
    del engine
    if not args.no_serving:
        result["serving_path"] = serving_path(args)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
