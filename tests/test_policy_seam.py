"""The scheduling policy is a seam (issue 30): the scheduler asks its policy at the named points of
:class:`~goodserve.scheduler.policy.StepPolicy` only and imports no policy by name, and a policy's
decisions are pure: asking it anything writes nothing, neither on the requests nor on the policy, so the
order of the calls inside a step is not load-bearing. The static checks read the sources with ``ast``, like
``test_layering.py``."""

from __future__ import annotations

import ast
import math
import pickle

import pytest

from goodserve.request import Request
from goodserve.request_options import RequestOptions
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.policy import FCFSPolicy, PriorityPolicy, StepPolicy, create_policy
from goodserve.scheduler.slo import SLOPolicy
from goodserve.scheduler.step_time import StepCoefficients, StepTimeModel
from test_kv_connector_seam import _connector_calls
from test_layering import SRC, imported_modules

NAMED_POINTS = {"make_queue", "running_key", "check_arrival", "triage", "plan", "chunk_size", "may_admit"}
SCHEDULER_FILES = ("scheduler.py", "baselines.py", "remote_kv.py", "runner_diffs.py")


@pytest.mark.parametrize("name", SCHEDULER_FILES)
def test_the_scheduler_imports_no_policy_by_name(name):
    names = imported_modules(SRC / "scheduler" / name)
    concrete = ("goodserve.scheduler.slo", "goodserve.scheduler.queue.FCFSQueue",
                "goodserve.scheduler.queue.SortedQueue", "goodserve.scheduler.policy.FCFSPolicy",
                "goodserve.scheduler.policy.PriorityPolicy")
    assert not {n for n in names if n.startswith(concrete)}


def test_the_scheduler_asks_its_policy_only_at_the_named_points():
    used = set().union(*(_connector_calls(SRC / "scheduler" / f, "policy") for f in SCHEDULER_FILES))
    assert used and used <= NAMED_POINTS, used - NAMED_POINTS
    assert {n for n in NAMED_POINTS if n != "running_key"} <= set(vars(StepPolicy))


@pytest.mark.parametrize("name", ["policy.py", "slo.py", "slo_pace.py"])
def test_a_policy_writes_no_state_of_its_own_after_construction(name):
    """No ``self.x = ...`` outside ``__init__`` in the policies' sources."""
    tree = ast.parse((SRC / "scheduler" / name).read_text())
    writes = []
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
        for node in ast.walk(func):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"{func.name}: self.{t.attr}" for t in targets
                       if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                       and func.name not in ("add", "add_chunk")]  # StepTally: the scheduler's tally of a step
    assert not writes


def _request(rid: str, prompt: int, arrival: float, **slos) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=8), arrival, max_tokens=8,
                   options=RequestOptions(**slos))


def _decoding(rid: str, slo_tpot: float, streamed: int) -> Request:
    r = _request(rid, 3, 0.0, slo_tpot=slo_tpot)
    r.first_token_time = 0.01
    for _ in range(streamed):
        r.append_output_token(7)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_asking_the_slo_policy_anything_writes_nothing():
    """Every named point of the ``slo`` policy, on a mix of decodes and prompts (some late, some urgent, with
    decodes to defer), leaves every request and the policy as they were."""
    model = StepTimeModel(StepCoefficients(0.01, 0.001, 0.005, 0.0), adapt=False)
    policy = SLOPolicy(model, 100, 4, shed_load=True)
    running = [_decoding("I", 0.0605, 1)] + [_decoding(f"B{i}", 0.3, 1) for i in range(4)]
    waiting = [_request("P", 78, 0.05, slo_ttft=0.2, slo_tpot=0.0605),
               _request("Q", 300, 0.05, slo_ttft=0.5, slo_tpot=0.0605), _request("N", 20, 0.05)]
    before = pickle.dumps((policy, running, waiting))
    triage = policy.triage(waiting, running, 0.06)
    assert triage.deferred and [r.request_id for r, _ in triage.late] == ["Q"]
    plan = policy.plan(running, 0.06, triage)
    tally = plan.tally()
    assert policy.chunk_size(plan, tally, waiting[0], 0, 78, True) > 0
    policy.may_admit(plan, waiting[2], running)
    policy.queue_key(waiting[0])
    with pytest.raises(Exception, match="TTFT SLO"):
        policy.check_arrival(_request("X", 500, 0.06, slo_ttft=0.05), waiting, running, 0.06)
    sorted(running, key=lambda r: plan.rank[r.request_id])
    assert pickle.dumps((policy, running, waiting)) == before
    # Asked twice, the same answers: nothing left behind changes them.
    assert policy.triage(waiting, running, 0.06) == triage
    again = policy.plan(running, 0.06, triage)
    assert (again.tpot_limit, again.borrow_limit, again.figures, again.rank) == \
        (plan.tpot_limit, plan.borrow_limit, plan.figures, plan.rank)


def test_create_policy_builds_each_policy_behind_the_protocol():
    model = StepTimeModel()
    for name, cls in (("fcfs", FCFSPolicy), ("priority", PriorityPolicy), ("slo", SLOPolicy)):
        policy = create_policy(name, model, 64, 4)
        assert isinstance(policy, cls) and isinstance(policy, StepPolicy) and policy.name == name
    fcfs = create_policy("fcfs", model, 64, 4)
    plan = fcfs.plan([], 0.0)
    assert plan.rank is None and fcfs.chunk_size(plan, plan.tally(), _request("r", 10, 0.0), 0, 7, False) == 7
    assert fcfs.triage([], [], 0.0).late == () and math.isinf(float("inf"))
