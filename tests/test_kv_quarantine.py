"""A READ given up while it may still write never frees the blocks it writes into (consumer quarantine).

A consumer fails a pull past its deadline, or gives up an aborted one, while NIXL may still be writing the
producer's bytes into the request's blocks. Freed then, those blocks would go to another request whose K/V
the late bytes overwrite. So the request fails at once and its blocks stay out of the pool, counted as
quarantined and in use, until the transport says the transfer ended. Checked on the scheduler half with
hand-made transport news, and between two NIXL connectors in one process with a READ that NIXL reports as
running (``check_xfer_state`` held at ``"PROC"``) until the test lets it end.
"""

from __future__ import annotations

import threading
import time

import pytest

from goodserve import SamplingParams
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_transfer import KVConnectorOutput, KVTransferConfig, KVTransferParams
from goodserve.kv_transfer.factory import create_connector_scheduler
from goodserve.kv_transfer.lease import LeaseTable
from goodserve.request_options import RequestOptions
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import SampledToken, SchedulerStats
from goodserve.scheduler.scheduler import Scheduler

BS = 4
LATE = "pulling the prompt's KV cache from producer p0 (127.0.0.1:5555) failed: the transfer did not finish within 5 s"


def _scheduler(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(num_blocks=num_blocks, block_size=BS),
                     kv_connector=create_connector_scheduler(
                         KVTransferConfig("consumer", engine_id="c0", timeout=5.0), BS))


def _handle(rid: str = "r", port: int = 5555, lease: str = "0" * 32, engine: str = "p0") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": engine, "remote_host": "127.0.0.1", "remote_port": port,
            "remote_block_ids": [5, 6, 7], "remote_request_id": rid, "remote_num_tokens": 10, "remote_lease": lease}


def _request(rid: str, n: int, kv: dict | None = None, first: int = 100) -> Request:
    params = None if kv is None else KVTransferParams.from_dict(kv)
    return Request(rid, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                   0.0, options=RequestOptions(kv_transfer_params=params))


def _step(s: Scheduler, now: float, kv_output: KVConnectorOutput | None = None):
    out = s.schedule(now)
    return out, s.update_from_output(out, {r.request_id: SampledToken(7) for r in out.sampling()}, now, kv_output)


def _check(s: Scheduler, free: int, quarantined: int) -> None:
    kv = s.kv_cache_manager
    kv.check_integrity()
    assert (kv.num_free_blocks, s.make_stats().num_kv_blocks_quarantined) == (free, quarantined)


# ------------------------------------------------------------------------ the scheduler half, by hand
def test_a_late_pull_fails_at_once_and_its_blocks_wait_for_the_read_to_end():
    s = _scheduler()
    s.add_request(_request("c", 10, _handle()))
    out, _ = _step(s, 1.0)
    assert [(sp.request_id, sp.block_ids) for sp in out.kv_loads] == [("c", [0, 1, 2])]
    _check(s, 13, 0)
    _, outs = _step(s, 6.0, KVConnectorOutput(failed_recving={"c": LATE}, still_writing=["c"]))
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [("c", "error", LATE)]
    st = s.make_stats()
    assert (st.num_kv_transfer_failures_total, st.num_kv_transfers_in_flight) == (1, 0)
    assert not s.has_unfinished_requests() and s.has_pending_kv_transfers()  # the engine keeps polling
    _check(s, 13, 3)
    # The pool's 13 other blocks go to the next request; c's three do not.
    s.add_request(_request("d", 52, first=500))
    out, _ = _step(s, 6.1)
    (sr,) = out.scheduled
    assert sr.new_block_ids == list(range(3, 16))
    _check(s, 13, 3)  # d finished at its first token and freed its 13 blocks
    _step(s, 6.2, KVConnectorOutput(done_writing=["c"]))
    _check(s, 16, 0)
    assert not s.has_pending_kv_transfers()
    assert s.kv_cache_manager.get_computed_blocks(_request("x", 10))[1] == 0  # nothing of the late READ is cached


def test_an_abort_during_a_read_past_its_deadline_keeps_the_blocks_until_the_read_ends():
    s = _scheduler()
    s.add_request(_request("c", 10, _handle()))
    _step(s, 1.0)
    assert s.finish_requests("c", RequestStatus.FINISHED_ABORTED) == ["c"]
    out, _ = _step(s, 1.1)
    assert out.kv_cancels == ["c"]
    _check(s, 13, 0)
    _, outs = _step(s, 6.0, KVConnectorOutput(failed_recving={"c": LATE}, still_writing=["c"]))
    assert outs == []  # an aborted request has no answer to fail
    st = s.make_stats()
    assert (st.num_kv_transfer_failures_total, st.num_kv_transfers_in_flight) == (0, 0)
    _check(s, 13, 3)
    _step(s, 6.5)
    _check(s, 13, 3)
    _step(s, 7.0, KVConnectorOutput(done_writing=["c"]))
    _check(s, 16, 0)
    assert not s.has_pending_kv_transfers()


def test_a_read_that_ends_within_the_same_news_frees_at_once_and_stray_news_is_ignored():
    s = _scheduler()
    s.add_request(_request("c", 10, _handle()))
    _step(s, 1.0)
    _, outs = _step(s, 6.0, KVConnectorOutput(failed_recving={"c": LATE}, still_writing=["c"], done_writing=["c"]))
    assert [o.error for o in outs] == [LATE]
    _check(s, 16, 0)
    _step(s, 6.1, KVConnectorOutput(done_writing=["c", "unknown"]))
    _check(s, 16, 0)
    assert not s.has_pending_kv_transfers()


def test_quarantined_blocks_are_a_gauge_on_metrics():
    from goodserve.server.metrics import _EngineCollector

    class _Engine:
        stats = SchedulerStats(0, 0, 0, 0.25, 0, 0, 0, num_kv_blocks_quarantined=3)

        @staticmethod
        def is_healthy() -> bool:
            return True

    (m,) = [m for m in _EngineCollector(_Engine()).collect() if m.name == "goodserve:kv_transfer_blocks_quarantined"]
    assert (m.type, [s.value for s in m.samples]) == ("gauge", [3.0])


# ------------------------------------------------ NIXL: a READ that NIXL reports running past its deadline
class _SlowReads:
    """Holds NIXL's reported state of every READ at ``"PROC"`` while :attr:`running` is set."""

    def __init__(self, agent) -> None:
        self.running = threading.Event()
        self.running.set()
        self._real = agent.check_xfer_state
        agent.check_xfer_state = self

    def __call__(self, handle) -> str:
        return "PROC" if self.running.is_set() else self._real(handle)


@pytest.fixture(scope="module")
def producer():
    torch = pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from goodserve.kv_transfer.nixl_connector import NixlConnector

    leases = LeaseTable(30.0)
    caches = [(torch.ones(8, BS, 2, 8), torch.ones(8, BS, 2, 8)) for _ in range(2)]
    p = NixlConnector(KVTransferConfig("producer", engine_id="quarantine-p", timeout=30.0), caches, leases)
    yield p, leases
    p.close()


def _consumer(name: str):
    import torch

    from goodserve.kv_transfer.nixl_connector import NixlConnector

    caches = [(torch.zeros(16, BS, 2, 8), torch.zeros(16, BS, 2, 8)) for _ in range(2)]
    return NixlConnector(KVTransferConfig("consumer", engine_id=name, timeout=0.5), caches)


def _engine_step(s: Scheduler, worker, kv_outputs: list[KVConnectorOutput]):
    """One engine-core step (schedule, hand the connector its loads and cancels, poll, update)."""
    out = s.schedule(time.monotonic())
    worker.cancel_loads(out.kv_cancels)
    worker.start_loads(out.kv_loads)
    kv_output = worker.poll()
    kv_outputs.append(kv_output)
    return s.update_from_output(out, {}, time.monotonic(), kv_output)


def _start_pull(s: Scheduler, worker, producer, rid: str) -> tuple[list[KVConnectorOutput], float]:
    """Admit a request pulling ``rid``'s hold and step until its READ is posted."""
    p, leases = producer
    lease = leases.grant(rid, [5, 6, 7], 10, time.monotonic())
    s.add_request(_request(f"c-{rid}", 10, _handle(rid, p.port, lease.nonce, "quarantine-p")))
    news: list[KVConnectorOutput] = []
    start = time.monotonic()
    while (load := worker._loads.get(f"c-{rid}")) is None or load.handle is None:
        assert _engine_step(s, worker, news) == [] and time.monotonic() - start < 5.0
        time.sleep(0.005)
    return news, start


def _until(s: Scheduler, worker, news: list, done) -> list:
    deadline = time.monotonic() + 5.0
    while not (outs := _engine_step(s, worker, news)) and not done():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return outs


def _holds_ended(s: Scheduler, worker, news: list, leases: LeaseTable) -> list[tuple[str, str]]:
    """Step until the producer's lease table has ended holds (the consumer's release has landed)."""
    deadline = time.monotonic() + 5.0
    while not (ended := leases.take_ended()):
        assert time.monotonic() < deadline
        _engine_step(s, worker, news)
        time.sleep(0.005)
    return ended


def test_nixl_a_read_past_the_deadline_fails_the_request_at_once_and_frees_its_blocks_when_it_ends(producer):
    leases = producer[1]
    s, worker = _scheduler(), _consumer("quarantine-c1")
    slow = _SlowReads(worker.agent)
    try:
        news, start = _start_pull(s, worker, producer, "late")
        _check(s, 13, 0)
        (out,) = _until(s, worker, news, lambda: False)
        assert time.monotonic() - start < 2.0  # at the 0.5 s deadline, not when the READ ends
        assert (out.request_id, out.finish_reason) == ("c-late", "error")
        assert out.error == ("pulling the prompt's KV cache from producer quarantine-p (127.0.0.1:"
                             f"{producer[0].port}) failed: the transfer did not finish within 0.5 s")
        assert news[-1].still_writing == ["c-late"] and news[-1].done_writing == []
        _check(s, 13, 3)
        assert _holds_ended(s, worker, news, leases) == [("late", "failed")]  # as it did before
        for _ in range(3):  # NIXL still says the READ runs: the blocks stay out of the pool
            _engine_step(s, worker, news)
            _check(s, 13, 3)
        slow.running.clear()
        _engine_step(s, worker, news)
        assert news[-1].done_writing == ["c-late"]
        _check(s, 16, 0)
        assert not s.has_pending_kv_transfers() and worker._writing == {}
    finally:
        slow.running.clear()
        worker.close()


def test_nixl_an_abort_mid_read_keeps_the_blocks_past_the_deadline_until_the_read_ends(producer):
    _, leases = producer
    s, worker = _scheduler(), _consumer("quarantine-c2")
    slow = _SlowReads(worker.agent)
    try:
        news, _ = _start_pull(s, worker, producer, "gone")
        assert s.finish_requests("c-gone", RequestStatus.FINISHED_ABORTED) == ["c-gone"]
        _check(s, 13, 0)
        assert _until(s, worker, news, lambda: s.make_stats().num_kv_blocks_quarantined) == []
        assert s.make_stats().num_kv_transfers_in_flight == 0
        _check(s, 13, 3)
        assert _holds_ended(s, worker, news, leases) == [("gone", "aborted")]
        _check(s, 13, 3)
        slow.running.clear()
        _engine_step(s, worker, news)
        _check(s, 16, 0)
        assert not s.has_pending_kv_transfers()
    finally:
        slow.running.clear()
        worker.close()


def test_nixl_close_keeps_the_memory_registered_until_a_running_read_ends(producer, monkeypatch):
    from goodserve.kv_transfer import nixl_connector

    monkeypatch.setattr(nixl_connector, "CLOSE_WAIT_S", 0.1)
    s, worker = _scheduler(), _consumer("quarantine-c3")
    slow = _SlowReads(worker.agent)
    deregistered = []
    real = worker.agent.deregister_memory
    worker.agent.deregister_memory = lambda reg: deregistered.append(reg) or real(reg)
    _start_pull(s, worker, producer, "shutdown")
    begin = time.monotonic()
    worker.close()
    assert time.monotonic() - begin < 1.0 and deregistered == [] and worker._progress.is_alive()
    time.sleep(0.05)
    assert deregistered == []  # NIXL still says the READ runs
    slow.running.clear()
    worker._progress.join(5.0)
    assert not worker._progress.is_alive() and deregistered == [worker._reg]
    producer[1].drop("shutdown", "aborted")
    producer[1].take_ended()
