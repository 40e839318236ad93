"""Per-step cost of structured outputs (xgrammar bitmask) at batch 1 and 16, against the same batch unconstrained.

    flock /tmp/goodserve-bench.lock env PYTHONPATH=src .venv/bin/python scripts/bench_structured_output.py

For each batch size, in one run and one after another: ``batch`` requests decode (a) unconstrained
(``ignore_eos``), (b) all constrained by a JSON schema whose one string must hold at least ``--min-chars``
characters (so the grammar keeps them decoding), (c) half and half. Measured over ``--steps`` decode steps
where every request decodes: the median ``Engine.step()``, and the median of the runner's sampling
(``ModelRunner._sample``: building the sampling metadata, which fills the constrained rows' bitmasks, and the
sampler, which applies them). The grammar matcher's advance by each sampled token is inside the step. Prints
the machine's limits first, then one JSON object per configuration (``fill_bitmask_ms``, ``accept_ms``,
``apply_bitmask_ms``: the step's total in each grammar stage, over its constrained rows), then the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from goodserve.engine.args import EngineArgs
from goodserve.engine.engine import Engine
from goodserve.runner import structured_output
from goodserve.sampling_params import SamplingParams, StructuredOutputsParams


class Timer:
    """Wraps ``obj.name`` and records each call's duration (seconds)."""

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


GRAMMAR_FILL = structured_output.GrammarState.fill_bitmask
GRAMMAR_ACCEPT = structured_output.GrammarState.accept
GRAMMAR_APPLY = structured_output.apply_bitmask_


def run(engine: Engine, batch: int, constrained: int, steps: int, min_chars: int) -> dict:
    """Decode ``batch`` requests (``constrained`` of them under the grammar) and time ``steps`` full steps."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": min_chars}},
              "required": ["text"], "additionalProperties": False}
    spec = StructuredOutputsParams(json=json.dumps(schema))
    ids = []
    for i in range(batch):
        if i < constrained:
            p = SamplingParams(temperature=0.0, max_tokens=steps + 64, structured_outputs=spec)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
        ids.append(engine.add_request(f"Write a long story, number {i}, about the sea:", p))
    runner = engine.core.runner
    sample = Timer(runner, "_sample")
    grammar = {name: Timer(obj, attr) for name, obj, attr in (
        ("fill_bitmask", structured_output.GrammarState, "fill_bitmask"),
        ("accept", structured_output.GrammarState, "accept"),
        ("apply_bitmask", structured_output, "apply_bitmask_"))}
    originals = {"fill_bitmask": GRAMMAR_FILL, "accept": GRAMMAR_ACCEPT, "apply_bitmask": GRAMMAR_APPLY}
    grammar_step: dict[str, list[float]] = {name: [] for name in grammar}
    step_times, sample_times = [], []
    while len(step_times) < steps and engine.has_unfinished_requests():
        n = len(sample.times)
        marks = {name: len(t.times) for name, t in grammar.items()}
        t0 = time.perf_counter()
        sched = engine.run_step().schedule
        dt = time.perf_counter() - t0
        if sched is not None and sched.num_decode_tokens == batch and len(sched.scheduled) == batch:
            step_times.append(dt)
            sample_times.extend(sample.times[n:])
            for name, t in grammar.items():  # this step's total per stage, over all constrained rows
                grammar_step[name].append(sum(t.times[marks[name]:]))
    del runner._sample  # back to the class's method
    structured_output.GrammarState.fill_bitmask = originals["fill_bitmask"]
    structured_output.GrammarState.accept = originals["accept"]
    structured_output.apply_bitmask_ = originals["apply_bitmask"]
    engine.abort(ids)
    while engine.has_unfinished_requests():
        engine.step()
    if len(step_times) < steps:
        raise RuntimeError(f"only {len(step_times)} full decode steps (a request finished early)")
    return {"batch": batch, "constrained": constrained, "steps": len(step_times),
            "step_ms": round(statistics.median(step_times) * 1e3, 3),
            "sample_ms": round(statistics.median(sample_times) * 1e3, 3),
            **{f"{name}_ms": round(statistics.median(v) * 1e3, 3) for name, v in grammar_step.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--min-chars", type=int, default=2000)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "torch_threads": torch.get_num_threads(), "torch": torch.__version__}))
    engine = Engine(EngineArgs(model=args.model, dtype=args.dtype, max_model_len=1024, log_stats_interval=0,
                               enable_prefix_caching=False))
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        run(engine, batch, batch, 4, args.min_chars)  # warm up (and compile the grammar once)
        for constrained in (0, batch) if batch == 1 else (0, batch // 2, batch):
            r = run(engine, batch, constrained, args.steps, args.min_chars)
            results.append(r)
            print(json.dumps(r), flush=True)
    for r in results:
        base = next(b for b in results if b["batch"] == r["batch"] and b["constrained"] == 0)
        if r["constrained"]:
            extra = r["step_ms"] - base["step_ms"]
            print(json.dumps({"batch": r["batch"], "constrained": r["constrained"],
                              "step_ratio": round(r["step_ms"] / base["step_ms"], 3),
                              "extra_step_ms": round(extra, 3),
                              "extra_ms_per_constrained_row": round(extra / r["constrained"], 3),
                              "extra_sample_ms": round(r["sample_ms"] - base["sample_ms"], 3)}))


if __name__ == "__main__":
    main()
