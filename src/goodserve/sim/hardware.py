"""Accelerator specifications for the capacity planner and the simulator's cost model.

Every figure is the per-GPU number from the vendor's datasheet. FLOP/s are **dense** tensor-core rates
(NVIDIA datasheets print the 2:4-sparse rate first, with the dense rate at half of it in a footnote).
Memory capacities are the marketed decimal gigabytes, which is a little below what the driver reports
(an "80GB" H100 exposes about 85.5e9 bytes), so pools planned from them are slightly conservative.

Per-step overhead is not a datasheet figure: it is our estimate of the fixed host-side cost of one
decode step (scheduling, input preparation, kernel launches replayed from a CUDA graph) that a roofline
cannot see. Tune it against measured step times of the real engine.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, as the roofline model sees it.

    Attributes:
        name: Short key, e.g. ``"h100"``.
        peak_flops_bf16: Dense BF16 tensor-core throughput, FLOP/s.
        peak_flops_fp8: Dense FP8 tensor-core throughput, FLOP/s (the BF16 rate where FP8 is not native).
        mem_bandwidth: Peak memory bandwidth, bytes/s.
        mem_capacity: Device memory, bytes.
        step_overhead_s: Fixed cost added to every model step, seconds.
        description: Human-readable name for reports.
    """

    name: str
    peak_flops_bf16: float
    peak_flops_fp8: float
    mem_bandwidth: float
    mem_capacity: int
    step_overhead_s: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        for field_name in ("peak_flops_bf16", "peak_flops_fp8", "mem_bandwidth", "mem_capacity"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{field_name} must be > 0, got {getattr(self, field_name)}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a compute dtype.

        Args:
            dtype: ``"bfloat16"``, ``"float8"`` or ``"float32"`` (the engine's ``--dtype`` spelling).

        Returns:
            FLOP/s. FP32 GEMMs are assumed to run on TF32 tensor cores, which every GPU here rates at half
            its BF16 throughput (e.g. H100 SXM: 494.7 vs 989.4 TFLOP/s dense).

        Raises:
            ValueError: Unknown dtype.
        """
        if dtype == "bfloat16":
            return self.peak_flops_bf16
        if dtype == "float8":
            return self.peak_flops_fp8
        if dtype == "float32":
            return self.peak_flops_bf16 / 2
        raise ValueError(f"unknown dtype {dtype!r}; expected one of bfloat16, float8, float32")


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS and FP8 3,958 TFLOPS "with
    # sparsity" -> 989.4 / 1,978.9 dense; 80GB HBM3 at 3.35 TB/s.
    "h100": HardwareSpec(
        name="h100",
        peak_flops_bf16=989.4 * TERA,
        peak_flops_fp8=1978.9 * TERA,
        mem_bandwidth=3.35e12,
        mem_capacity=int(80 * GB),
        step_overhead_s=200e-6,
        description="NVIDIA H100 SXM 80GB",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM column: same compute as H100 SXM (BF16 1,979 / FP8 3,958
    # TFLOPS with sparsity -> half dense); 141GB HBM3e at 4.8 TB/s.
    "h200": HardwareSpec(
        name="h200",
        peak_flops_bf16=989.4 * TERA,
        peak_flops_fp8=1978.9 * TERA,
        mem_bandwidth=4.8e12,
        mem_capacity=int(141 * GB),
        step_overhead_s=200e-6,
        description="NVIDIA H200 SXM 141GB",
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16 312 TFLOPS dense (624 with sparsity);
    # 80GB HBM2e at 2,039 GB/s. Ampere has no FP8 tensor cores: FP8 weights are dequantised and multiplied
    # in BF16, so the FP8 rate is the BF16 rate.
    "a100": HardwareSpec(
        name="a100",
        peak_flops_bf16=312 * TERA,
        peak_flops_fp8=312 * TERA,
        mem_bandwidth=2.039e12,
        mem_capacity=int(80 * GB),
        step_overhead_s=200e-6,
        description="NVIDIA A100 SXM 80GB",
    ),
    # NVIDIA HGX B200 datasheet (8 GPUs): FP8 72 PFLOPS and BF16 36 PFLOPS with sparsity -> per GPU
    # 4.5 / 2.25 PFLOPS dense; 1.4TB HBM3e at 64 TB/s in total -> 180GB at 8 TB/s per GPU.
    "b200": HardwareSpec(
        name="b200",
        peak_flops_bf16=2250 * TERA,
        peak_flops_fp8=4500 * TERA,
        mem_bandwidth=8e12,
        mem_capacity=int(180 * GB),
        step_overhead_s=200e-6,
        description="NVIDIA B200 (HGX) 180GB",
    ),
    # This development machine, measured rather than from a datasheet: 2 CPU cores, ~0.93 TFLOP/s on a
    # large bf16 torch matmul, ~33 GB/s effective bandwidth on a bf16 GEMV (the decode shape), 24 GiB RAM.
    # No FP8 arithmetic, so the FP8 rate is the BF16 rate.
    "cpu-local": HardwareSpec(
        name="cpu-local",
        peak_flops_bf16=0.93 * TERA,
        peak_flops_fp8=0.93 * TERA,
        mem_bandwidth=33e9,
        mem_capacity=24 * GIB,
        step_overhead_s=1e-3,
        description="local CPU (2 cores, measured)",
    ),
}


def get_hardware(name: str) -> HardwareSpec:
    """Look up a hardware spec by key (case-insensitive).

    Raises:
        ValueError: Unknown name; the message lists the known ones.
    """
    spec = HARDWARE.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE)}")
    return spec
