"""The engine thread of the server: the engine is built on it, build errors reach the caller, and the step
trace records every step's shape (read back by ``goodserve profile --from-step-trace``)."""

from __future__ import annotations

import asyncio
import gc
import json
import platform
import sys
import threading

import pytest

from goodserve.engine.args import EngineArgs
from goodserve.engine.async_engine import AsyncEngine, EngineDeadError
from goodserve.engine.engine import Engine
from goodserve.engine.host import freeze_startup_objects, retain_freed_memory
from goodserve.engine.step_trace import read_step_trace
from goodserve.sampling_params import SamplingParams
from tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama"))


def _args(model: str, **kw) -> EngineArgs:
    return EngineArgs(model=model, dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=8,
                      enable_prefix_caching=False, log_stats_interval=0, **kw)


def test_a_serving_engine_makes_its_dense_copies_before_the_first_step(tiny_model):
    """Made lazily, the quantized layers' dense copies (~0.3 s for the default model) would land in one
    served step and in the step-time model's fit."""
    from goodserve.models.quant import QuantLinear

    eng = AsyncEngine.from_engine_args(EngineArgs(model=tiny_model, dtype="bfloat16", quantization="int4",
                                                  num_blocks=64, block_size=4, log_stats_interval=0))
    try:
        layers = [m for m in eng.engine.core.runner.model.modules() if isinstance(m, QuantLinear)]
        assert layers and all(m._dense is not None for m in layers)
    finally:
        eng.shutdown()


def test_engine_is_built_and_stepped_on_the_engine_thread(tiny_model):
    """All torch work on one thread: a second thread's OpenMP pool made CPU steps ~1.7x slower."""
    threads = []

    def build() -> Engine:
        threads.append(threading.current_thread().name)
        return Engine(_args(tiny_model))

    eng = AsyncEngine(build=build)
    try:
        assert threads == ["goodserve-engine"]
        assert eng.max_model_len == eng.engine.max_model_len and eng.tokenizer is eng.engine.tokenizer
        assert eng.call(lambda e: threading.current_thread().name) == "goodserve-engine"
    finally:
        eng.shutdown()


def test_build_error_reaches_the_caller(tiny_model):
    with pytest.raises(FileNotFoundError):
        AsyncEngine.from_engine_args(EngineArgs(model=str(tiny_model) + "-missing"))
    with pytest.raises(ValueError, match="not both or neither"):
        AsyncEngine()


def test_shutdown_before_start_never_hangs(tiny_model, tmp_path):
    eng = AsyncEngine(build=lambda: Engine(_args(tiny_model)), start=False, step_trace=str(tmp_path / "t.jsonl"))
    eng.shutdown()
    with pytest.raises(EngineDeadError, match="shut down before it was built"):
        eng.start()
    assert eng._engine_thread._trace._file.closed


def test_a_failing_step_trace_does_not_stop_serving(tiny_model, tmp_path):
    eng = AsyncEngine.from_engine_args(_args(tiny_model), step_trace=str(tmp_path / "trace.jsonl"))

    def broken(step) -> None:
        raise OSError(28, "No space left on device")

    eng._engine_thread._trace.write = broken
    try:
        out = eng.call(lambda e: None)  # the loop is alive
        outs = asyncio.run(_collect(eng, SamplingParams(max_tokens=3, ignore_eos=True)))
        assert out is None and outs[-1].finished and eng.is_healthy() and eng._engine_thread._trace is None
    finally:
        eng.shutdown()


async def _collect(eng: AsyncEngine, params: SamplingParams) -> list:
    return [out async for out in eng.generate(list(range(100, 110)), params)]


def test_step_trace_records_every_step(tiny_model, tmp_path):
    """A 10-token prompt with a budget of 8 tokens and 3 output tokens: chunks of 8 and 2 (the second
    samples), then 2 decodes; the trace has exactly those 4 steps."""
    path = tmp_path / "trace.jsonl"
    eng = AsyncEngine.from_engine_args(_args(tiny_model), step_trace=str(path))

    try:
        outs = asyncio.run(_collect(eng, SamplingParams(max_tokens=3, ignore_eos=True)))
    finally:
        eng.shutdown()
    assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 3  # delta outputs
    steps = read_step_trace(path)
    shapes = [(s.shape.num_tokens, s.shape.num_sampled, s.shape.attention_pairs, s.shape.kv_tokens_read)
              for s in steps]
    # pairs: n*c + n(n+1)/2 -> 36, 2*8+3 = 19, 11, 12; KV read: c + n
    assert shapes == [(8, 0, 36, 8), (2, 1, 19, 10), (1, 1, 11, 11), (1, 1, 12, 12)]
    assert all(s.cycle_s >= s.step_s > 0 for s in steps)
    # back-to-back cycles tile the time line: each starts where the previous one ended
    for a, b in zip(steps[1:], steps[2:]):
        assert b.t == pytest.approx(a.t + a.cycle_s, abs=2e-6)
    assert steps[0].after_idle and not any(s.after_idle for s in steps[1:])
    assert [s.t for s in steps] == sorted(s.t for s in steps)


@pytest.mark.parametrize("field, value", [("block_size", 0), ("num_blocks", 0), ("max_num_seqs", -1),
                                          ("max_num_batched_tokens", 1.5), ("kv_cache_memory", 0),
                                          ("max_model_len", 0), ("num_threads", 0),
                                          ("log_stats_interval", -1.0)])
def test_engine_args_reject_bad_sizes(field, value):
    """Caught before the model loads, with the flag's name (a block size of 0 used to divide by zero)."""
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value})


def test_read_step_trace_names_the_bad_line(tmp_path):
    good = {"t": 0.0, "cycle_s": 0.02, "step_s": 0.019, "after_idle": False, "tokens": 1, "sampled": 1,
            "attention_pairs": 5, "kv_tokens_read": 5, "seqs": 1}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "tokens": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not a step-trace line"):
        read_step_trace(path)
    with pytest.raises(ValueError, match="cannot read step trace"):
        read_step_trace(tmp_path / "missing.jsonl")


def test_serving_process_settings():
    """glibc keeps freed memory (no page faults per step) and startup objects leave the GC's view."""
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert retain_freed_memory() is True
    try:
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() > 10_000  # modules, torch, the test session
    finally:
        gc.unfreeze()
