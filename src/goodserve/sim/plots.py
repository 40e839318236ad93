"""The planner's three figures, written as PNGs with matplotlib's Agg backend.

matplotlib is imported inside each function so that ``goodserve plan`` without ``--plot-dir`` never needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from goodserve.sim.hardware import GIB
from goodserve.sim.planner import PlanReport
from goodserve.sim.roofline import batch_sizes, decode_step

PathLike = Union[str, Path]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(r: PlanReport) -> str:
    return f"{r.arch.name} on {r.hw.name} x{r.tp}, {r.dtype}"


def plot_memory_split(r: PlanReport, path: PathLike) -> Path:
    """Stacked bar of one GPU's memory: weights, activation reserve, KV pool, and the unused share (GiB)."""
    plt = _pyplot()
    m = r.memory
    parts = [("weights", m.weights, "tab:blue"), ("activation reserve", m.activation_reserve, "tab:gray"),
             ("KV pool", m.pool_bytes, "tab:green"), ("unused (utilisation)", m.capacity - m.usable, "lightgray")]
    fig, ax = plt.subplots(figsize=(5, 6))
    bottom = 0.0
    for label, nbytes, color in parts:
        ax.bar(["GPU 0"], [nbytes / GIB], bottom=bottom, color=color, label=f"{label}: {nbytes / GIB:.1f} GiB")
        bottom += nbytes / GIB
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"Memory split\n{_title(r)}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), fontsize=8)
    return _save(fig, plt, path)


def plot_kv_per_request(r: PlanReport, path: PathLike) -> Path:
    """KV bytes of one request against its context length (log-log), with the KV pool as a line.

    Where the request curve meets ``pool / n`` lines, ``n`` requests of that length fit.
    """
    plt = _pyplot()
    m = r.memory
    top = max(m.context, r.arch.max_position_embeddings)
    contexts = [c for c in batch_sizes(top) if c >= 128] or [top]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot(contexts, [m.kv_spec.bytes_for_request(c, m.block_size) / GIB for c in contexts], marker="o",
            label="KV per request")
    ax.axhline(m.pool_bytes / GIB, color="tab:green", label=f"KV pool {m.pool_bytes / GIB:.1f} GiB")
    for n in (8, 64, 512):
        ax.axhline(m.pool_bytes / n / GIB, color="tab:green", ls=":", lw=0.8)
        ax.annotate(f"{n} requests fit", (contexts[0], m.pool_bytes / n / GIB), fontsize=7, va="bottom")
    ax.axvline(m.context, color="tab:red", ls="--",
               label=f"context {m.context}: {m.max_concurrency} concurrent requests")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"KV bytes per request vs context\n{_title(r)}")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_decode_throughput(r: PlanReport, path: PathLike) -> Path:
    """Decode throughput (tokens/s) and TPOT (ms) against batch size, with the TPOT budget and the largest
    batch that meets it marked."""
    plt = _pyplot()
    max_batch = r.roofline_max_batch
    step = max(1, max_batch // 200)
    batches = sorted(set(range(1, max_batch + 1, step)) | {max_batch})
    points = [decode_step(r.arch, r.hw, b, r.memory.context, r.dtype, r.tp, r.kv_cache_dtype) for b in batches]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot(batches, [p.tokens_per_s for p in points], color="tab:blue", label="throughput")
    ax.set_xlabel("batch size (concurrent decoding requests)")
    ax.set_ylabel("tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(batches, [p.tpot_s * 1e3 for p in points], color="tab:orange", label="TPOT")
    ax2.axhline(r.tpot_budget_s * 1e3, color="tab:orange", ls=":", label=f"TPOT budget {r.tpot_budget_s * 1e3:g} ms")
    ax2.set_ylabel("TPOT (ms)", color="tab:orange")
    if r.max_batch_within_tpot:
        ax.axvline(r.max_batch_within_tpot, color="tab:red", ls="--",
                   label=f"largest batch within budget: {r.max_batch_within_tpot}")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title(f"Decode roofline at context {r.memory.context}\n{_title(r)}")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plan_plots(r: PlanReport, plot_dir: PathLike) -> list[Path]:
    """Write all three plots into ``plot_dir`` (created if missing).

    Returns:
        Paths of ``plan_memory.png``, ``plan_kv_per_request.png`` and ``plan_decode.png``.
    """
    d = Path(plot_dir)
    return [
        plot_memory_split(r, d / "plan_memory.png"),
        plot_kv_per_request(r, d / "plan_kv_per_request.png"),
        plot_decode_throughput(r, d / "plan_decode.png"),
    ]
