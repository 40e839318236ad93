"""Workloads and their measurement, shared by the serving benchmark (``bench``) and the simulator (``sim``).

Torch-free and HTTP-free on purpose, so the simulator can use it without the engine:

* :mod:`~goodserve.workload.datasets` — request lengths from the shipped traces (Azure 2023, Mooncake) or
  drawn at random, clipped to a context, with synthetic prompt token ids.
* :mod:`~goodserve.workload.arrivals` — when requests arrive: Poisson, gamma (bursty), or a trace's clock.
* :mod:`~goodserve.workload.slo` — SLO limits: parsing ``NAME:MS`` and the one attainment predicate.
* :mod:`~goodserve.workload.metrics` — per-request records (TTFT, ITL, TPOT, E2E) and their summary
  (throughput, SLO attainment, goodput).
* :mod:`~goodserve.workload.report` — a run's summary table, sweep table, JSON result and plots
  (matplotlib, imported only when plotting).
"""
