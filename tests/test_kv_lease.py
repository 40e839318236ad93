"""A KV handle is a lease (C20): the producer's lease table, its side-channel answers, the scheduler half's
holds, and the NIXL worker's claim / read / release between two connectors in one process.

Times are hand-made (``now`` is an argument everywhere), so expiry and pins are checked to the exact second.
"""

from __future__ import annotations

import threading
import time

import pytest

from goodserve import SamplingParams
from goodserve.config import CacheConfig, SchedulerConfig
from goodserve.kv_transfer import KVConnectorOutput, KVLoadSpec, KVTransferConfig, KVTransferParams
from goodserve.kv_transfer.factory import create_connector_scheduler
from goodserve.kv_transfer.lease import LeaseError, LeaseTable
from goodserve.kv_transfer.side_channel import answer
from goodserve.request_options import RequestOptions
from goodserve.request import Request, RequestStatus
from goodserve.scheduler.output import SampledToken
from goodserve.scheduler.scheduler import Scheduler
from goodserve.validation import ParamError

BS = 4


def _table(ttl: float = 2.0, pin_ttl: float = 3.0) -> LeaseTable:
    nonces = iter(f"n{i}" for i in range(100))
    return LeaseTable(ttl, pin_ttl, make_nonce=lambda: next(nonces))


# ------------------------------------------------------------------------------------------ lease table
def test_lease_unclaimed_expires_at_its_deadline():
    t = _table()
    lease = t.grant("a", [3, 4], 7, now=10.0)
    assert (lease.request_id, lease.block_ids, lease.num_tokens, lease.nonce) == ("a", (3, 4), 7, "n0")
    assert t.expire(11.99) == [] and "a" in t
    assert t.expire(12.0) == ["a"] and "a" not in t
    assert t.take_ended() == [("a", "expired")] and t.take_ended() == []
    assert t.counts() == {"pulled": 0, "aborted": 0, "failed": 0, "expired": 1}


def test_a_claim_pins_the_hold_past_its_deadline_until_the_pin_ends():
    t = _table(ttl=2.0, pin_ttl=3.0)
    t.grant("a", [3, 4], 7, now=10.0)
    assert t.claim("a", "n0", [3, 4], now=11.5) == 3.0 and t.is_pinned("a")
    assert t.expire(12.0) == [] and t.expire(14.49) == []  # deadline 12 passed, pinned until 14.5
    assert t.expire(14.5) == ["a"]
    assert t.take_ended() == [("a", "expired")]


def test_release_after_the_pull_ends_the_hold_and_a_late_claim_is_told_why():
    t = _table()
    t.grant("a", [3, 4], 7, now=0.0)
    t.claim("a", "n0", (3, 4), now=0.5)
    t.release("a", "n0", "pulled", now=0.6)
    assert t.take_ended() == [("a", "pulled")] and len(t) == 0
    with pytest.raises(LeaseError, match=r"hold of request a was released \(pulled\)"):
        t.claim("a", "n0", [3, 4], now=0.7)
    with pytest.raises(LeaseError, match="does not match"):
        t.claim("a", "forged", [3, 4], now=0.7)
    t.grant("b", [5], 3, now=0.0)
    t.expire(5.0)
    with pytest.raises(LeaseError, match="hold of request b expired: nobody pulled it in time; its blocks may "
                                         "belong to another request now"):
        t.claim("b", "n1", [5], now=5.0)
    assert t.counts() == {"pulled": 1, "aborted": 0, "failed": 0, "expired": 1}


@pytest.mark.parametrize("rid, nonce, blocks, match", [
    ("zz", "n0", [3, 4], "no KV hold of request zz on this producer"),
    ("a", "n9", [3, 4], "does not match the KV hold of request a"),
    ("a", "n0", [4, 3], r"names blocks \[4, 3\] but request a holds \[3, 4\]"),
    ("a", "n0", [3], r"names blocks \[3\] but request a holds \[3, 4\]"),
])
def test_a_stale_or_forged_claim_is_refused_and_the_hold_stays_live(rid, nonce, blocks, match):
    t = _table()
    t.grant("a", [3, 4], 7, now=0.0)
    with pytest.raises(LeaseError, match=match):
        t.claim(rid, nonce, blocks, now=1.0)
    assert "a" in t and not t.is_pinned("a") and t.take_ended() == []
    assert t.claim("a", "n0", [3, 4], now=1.0) == 3.0  # the real handle still works


def test_a_claim_past_the_deadline_ends_the_hold_as_expired():
    t = _table()
    t.grant("a", [3], 2, now=0.0)
    with pytest.raises(LeaseError, match="expired: nobody pulled it within 2 s"):
        t.claim("a", "n0", [3], now=2.0)
    assert t.take_ended() == [("a", "expired")]


def test_a_handle_serves_one_pull_and_revoke_waits_for_a_running_one():
    t = _table()
    t.grant("a", [3], 2, now=0.0)
    t.grant("b", [4], 2, now=0.0)
    t.claim("a", "n0", [3], now=0.1)
    with pytest.raises(LeaseError, match="already being pulled"):
        t.claim("a", "n0", [3], now=0.2)
    assert t.revoke("a", "n0", None, now=0.3) is False and "a" in t  # a read may be running
    assert t.revoke("b", "n1", (4,), now=0.3) is True and "b" not in t
    with pytest.raises(LeaseError):
        t.revoke("b", "n1", None, now=0.4)
    t.release("a", "n0", "aborted", now=0.5)
    assert t.take_ended() == [("b", "aborted"), ("a", "aborted")]
    with pytest.raises(ValueError, match="release reason"):
        t.release("x", "n0", "expired", now=0.0)
    t.grant("c", [1], 1, now=0.0)
    with pytest.raises(RuntimeError, match="already holds"):
        t.grant("c", [1], 1, now=0.0)


def test_concurrent_claims_pin_once():
    t = _table()
    t.grant("a", [3], 2, now=0.0)
    wins, barrier = [], threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        try:
            t.claim("a", "n0", [3], now=0.5)
            wins.append(1)
        except LeaseError:
            pass

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert wins == [1]


def test_side_channel_answers():
    t = _table()
    t.grant("a", [3, 4], 7, now=0.0)
    layout = {"layout": {"x": 1}, "metadata": "m"}
    claim = {"op": "claim", "engine_id": "p0", "request_id": "a", "lease": "n0", "block_ids": [3, 4]}
    assert answer({**claim, "engine_id": "p1"}, "p0", t, layout, 0.1) == {
        "ok": False, "error": "this side channel is producer p0, not p1"}
    assert answer(claim, "p0", None, layout, 0.1)["error"] == "instance p0 is not a producer: it holds no KV for pulls"
    assert answer({"op": "steal"}, "p0", t, layout, 0.1) == {"ok": False, "error": "unknown side-channel message"}
    assert answer({"op": "claim", "request_id": "a"}, "p0", t, layout, 0.1)["error"].startswith("bad message")
    assert answer({**claim, "lease": "x"}, "p0", t, layout, 0.1)["ok"] is False
    assert answer({**claim, "layout": True}, "p0", t, layout, 0.1) == {"ok": True, "pin_s": 3.0, **layout}
    release = {"op": "release", "engine_id": "p0", "request_id": "a", "lease": "n0", "reason": "pulled"}
    assert answer(release, "p0", t, layout, 0.2) == {"ok": True}
    assert t.take_ended() == [("a", "pulled")]


# --------------------------------------------------------------------------------- the scheduler half
def _scheduler(role: str, timeout: float = 5.0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(num_blocks=16, block_size=BS),
                     kv_connector=create_connector_scheduler(
                         KVTransferConfig(role, engine_id="p0", port=5555, timeout=timeout), BS))


def _request(rid: str, n: int, kv: dict) -> Request:
    return Request(rid, list(range(n)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), 0.0,
                   options=RequestOptions(kv_transfer_params=KVTransferParams.from_dict(kv)))


def _step(s: Scheduler, now: float, kv_output: KVConnectorOutput | None = None):
    out = s.schedule(now)
    return out, s.update_from_output(out, {r.request_id: SampledToken(7) for r in out.sampling()}, now, kv_output)


def _held(s: Scheduler) -> dict:
    """The producer's handles by request id, after one step of two held prefills."""
    s.add_request(_request("a", 10, {"do_remote_decode": True}))
    s.add_request(_request("b", 6, {"do_remote_decode": True}))
    _, outs = _step(s, 1.0)
    return {o.request_id: KVTransferParams.from_dict(o.kv_transfer_params) for o in outs}


def test_producer_release_frees_a_hold_at_once_and_counts_an_abort_not_a_timeout():
    s = _scheduler("producer")
    h = _held(s)
    assert s.make_stats().num_blocks_held_for_pull == 5
    forged = KVTransferParams(**{**h["a"].__dict__, "remote_lease": "0" * 32})
    with pytest.raises(LookupError, match="does not match"):
        s.release_kv_hold(forged, 1.5)
    assert s.make_stats().num_blocks_held_for_pull == 5
    assert s.release_kv_hold(h["a"], 1.5) is True
    st = s.make_stats()
    assert st.num_blocks_held_for_pull == 2 and s.kv_cache_manager.num_free_blocks == 14
    assert st.num_kv_holds_ended_total == {"pulled": 0, "aborted": 1, "failed": 0, "expired": 0}
    assert st.num_kv_transfer_timeouts_total == 0
    with pytest.raises(LookupError, match=r"was released \(aborted\)"):
        s.release_kv_hold(h["a"], 1.6)
    _step(s, 6.0)  # b's hold expires at 1.0 + 5.0
    st = s.make_stats()
    assert st.num_kv_holds_ended_total == {"pulled": 0, "aborted": 1, "failed": 0, "expired": 1}
    assert st.num_kv_transfer_timeouts_total == 1 and s.kv_cache_manager.num_free_blocks == 16
    s.kv_cache_manager.check_integrity()


def test_producer_hold_claimed_by_a_pull_outlives_its_deadline_until_released():
    s = _scheduler("producer", timeout=5.0)
    h = _held(s)
    leases = s.kv_connector.leases
    assert leases.claim("a", h["a"].remote_lease, h["a"].remote_block_ids, now=5.5) == 5.0  # pinned to 10.5
    assert s.release_kv_hold(h["a"], 5.6) is False  # a pull is reading it: not freed under it
    _step(s, 6.0)
    assert s.make_stats().num_blocks_held_for_pull == 3  # b expired at 6.0, a is pinned
    leases.release("a", h["a"].remote_lease, "pulled", now=6.5)
    _step(s, 6.6)
    st = s.make_stats()
    assert st.num_blocks_held_for_pull == 0 and s.kv_cache_manager.num_free_blocks == 16
    assert st.num_kv_holds_ended_total == {"pulled": 1, "aborted": 0, "failed": 0, "expired": 1}


def test_release_on_an_instance_without_a_connector_is_refused():
    s = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(16, BS))
    with pytest.raises(ParamError, match="holds no KV for pulls"):
        s.release_kv_hold(KVTransferParams(do_remote_prefill=True), 0.0)


def test_consumer_abort_during_a_pull_asks_the_worker_to_give_it_up():
    s = _scheduler("consumer")
    handle = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1", "remote_port": 5555,
              "remote_block_ids": [5, 6, 7], "remote_request_id": "r", "remote_num_tokens": 10, "remote_lease": "n"}
    s.add_request(_request("c", 10, handle))
    out, _ = _step(s, 1.0)
    assert [sp.request_id for sp in out.kv_loads] == ["c"] and out.kv_cancels == []
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    out, _ = _step(s, 1.1)
    assert out.kv_cancels == ["c"] and s.kv_cache_manager.num_free_blocks == 13  # still being written
    _, outs = _step(s, 1.2, KVConnectorOutput(failed_recving={"c": "aborted"}))
    st = s.make_stats()
    assert outs == [] and st.num_kv_transfer_failures_total == 0 and st.num_kv_transfers_in_flight == 0
    assert s.kv_cache_manager.num_free_blocks == 16 and not s.has_pending_kv_transfers()


# -------------------------------------------------------------------- NIXL: two connectors, one process
@pytest.fixture(scope="module")
def pair():
    torch = pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from goodserve.kv_transfer.nixl_connector import NixlConnector

    def caches(seed: int):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(8, BS, 2, 8, generator=g), torch.randn(8, BS, 2, 8, generator=g)) for _ in range(2)]

    leases = LeaseTable(3.0)
    p_caches, c_caches = caches(0), caches(1)
    producer = NixlConnector(KVTransferConfig("producer", engine_id="lease-p", timeout=3.0), p_caches, leases)
    consumer = NixlConnector(KVTransferConfig("consumer", engine_id="lease-c", timeout=3.0), c_caches)
    yield producer, consumer, leases, p_caches, c_caches
    consumer.close()
    producer.close()


def _pull(pair, rid: str, lease: str | None = None, cancel: bool = False) -> KVConnectorOutput:
    producer, consumer, leases, _, _ = pair
    granted = leases.grant(rid, [5, 6, 7], 10, time.monotonic())
    remote = KVTransferParams(do_remote_prefill=True, remote_engine_id="lease-p", remote_host="127.0.0.1",
                              remote_port=producer.port, remote_block_ids=(5, 6, 7), remote_request_id=rid,
                              remote_num_tokens=10, remote_lease=lease or granted.nonce)
    consumer.start_loads([KVLoadSpec(f"c-{rid}", [0, 1, 2], 0, 9, remote)])
    if cancel:
        consumer.cancel_loads([f"c-{rid}"])
    deadline = time.monotonic() + 10
    while True:
        out = consumer.poll()
        if out.finished_recving or out.failed_recving:
            return out
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _ended(leases: LeaseTable, timeout: float = 5.0) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout
    while not (ended := leases.take_ended()):
        assert time.monotonic() < deadline, "the producer's hold did not end"
        time.sleep(0.005)
    return ended


def test_nixl_pull_claims_reads_then_releases(pair):
    _, _, leases, p_caches, c_caches = pair
    out = _pull(pair, "ok")
    nbytes, seconds = out.finished_recving["c-ok"]
    assert nbytes == 2 * 2 * 9 * 2 * 8 * 4 and seconds > 0  # layers · (K, V) · tokens · n_kv · head_dim · fp32
    for (k, v), (pk, pv) in zip(c_caches, p_caches):
        assert k.flatten(0, 1)[:9].equal(pk[[5, 6, 7]].flatten(0, 1)[:9])
        assert v.flatten(0, 1)[:9].equal(pv[[5, 6, 7]].flatten(0, 1)[:9])
    assert _ended(leases) == [("ok", "pulled")]


def test_nixl_pull_with_a_forged_lease_is_refused_before_any_read(pair):
    _, _, leases, _, c_caches = pair
    before = [k.clone() for k, _ in c_caches]
    out = _pull(pair, "forged", lease="f" * 32)
    assert "does not match the KV hold of request forged" in out.failed_recving["c-forged"]
    assert "forged" in leases and not leases.is_pinned("forged")
    assert all(k.equal(b) for (k, _), b in zip(c_caches, before))  # nothing was read
    leases.drop("forged", "aborted")
    leases.take_ended()


def test_nixl_pull_cancelled_before_the_claim_answer_releases_the_hold_as_aborted(pair):
    _, _, leases, _, _ = pair
    out = _pull(pair, "gone", cancel=True)
    assert out.failed_recving["c-gone"].endswith("failed: aborted")
    assert _ended(leases) == [("gone", "aborted")]
