"""The step contract can cross a process boundary, and the scheduler is the only writer of a request.

* The runner works from the ``SchedulerOutput`` message alone: the message holds plain data only (no
  ``Request`` reachable from it), and an engine whose runner gets a pickled round trip of every message
  produces exactly the tokens of one that gets the message itself, through chunked prefill, prefix hits and
  preemption.
* Nothing outside ``goodserve/scheduler/`` changes a ``Request`` once it is built, whatever happens to it
  (stop strings, stop tokens, aborts, preemption, a failing sampler row).
* ``goodserve.scheduler``, ``goodserve.kv_cache``, ``goodserve.sim`` and ``goodserve.workload`` import without
  torch (checked in a fresh interpreter).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import subprocess
import sys
import traceback

import pytest

from goodserve.llm import LLM
from goodserve.request import Request
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SchedulerOutput
from tiny_models import make_tiny_hf_model

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")


def make_llm(model: str) -> LLM:
    # A small pool and budget: chunked prefill, prefix hits and preemption all happen.
    return LLM(model, dtype="float32", num_blocks=24, block_size=4, max_num_batched_tokens=16,
               max_model_len=96, log_stats_interval=0)


PROMPTS = [[100 + i] * 3 + list(range(200, 200 + 20 + 3 * i)) for i in range(6)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)]


def run(llm: LLM) -> list[list[int]]:
    params = [PARAMS[i % 2] for i in range(len(PROMPTS))]
    return [o.token_ids for o in llm.generate(PROMPTS + PROMPTS[:2], params + params[:2], use_tqdm=False)]


def plain(value, path: str = "out") -> None:
    """Assert ``value`` is plain data all the way down: no live object such as a ``Request``."""
    assert not isinstance(value, Request), f"{path} is a live Request"
    if isinstance(value, (str, int, float, bool, type(None), enum.Enum)):
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            plain(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            plain(k, f"{path} key")
            plain(v, f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            plain(getattr(value, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path} holds a {type(value).__name__}, not plain data")


def test_runner_works_from_the_message_alone(tiny_model):
    direct = make_llm(tiny_model)
    expected = run(direct)
    assert direct.engine.make_stats().num_preemptions_total > 0  # the run exercised resumes

    llm = make_llm(tiny_model)
    runner = llm.engine.core.runner
    real_execute = runner.execute
    messages: list[SchedulerOutput] = []

    def through_a_pipe(out: SchedulerOutput):
        plain(out)
        copy = pickle.loads(pickle.dumps(out))
        messages.append(copy)
        return pickle.loads(pickle.dumps(real_execute(copy)))

    runner.execute = through_a_pipe
    assert run(llm) == expected
    assert any(s.resumed_from_preemption for m in messages for s in m.scheduled)
    assert any(m.new_requests for m in messages) and any(m.finished_req_ids for m in messages)
    llm.engine.step()  # an empty step still tells the runner which requests finished last
    assert not runner.requests


def test_only_the_scheduler_writes_a_request(tiny_model, monkeypatch):
    writers: set[str] = set()
    real_setattr = Request.__setattr__
    real_append = Request.append_output_token

    def writer() -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if not frame.filename.endswith("request.py"):
                return frame.filename
        return "request.py"

    def setattr_(self, name, value):
        caller = sys._getframe(1).f_code
        if not (caller.co_name == "__init__" and caller.co_filename.endswith("request.py")):  # built: a mutation
            writers.add(writer())
        real_setattr(self, name, value)

    def append(self, token_id):
        writers.add(writer())
        real_append(self, token_id)

    monkeypatch.setattr(Request, "__setattr__", setattr_)
    monkeypatch.setattr(Request, "append_output_token", append)
    llm = make_llm(tiny_model)
    run(llm)  # chunking, prefix hits, preemption, length
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, stop=[" "], stop_token_ids=[9]),
                 use_tqdm=False)  # stop strings and stop tokens
    engine = llm.engine
    rid = engine.add_request([8, 9, 10], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(rid)
    assert writers and all(os.sep + os.path.join("goodserve", "scheduler") + os.sep in w for w in writers), writers


def test_torch_free_packages_import_without_torch():
    code = ("import importlib, pkgutil, sys\n"
            "import goodserve.scheduler, goodserve.kv_cache, goodserve.sim, goodserve.workload\n"
            "for pkg in (goodserve.scheduler, goodserve.kv_cache, goodserve.sim, goodserve.workload):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "from goodserve import SamplingParams\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
