"""Scheduler CPU time per step (schedule + update_from_output), 64 decoding requests, no model."""
import sys, time
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.request import Request
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SampledToken
from goodserve.scheduler.scheduler import Scheduler
from goodserve.scheduler.step_time import StepCoefficients, StepTimeModel
try:
    from goodserve.request_options import RequestOptions
except ImportError:
    RequestOptions = None

def req(i, policy):
    p = SamplingParams(max_tokens=100000, ignore_eos=True)
    kw = {}
    if policy == "slo":
        if RequestOptions: kw = {"options": RequestOptions(slo_ttft=5.0, slo_tpot=0.5)}
        else: kw = {"slo_ttft": 5.0, "slo_tpot": 0.5}
    return Request(f"r{i}", list(range(100 + i, 164 + i)), p, 0.0, max_tokens=100000, **kw)

for policy in ("fcfs", "slo"):
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=128, max_model_len=200000, policy=policy),
                  CacheConfig(num_blocks=20000, block_size=16), StepTimeModel(StepCoefficients(0.01, 1e-4, 1e-4, 0.0), adapt=False))
    for i in range(64):
        s.add_request(req(i, policy))
    now = 0.0
    for k in range(2200):
        if k == 200: t0 = time.perf_counter()
        out = s.schedule(now)
        now += 0.02
        s.update_from_output(out, {x.request_id: SampledToken(7) for x in out.scheduled if x.sample}, now)
    dt = (time.perf_counter() - t0) / 2000
    print(f"{policy}: {dt * 1e6:.0f} us per step (64 decodes)")
