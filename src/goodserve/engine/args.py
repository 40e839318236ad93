"""Engine arguments as users give them (``LLM(**kwargs)`` or CLI flags), before they are resolved."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields
from typing import Optional

from goodserve.config import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_MODES,
                              SCHEDULING_POLICIES, CacheConfig, SchedulerConfig)
from goodserve.config_flags import add_scheduler_flags
from goodserve.kv_events.config import KVEventsConfig
from goodserve.kv_transfer.config import KV_ROLES, KVTransferConfig
from goodserve.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_GIB = 1 << 30

#: ``--dtype`` values: the activation (and dense weight) dtype, or ``auto`` (:func:`resolve_dtype`).
DTYPE_CHOICES = ("auto", "bfloat16", "float32")


@dataclass
class EngineArgs:
    """User-facing engine knobs; ``None`` means "pick a sensible default".

    Attributes:
        model: GGUF file or HF model directory; ``None`` is the default model (SmolLM2-135M-Instruct).
        dtype: ``"auto"`` (default, :func:`resolve_dtype`: bfloat16 on GPUs and on CPUs with a fast bfloat16
            path, float32 elsewhere), ``"bfloat16"`` or ``"float32"``.
        quantization: How linear layers run (``goodserve.models.quant``): ``"auto"`` (default: a GGUF's
            Q4_0/Q4_1/Q8_0 weights run as they are in the file for small steps, on the native block kernel
            where the CPU has AVX-512 VNNI or AVX2, in bfloat16 (and, under ``dtype="auto"``, float32 on an
            AVX2-only CPU: :func:`resolve_quantization`), else Q4 on
            PyTorch's int4 CPU kernel in bfloat16;
            everything else in ``dtype``), ``"none"`` (dequantize to ``dtype``), ``"int4"``
            / ``"int8"`` (every linear layer on that kernel, re-quantizing what the file holds otherwise).
        kv_cache_dtype: The cached K/V's dtype (:func:`resolve_kv_cache_dtype`): ``"auto"`` (default: ``dtype``),
            ``"bfloat16"`` (also under ``float32`` activations), ``"float32"`` or ``"int8"`` (absmax per token and
            KV head, a float32 scale per row).
        device: ``"cpu"`` or ``"cuda"``; ``None`` picks CUDA when available.
        attention_backend: ``"auto"`` (default: decodes attended in place over the block table by the
            native CPU kernel where it builds, else PyTorch), ``"torch"`` or ``"native"``
            (:func:`goodserve.models.attention.make_attention_backend`).
        batch_invariant: Batch-invariant numerics (``goodserve.models.invariant``): a token's logits do not
            depend on what shares its step, on prefix hits or on preemption. ``None``: the default (see
            :func:`resolve_batch_invariant`: on for a bfloat16 server on a CPU with AMX, off otherwise).
        serving: The engine serves requests (``goodserve serve``, a Ray instance): the defaults that depend on
            it (``batch_invariant``) are a server's.
        fused_decode_step: Decode steps (in batch-invariant mode, every step) run every layer in one native call
            where the model allows it (``False``: layer by layer, for A/B comparisons; the same bits either way).
        disable_hybrid_kv_cache_manager: Keep one full-attention KV-cache group for a model mixing local and global
            layers (vLLM's flag): every layer keeps every block (A/B comparisons; the same tokens either way).
        block_size: Tokens per KV block.
        num_blocks: KV pool size in blocks (overrides ``kv_cache_memory``).
        kv_cache_memory: KV pool size in bytes; default: 20% of available memory, at most 4 GiB on CPU.
        max_num_batched_tokens: Token budget per step.
        max_num_seqs: Most running requests.
        max_model_len: Longest prompt + output in tokens; default the model's context length.
        scheduling_policy: ``"fcfs"``, ``"priority"`` or ``"slo"`` (goodput first: orders, sizes steps and
            admits by predicted step times and each request's SLOs, :mod:`goodserve.scheduler.slo`).
        scheduler: Batching mode, one of ``SCHEDULING_MODES``: ``"chunked"`` (continuous batching with
            chunked prefill, the default), or a baseline: ``"static"`` (request-level batches, pre-Orca),
            ``"reserve"`` (continuous, reserving prompt + max_tokens at admission), ``"prefill-first"``
            (vLLM-v0-style: unchunked, admitted prompts run before decodes). See :mod:`goodserve.scheduler.scheduler`.
        enable_prefix_caching: Reuse cached blocks of shared prompt prefixes.
        seed: Seed of the generator used by unseeded sampled requests.
        num_threads: CPU threads of torch's intra-op pool (``torch.set_num_threads`` on the thread that builds
            the engine); ``None`` keeps torch's default, one per core. On a small machine shared with a
            server and clients, fewer threads than cores avoids steps stalling on a descheduled thread.
        log_stats_interval: Seconds between engine stats log lines; ``0`` disables them.
        slo_ttft: Default TTFT SLO of a request, seconds (a request may give its own); ``None``: none.
        slo_tpot: Default TPOT SLO of a request, seconds (a request may give its own); ``None``: none.
        shed_load: Under ``slo``, refuse requests whose TTFT SLO can no longer be met (HTTP 429).
        step_time_profile: A ``goodserve profile`` JSON whose coefficients seed the online step-time model.
        kv_role: Disaggregated serving (:mod:`goodserve.kv_transfer`): ``"producer"`` (prefill, hold the
            blocks for a pull), ``"consumer"`` (pull, decode) or ``"both"``; ``None``: colocated only.
        kv_transfer_config: JSON object of the connector's settings (see
            :meth:`goodserve.kv_transfer.KVTransferConfig.from_cli`).
        kv_transfer_timeout: Seconds a producer holds blocks for a pull and a consumer waits for one.
        speculative_config: JSON of speculative decoding in vLLM's shape, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}`` (:class:`goodserve.spec.config.SpeculativeConfig`); ``None``: none.
        kv_events_config: JSON of the KV events publisher in vLLM's shape
            (:class:`goodserve.kv_events.config.KVEventsConfig`); ``None``: none.
        speculative_length: ``"auto"`` (the length chosen for goodput each step) or a fixed number of draft
            tokens; overrides the JSON's ``length``.

    Raises:
        ValueError: on an unknown dtype (``kv_cache_dtype`` included: fp8 is refused by name, and a float32
            cache under bfloat16), device, policy or mode, a size below 1, a negative
            interval, an SLO that is not a positive number, or ``shed_load`` without the ``slo`` policy.
    """

    model: Optional[str] = None
    dtype: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    device: Optional[str] = None
    attention_backend: str = "auto"
    batch_invariant: Optional[bool] = None
    serving: bool = False
    fused_decode_step: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    # The scheduler's and the KV pool's knobs: defaults from their config dataclasses (and so are their flags,
    # goodserve.config_flags).
    block_size: int = CacheConfig.block_size
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_model_len: Optional[int] = None
    scheduling_policy: str = SchedulerConfig.policy
    scheduler: str = SchedulerConfig.mode
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    seed: int = 0
    num_threads: Optional[int] = None
    log_stats_interval: float = 10.0
    slo_ttft: Optional[float] = None
    slo_tpot: Optional[float] = None
    shed_load: bool = SchedulerConfig.shed_load
    step_time_profile: Optional[str] = None
    kv_role: Optional[str] = None
    kv_transfer_config: Optional[str] = None
    kv_transfer_timeout: Optional[float] = None
    speculative_config: Optional[str] = None
    speculative_length: Optional[str] = None
    kv_events_config: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)  # raises on a bad or mismatched value
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.scheduler not in SCHEDULING_MODES:
            raise ValueError(f"scheduler must be one of {SCHEDULING_MODES}, got {self.scheduler!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "num_blocks", "kv_cache_memory",
                     "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.log_stats_interval >= 0:
            raise ValueError(f"log_stats_interval must be >= 0 seconds, got {self.log_stats_interval!r}")
        for name in ("slo_ttft", "slo_tpot"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.shed_load and self.scheduling_policy != "slo":
            raise ValueError("shed_load needs scheduling_policy 'slo'")
        if self.kv_role is None and (self.kv_transfer_config or self.kv_transfer_timeout is not None):
            raise ValueError("--kv-transfer-config and --kv-transfer-timeout need --kv-role")
        self.kv_transfer()  # raises on a bad role or config
        self.speculative()  # raises on a bad speculative config
        self.kv_events()  # raises on a bad KV events config

    def kv_events(self) -> Optional[KVEventsConfig]:
        """The KV events config, or ``None`` without ``kv_events_config`` (``ValueError`` on a bad one)."""
        return KVEventsConfig.from_cli(self.kv_events_config)

    def speculative(self) -> Optional[SpeculativeConfig]:
        """The speculative config, or ``None`` without ``speculative_config`` (``ValueError`` on a bad one)."""
        length = None if self.speculative_length is None else str(self.speculative_length)
        return SpeculativeConfig.from_cli(self.speculative_config, length)

    def kv_transfer(self) -> Optional[KVTransferConfig]:
        """The connector's settings, or ``None`` without ``kv_role`` (``ValueError`` on bad ones)."""
        if self.kv_role is None:
            return None
        return KVTransferConfig.from_cli(self.kv_role, self.kv_transfer_config, self.kv_transfer_timeout)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add the engine flags (``--dtype``, ``--num-blocks``, ...) to ``parser``."""
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)")
        g.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                       help="auto (default): bfloat16 on a GPU or a CPU with a fast bfloat16 path (AVX-512 or "
                            "AMX), float32 on others (AVX2 only); float32 asked by name is the precision mode")
        g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                       help="auto (default): a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K weights as "
                            "they are, on the native block kernel (AVX-512 VNNI or AVX2; without it Q4_0/Q4_1 on "
                            "PyTorch's int4 CPU kernel, the others dense), in bfloat16 (and in float32 under "
                            "--dtype auto on an AVX2-only CPU); none: dequantize to --dtype; int4/int8: every "
                            "linear layer on PyTorch's kernel")
        g.add_argument("--kv-cache-dtype", default="auto",
                       help="dtype of the cached K/V: auto (default: --dtype), bfloat16, float32, or int8 "
                            "(a float32 scale per token and KV head: about half of bfloat16's bytes per token)")
        g.add_argument("--device", default=None, choices=["cpu", "cuda"])
        g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                       help="auto (default): decodes read the paged KV cache in place with the native CPU "
                            "kernel where it builds, else torch; torch: portable PyTorch; native: the CPU kernel")
        g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="batch-invariant numerics: a request's tokens and logprobs depend on its prompt and "
                            "seed only, not on what shares its step, prefix hits or preemption "
                            "(default: on for `serve` in bfloat16 on a CPU with AMX, off for one-shot commands; "
                            "CPU only)")
        g.add_argument("--no-fused-decode-step", dest="fused_decode_step", action="store_false",
                       help="run every step layer by layer instead of decode steps (in batch-invariant mode "
                            "every step) in one native call (A/B comparisons)")
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="one full-attention KV-cache group for a model mixing local and global layers (Gemma 3): "
                            "no block freed before the local layers' window (A/B comparisons)")
        add_scheduler_flags(g)
        g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
        g.add_argument("--slo-ttft", type=float, default=None,
                       help="default TTFT SLO of a request, seconds (requests may set slo_ttft_ms)")
        g.add_argument("--slo-tpot", type=float, default=None,
                       help="default TPOT SLO of a request, seconds (requests may set slo_tpot_ms)")
        g.add_argument("--step-time-profile", default=None,
                       help="goodserve profile JSON seeding the online step-time model")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--num-threads", type=int, default=None,
                       help="CPU threads for torch ops (default: one per core)")
        g.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds; 0 disables")
        g.add_argument("--kv-role", default=None, choices=list(KV_ROLES),
                       help="disaggregated serving: producer (prefill, hold KV for a pull), consumer (pull KV, "
                            "decode) or both; default: colocated only")
        g.add_argument("--kv-transfer-config", default=None,
                       help='JSON settings of the KV connector, e.g. \'{"host": "127.0.0.1", "port": 0}\'')
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding, vLLM\'s JSON shape: \'{"method": "ngram", "num_speculative_tokens": '
                            '4}\' (prompt lookup; also prompt_lookup_min/max) or \'{"method": "draft_model", "model": '
                            'PATH, "num_speculative_tokens": 4}\'')
        g.add_argument("--speculative-length", default=None,
                       help="auto (default: per step, the number of draft tokens that maximises expected tokens/s, "
                            "0 under load) or a fixed number")
        g.add_argument("--kv-events-config", default=None,
                       help='publish the prefix cache\'s KV events for a KV-aware router (vLLM\'s JSON shape), e.g. '
                            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
                            '"replay_endpoint": "tcp://127.0.0.1:5558"}\' (port * binds a free one)')
        g.add_argument("--kv-transfer-timeout", type=float, default=None,
                       help="seconds a producer holds KV blocks for a pull, and a consumer waits for one (30)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """Build from parsed flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def resolve_dtype(asked: str, device: str) -> str:
    """``--dtype`` resolved: ``auto`` is bfloat16 on CUDA and on a CPU where oneDNN has a bfloat16 path
    (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX), else float32: on an AVX2-only CPU oneDNN refuses bfloat16
    and PyTorch's fallback GEMM is several times slower than float32 at every step size past a few rows
    (BENCHMARKS.md, "CPUs without AVX-512")."""
    if asked != "auto":
        return asked
    if device.split(":")[0] != "cpu":
        return "bfloat16"
    from goodserve.models.linear import onednn_has_bfloat16

    return "bfloat16" if onednn_has_bfloat16() else "float32"


def resolve_quantization(asked: str, asked_dtype: str, device: str) -> str:
    """``--quantization`` resolved against the ``--dtype`` asked for: ``auto`` under ``--dtype float32`` asked
    by name is ``none`` on a CPU where the GGUF block kernel would otherwise take float32 activations (AVX2
    only, :func:`goodserve.models.native.blocks_run_in`): float32 asked for is the precision mode, every weight
    dequantized, as on every other CPU; ``--dtype auto`` resolved to float32 there runs the file's blocks."""
    if asked != "auto" or asked_dtype != "float32" or device.split(":")[0] != "cpu":
        return asked
    import torch

    from goodserve.models.native import blocks_run_in

    return "none" if blocks_run_in(torch.float32) else asked


#: Names of fp8 that ``--kv-cache-dtype`` refuses with a reason rather than as merely unknown.
_FP8_NAMES = ("fp8", "float8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2")


def check_kv_cache_dtype(asked: str) -> None:
    """Refuse a ``--kv-cache-dtype`` outside :data:`~goodserve.config.KV_CACHE_DTYPES`.

    fp8 is refused by name: torch's CPU kernels have no fp8 matmul or arithmetic path worth using (an fp8
    cache would be upcast element by element on every read, with nothing gained over int8), whereas int8
    with one float32 scale per token and KV head (absmax, as llama.cpp's q8_0 KV cache; KIVI, Liu et al.
    2024, and KVQuant, Hooper et al. 2024, study finer schemes) is read by the native decode kernel as
    integers and scaled once per row: the CPU choice.

    Raises:
        ValueError: naming the choices (and, for fp8, why it is not one).
    """
    if asked in KV_CACHE_DTYPES:
        return
    if str(asked).lower() in _FP8_NAMES:
        raise ValueError(f"kv_cache_dtype {asked!r} is not supported: torch's CPU kernels have no fp8 matmul or "
                         f"arithmetic path worth using; use int8 (a float32 scale per token and KV head). "
                         f"Choices: {', '.join(KV_CACHE_DTYPES)}")
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {asked!r}")


def resolve_kv_cache_dtype(asked: str, dtype: str) -> str:
    """``--kv-cache-dtype`` resolved against the resolved activation ``dtype``: ``auto`` is ``dtype``.

    ``int8`` goes with either activation dtype. A float cache holds the activations' dtype, or ``bfloat16``
    under ``float32`` activations (half the bytes on a CPU without a fast bfloat16 path: each cached element
    is rounded once when written and widened when read); a ``float32`` cache under ``bfloat16`` activations
    would only cost memory and is refused.

    Raises:
        ValueError: for a value :func:`check_kv_cache_dtype` refuses, or a ``float32`` cache under ``bfloat16``.
    """
    check_kv_cache_dtype(asked)
    if asked == "float32" and dtype == "bfloat16":
        raise ValueError("--kv-cache-dtype float32 with --dtype bfloat16 is not implemented: it would hold "
                         "bfloat16 activations in twice the bytes; use --kv-cache-dtype auto or int8")
    return dtype if asked == "auto" else asked


def batch_invariant_is_cheap(device: str, dtype: str, quantization: str) -> bool:
    """Whether batch-invariant numerics cost little here: a bfloat16 CPU engine whose invariant kernels run on
    AMX (BENCHMARKS.md, issue 34: faster than the default kernels from 16 decodes a step, slower at one),
    without ``--quantization int4|int8`` asking for another kernel."""
    if device != "cpu" or dtype != "bfloat16" or quantization in ("int4", "int8"):
        return False
    from goodserve.models.invariant import kernel_mode
    from goodserve.models.invariant_attention import amx_attention_available

    return kernel_mode() == "amx" and amx_attention_available()


def resolve_batch_invariant(asked: Optional[bool], device: str, dtype: str, quantization: str,
                            serving: bool = False, kv_cache_dtype: str = "auto", model_supports: bool = True) -> bool:
    """``--batch-invariant`` resolved. Not given: on for a server (``serving``) where
    :func:`batch_invariant_is_cheap` and the model has an invariant path (``model_supports``) — a served
    request's answer then depends on the request alone, and a loaded server's steps run faster on
    the invariant kernels; off for one-shot use, whose batch-1 decode is faster on the GGUF block kernel.

    Raises:
        ValueError: when asked for on a device other than the CPU (its kernels, and the invariance of the
            GEMM library the torch path relies on, are checked on the CPU only), or with ``--quantization int4``
            / ``int8`` (every layer runs on the invariant kernel), or with a KV cache dtype other than
            ``dtype`` (the batch-invariant attention kernels read caches of the activations' dtype).
    """
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    other_kv = kv_dtype == "int8" or (dtype != "auto" and kv_dtype != dtype)
    if asked is None:
        return serving and model_supports and not other_kv and batch_invariant_is_cheap(device, dtype, quantization)
    if asked and other_kv:
        raise ValueError(f"--batch-invariant is not implemented with --kv-cache-dtype {kv_dtype} under --dtype "
                         f"{dtype} (its attention kernels read caches of the activations' dtype); use "
                         "--kv-cache-dtype auto, or --no-batch-invariant")
    if asked and device.split(":")[0] != "cpu":
        raise ValueError(f"--batch-invariant runs on the CPU only, not on {device}")
    if asked and quantization in ("int4", "int8"):
        raise ValueError(f"--batch-invariant runs every linear layer on its own kernel; --quantization "
                         f"{quantization} asks for PyTorch's {quantization} kernel (use auto or none)")
    return asked


def available_memory_bytes() -> int:
    """Available host memory in bytes (``MemAvailable`` on Linux, total physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_cache_memory(device: str) -> int:
    """Bytes for the KV pool when the user gives none.

    CPU: 20% of available RAM, capped at 4 GiB (the weights, activations and the OS need the rest).
    CUDA: 80% of free device memory (the weights are already loaded when this is called).
    """
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.8)
    return min(int(available_memory_bytes() * 0.2), 4 * _GIB)
