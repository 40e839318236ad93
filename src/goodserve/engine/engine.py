"""The engine: requests in, one scheduled step at a time, outputs out.

``step()`` reads as schedule -> run -> postprocess: the :class:`EngineCore` (scheduler + model runner) runs
one step and hands back plain per-request results; the :class:`OutputProcessor` turns them into
``RequestOutput``\\ s (detokenised text, stop strings, logprobs, metrics), delta outputs by default. The
engine owns what sits either side of the core: the tokenizer and chat template in, the output processor
out. Nothing here knows about HTTP.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from goodserve.config import CacheConfig, EngineConfig, SchedulerConfig
from goodserve.engine.args import (EngineArgs, resolve_batch_invariant, resolve_dtype, resolve_kv_cache_dtype,
                                   resolve_quantization)
from goodserve.engine.chat import render_chat
from goodserve.engine.core import EngineCore
from goodserve.engine.kv_pool import resolve_pool
from goodserve.engine.output_processor import OutputProcessor
from goodserve.engine.stats import EngineStats
from goodserve.kv_transfer.params import KVTransferParams
from goodserve.models.loader import default_model_path, load_model
from goodserve.models.registry import batch_invariant_supported
from goodserve.outputs import RequestOutput
from goodserve.request import Request, RequestStatus
from goodserve.request_options import RequestOptions
from goodserve.runner.draft_model import check_draft
from goodserve.runner.model_runner import DTYPES
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SchedulerOutput, SchedulerStats
from goodserve.scheduler.step_time import DEFAULT_SEED, StepCoefficients, StepTimeModel
from goodserve.validation import ParamError, check_text

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int]]


@dataclass
class EngineStep:
    """What one :meth:`Engine.run_step` did: the outputs handed out, and the step the model computed (``None``
    if nothing was scheduled)."""

    outputs: list[RequestOutput]
    schedule: Optional[SchedulerOutput]


def _structured_output_compiler(tokenizer: Any, model_config: Any) -> Optional[Any]:
    """A grammar compiler for structured outputs, or ``None`` when xgrammar is not installed."""
    if importlib.util.find_spec("xgrammar") is None:
        logger.warning("xgrammar is not installed: requests with structured outputs will be refused")
        return None
    from goodserve.runner.structured_output import StructuredOutputCompiler  # imports xgrammar when first used
    return StructuredOutputCompiler(tokenizer, model_config.vocab_size, model_config.eos_token_ids)


class Engine:
    """A continuously batched engine over a paged KV cache.

    Args:
        args: Engine arguments.

    Raises:
        FileNotFoundError: when the model is missing.
        ValueError: on invalid arguments.
    """

    def __init__(self, args: Optional[EngineArgs] = None) -> None:
        args = args or EngineArgs()
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        args = dataclasses.replace(args, quantization=resolve_quantization(args.quantization, args.dtype, device))
        if args.dtype == "auto":
            args = dataclasses.replace(args, dtype=resolve_dtype(args.dtype, device))
            logger.info("dtype auto: %s on %s", args.dtype, device if device != "cpu" else
                        f"this CPU ({torch.backends.cpu.get_cpu_capability()})")
        path = args.model or default_model_path()
        t0 = time.perf_counter()
        # The file's blocks run on CPU kernels: elsewhere every weight is dequantized at load.
        loaded = load_model(path, DTYPES[args.dtype], keep_quantized=args.quantization != "none" and device == "cpu")
        logger.info("loaded %s (%s) in %.1f s", path, loaded.config.architecture, time.perf_counter() - t0)
        speculative = args.speculative()
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = load_model(speculative.model, DTYPES[args.dtype], keep_quantized=args.quantization != "none"
                               and device == "cpu")
            logger.info("draft model %s (%s) for speculation", speculative.model, draft.config.architecture)
        kv_events = args.kv_events()
        num_blocks, max_model_len, layout = resolve_pool(args, loaded.config, device,
                                                         draft.config if draft else None)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype)
        if draft is not None:
            check_draft(draft.config, loaded.config, max_model_len)
        self.config = EngineConfig(
            model_path=path,
            model=loaded.config,
            cache=CacheConfig(num_blocks=num_blocks, block_size=args.block_size,
                              enable_prefix_caching=args.enable_prefix_caching,
                              enable_kv_events=kv_events is not None and kv_events.enabled,
                              layout=layout),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                                      policy=args.scheduling_policy, mode=args.scheduler,
                                      shed_load=args.shed_load),
            dtype=args.dtype, quantization=args.quantization, attention_backend=args.attention_backend,
            batch_invariant=resolve_batch_invariant(args.batch_invariant, device, args.dtype, args.quantization,
                                                    args.serving, args.kv_cache_dtype,
                                                    batch_invariant_supported(loaded.config)),
            kv_cache_dtype=kv_dtype,
            fused_decode_step=args.fused_decode_step, device=device, seed=args.seed,
            log_stats_interval=args.log_stats_interval, kv_transfer=args.kv_transfer(), slo_ttft=args.slo_ttft,
            slo_tpot=args.slo_tpot, speculative=speculative, kv_events=kv_events)
        logger.info("batch-invariant numerics %s", "on: a request's tokens depend on its prompt and seed only"
                    if self.config.batch_invariant else "off (--batch-invariant turns them on)")
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        seed = StepCoefficients.load(args.step_time_profile) if args.step_time_profile else DEFAULT_SEED
        self.structured_output = _structured_output_compiler(loaded.tokenizer, loaded.config)
        self.core = EngineCore(self.config, loaded.weights, structured_output=self.structured_output,
                               step_model=StepTimeModel(seed), draft=draft)
        del loaded, draft
        self.output_processor = OutputProcessor(self.tokenizer.backend_tokenizer)
        self.stats = EngineStats(args.log_stats_interval)
        self._counter = 0

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes one token occupies in the model's KV cache, in the resolved KV dtype (the spec's formula,
        :mod:`goodserve.kv_cache.spec`; a draft model's cache, under speculation, is extra)."""
        return self.config.model.kv_cache_spec(self.config.kv_dtype, self.config.cache.hybrid).bytes_per_token()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def tokenize(self, prompt: PromptType) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens) or validated ids as given.

        Raises:
            ValueError: on an empty prompt, text that is not valid Unicode (C19) or a token id outside the
                vocabulary.
        """
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.config.model.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        return ids

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended (see :func:`render_chat`)."""
        return render_chat(self.tokenizer, self.chat_template, messages)

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, arrival_time: Optional[float] = None,
                    options: Optional[RequestOptions] = None, prompt_token_ids: Optional[list[int]] = None) -> str:
        """Queue a request.

        Args:
            prompt: Text or token ids.
            params: Sampling parameters (validated here); ``output_kind`` says what its outputs hold.
            request_id: Unique id; generated when ``None``.
            arrival_time: Monotonic seconds; now when ``None``.
            options: Its priority, prefix-cache salt, SLOs and part in disaggregated serving, built where it
                entered (:meth:`EngineConfig.request_options`); ``None``: the engine's defaults.
            prompt_token_ids: A text prompt's ids from :meth:`tokenize`, when the caller tokenised it already.

        Returns:
            The request id.

        Raises:
            ValueError: on bad parameters, an empty or invalid prompt, or a request that can never fit (its
                prompt plus ``max_tokens`` exceeds the maximum context length or the KV pool).
            SLOUnattainableError: under the ``slo`` policy with ``shed_load``, if its TTFT SLO cannot be met.
            Exception: whatever else the tokenizer or detokenizer raise on this input (our fault, not the
                user's). Nothing is queued when it raises.
        """
        params = params or SamplingParams()
        params.validate()
        self.check_params(params)
        ids = prompt_token_ids if prompt_token_ids is not None and isinstance(prompt, str) else self.tokenize(prompt)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if params.max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise ParamError(f"This model's maximum context length is {self.max_model_len} tokens; "
                                 f"the prompt has {len(ids)} tokens, leaving no room to generate.",
                                 code="context_length_exceeded")
        else:
            max_tokens = params.max_tokens
        eos = () if params.ignore_eos else self.config.model.eos_token_ids
        arrival_time = arrival_time or time.monotonic()
        request = Request(request_id, ids, params, arrival_time, eos_token_ids=eos, max_tokens=max_tokens,
                          options=self.config.request_options() if options is None else options)
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                                          arrival_time)
        try:
            self.core.add_request(request)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            raise
        return request_id

    def check_params(self, params: SamplingParams) -> None:
        """What only the engine can check: token ids of ``logit_bias`` inside the vocabulary, and a grammar
        that compiles (cached, so the runner's compile later is free).

        Raises:
            ValueError: naming the field.
        """
        vocab = self.config.model.vocab_size
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias must be keyed by token ids in [0, {vocab}), got {bad[:5]}")
        if params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("response_format: structured outputs need the xgrammar package, which is not "
                                 "installed on this server")
            self.structured_output.compile(params.structured_outputs)

    def abort(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Abort requests (unknown or finished ids are ignored); their KV blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort_requests(ids)

    def abort_all(self) -> None:
        """Abort every unfinished request (a stopping server frees all its blocks)."""
        self.abort(self.core.scheduler.unfinished_request_ids())

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_pending_kv_transfers(self) -> bool:
        """Whether KV blocks are held for a consumer's pull or a pull is in flight (keep stepping to poll)."""
        return self.core.scheduler.has_pending_kv_transfers()

    def release_kv_hold(self, kv_transfer_params: Any) -> bool:
        """Producer: free at once the blocks a published handle holds (the client left before any consumer
        pulled them), checked against its lease.

        Args:
            kv_transfer_params: The handle, as the producer's answer gave it (``do_remote_prefill`` and the
                ``remote_*`` fields).

        Returns:
            ``True`` if the blocks were freed; ``False`` if a consumer is reading them (freed when it ends).

        Raises:
            ParamError: on a malformed handle, or an instance that holds no KV for pulls.
            LookupError: if no live hold matches the handle (expired, released, unknown, stale or forged).
        """
        params = KVTransferParams.from_dict(kv_transfer_params)
        if not params.do_remote_prefill:
            raise ParamError("kv_transfer_params: give the handle of a hold (do_remote_prefill and the remote_* "
                             "fields)", param="kv_transfer_params")
        return self.core.release_kv_hold(params)

    def close(self) -> None:
        """Release what the engine holds outside Python's reach (the KV connector's NIXL agent and socket)."""
        self.core.close()

    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute, postprocess (:meth:`run_step`).

        Returns:
            An output for every request with something new to hand out (by its ``output_kind``).

        Raises:
            RuntimeError: if requests are pending but nothing could be scheduled (a broken invariant).
            Exception: whatever the forward pass raises (a fault of the engine, not of one request).
        """
        return self.run_step().outputs

    def run_step(self) -> EngineStep:
        """Run one iteration and say what it did: the outputs, and the step the model computed (``None`` if
        nothing was scheduled), for the serving loop's trace and the benchmarks.

        Raises:
            RuntimeError, Exception: as :meth:`step`.
        """
        t0 = time.monotonic()
        core = self.core.step()
        processed = self.output_processor.process_outputs(core.outputs)
        self.core.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
        self.core.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
        if core.schedule is not None:
            self.stats.record_step(core.schedule, time.monotonic() - t0, self.make_stats)
        return EngineStep(processed.request_outputs, core.schedule)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's state: running, waiting, tokens waiting, KV usage, preemptions, prefix cache."""
        return self.core.make_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (benchmarks start each workload cold)."""
        self.core.reset_prefix_cache()
