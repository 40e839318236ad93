"""The shared workload package: the one SLO predicate used by the benchmark, the simulator and the server."""

from __future__ import annotations

import pytest

from goodserve.workload.metrics import RequestRecord
from goodserve.workload.slo import meets_slo


@pytest.mark.parametrize("ttft, tpot, slo_ttft, slo_tpot, met", [
    (0.5, 0.05, None, None, True),    # no SLO set: met
    (None, None, None, None, True),   # nothing measured and nothing asked
    (0.5, 0.05, 0.5, 0.05, True),     # at the limit counts as met
    (0.6, 0.05, 0.5, 0.05, False),    # TTFT over
    (0.5, 0.06, 0.5, 0.05, False),    # TPOT over
    (None, 0.05, 0.5, None, False),   # no first token misses a TTFT SLO
    (0.5, None, 0.5, 0.05, True),     # one token: no TPOT, which meets its SLO
    (None, None, None, 0.05, True),   # the server's rule: a missing TPOT meets a TPOT SLO
])
def test_meets_slo_rules(ttft, tpot, slo_ttft, slo_tpot, met):
    assert meets_slo(ttft, tpot, slo_ttft, slo_tpot) is met


def test_meets_slo_e2e():
    assert meets_slo(0.1, None, e2e=2.0, slo_e2e=2.0)
    assert not meets_slo(0.1, None, e2e=2.1, slo_e2e=2.0)
    assert not meets_slo(0.1, None, e2e=None, slo_e2e=2.0)


def test_record_meets_is_the_predicate_after_success():
    ok = RequestRecord(ttft=0.2, itls=[0.1], e2e=0.3, output_tokens=2, success=True)
    assert ok.meets({"ttft": 0.2, "tpot": 0.1, "e2el": 0.3})
    assert not ok.meets({"e2el": 0.29})
    failed = RequestRecord(ttft=0.2, e2e=0.3, output_tokens=2, success=False, error="HTTP 500")
    assert failed.meets({}) is False
    # A record without any token misses a TPOT SLO (the benchmark's rule, kept from before the predicate).
    assert not RequestRecord(success=True).meets({"tpot": 1.0})
