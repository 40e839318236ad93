"""A READ given up while it may still write never frees the blocks it writes into (consumer quarantine).

A consumer fails a pull past its deadline, or gives up an aborted one, while NIXL may still be writing the
producer's bytes into the request's blocks. Freed then, those blocks would go to another request whose K/V
the late bytes overwrite. So the request fails at once and its blocks stay out of the pool, counted as
quarantined and in use, until the transport says the transfer ended. Checked on the scheduler half with
hand-made transport news.
"""

from __future__ import annotations

from goodserve import SamplingParams
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_transfer import KVConnectorOutput, KVTransferConfig, KVTransferParams
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import SampledToken, SchedulerStats
from goodserve.scheduler.scheduler import Scheduler

BS = 4
LATE = "pulling the prompt's KV cache from producer p0 (127.0.0.1:5555) failed: the transfer did not finish within 5 s"


def _scheduler(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(num_blocks=num_blocks, block_size=BS),
                     kv_transfer=KVTransferConfig("consumer", engine_id="c0", timeout=5.0))


def _handle(rid: str = "r", port: int = 5555, lease: str = "0" * 32, engine: str = "p0") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": engine, "remote_host": "127.0.0.1", "remote_port": port,
            "remote_block_ids": [5, 6, 7], "remote_request_id": rid, "remote_num_tokens": 10, "remote_lease": lease}


def _request(rid: str, n: int, kv: dict | None = None, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                   0.0, kv_transfer_params=None if kv is None else KVTransferParams.from_dict(kv))


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
