"""The engine: requests in, one scheduled step at a time, outputs out.

``step()`` reads as schedule -> run -> postprocess: the ``Scheduler`` decides which requests advance by how
many tokens, the ``ModelRunner`` computes that ``SchedulerOutput`` on the real model and samples, and the
engine detokenises, applies stop strings and builds ``RequestOutput``\\ s. Nothing here knows about HTTP.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Union

import torch

from goodserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from goodserve.engine.args import EngineArgs, default_kv_cache_memory
from goodserve.engine.detokenizer import IncrementalDetokenizer
from goodserve.engine.stats import EngineStats
from goodserve.models.loader import default_model_path, load_model
from goodserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from goodserve.request import Request, RequestStatus
from goodserve.runner.model_runner import DTYPES, ModelRunner, SampledToken
from goodserve.sampling_params import SamplingParams
from goodserve.scheduler.output import SchedulerOutput
from goodserve.scheduler.scheduler import Scheduler
from goodserve.validation import check_text

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int]]


def resolve_pool(args: EngineArgs, model: ModelConfig, device: str) -> tuple[int, int]:
    """Pick the pool size in blocks and the effective ``max_model_len``.

    Returns:
        ``(num_blocks, max_model_len)``. ``max_model_len`` never exceeds what the pool can hold, so a
        request admitted alone can always finish.

    Raises:
        ValueError: if the pool cannot hold a single block.
    """
    bytes_per_block = model.kv_bytes_per_token(torch.tensor([], dtype=DTYPES[args.dtype]).element_size()) \
        * args.block_size
    if args.num_blocks is not None:
        num_blocks = args.num_blocks
    else:
        memory = args.kv_cache_memory or default_kv_cache_memory(device)
        num_blocks = memory // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {memory} bytes holds no block of {bytes_per_block} bytes")
    max_model_len = min(args.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
    pool_tokens = num_blocks * args.block_size
    if pool_tokens < max_model_len:
        logger.warning("KV pool of %d blocks holds %d tokens, fewer than max_model_len %d: "
                       "capping max_model_len to %d", num_blocks, pool_tokens, max_model_len, pool_tokens)
        max_model_len = pool_tokens
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB; max concurrency at %d tokens: %.2f",
                num_blocks, args.block_size, pool_tokens, num_blocks * bytes_per_block / 2**20,
                max_model_len, pool_tokens / max_model_len)
    return num_blocks, max_model_len


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
        path = args.model or default_model_path()
        t0 = time.perf_counter()
        loaded = load_model(path, DTYPES[args.dtype])
        logger.info("loaded %s (%s) in %.1f s", path, loaded.config.architecture, time.perf_counter() - t0)
        num_blocks, max_model_len = resolve_pool(args, loaded.config, device)
        self.config = EngineConfig(
            model_path=path,
            model=loaded.config,
            cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                      max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                                      policy=args.scheduling_policy, mode=args.scheduler),
            dtype=args.dtype, device=device, seed=args.seed, log_stats_interval=args.log_stats_interval)
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.runner = ModelRunner(self.config, loaded.weights)
        del loaded
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache,
                                   enable_prefix_caching=args.enable_prefix_caching)
        self.stats = EngineStats(args.log_stats_interval)
        self.last_schedule: Optional[SchedulerOutput] = None  # what the latest non-empty step computed
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, tuple[list[float], list[list[tuple[int, float]]]]] = {}
        self._counter = 0

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

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, arrival_time: Optional[float] = None,
                    priority: int = 0, cache_salt: Optional[str] = None) -> Request:
        """Queue a request.

        Args:
            prompt: Text or token ids.
            params: Sampling parameters (validated here).
            request_id: Unique id; generated when ``None``.
            arrival_time: Monotonic seconds; now when ``None``.
            priority: Lower runs first under the ``priority`` policy.
            cache_salt: Prefix-cache isolation key: only requests with the same salt share KV blocks.

        Returns:
            The queued request.

        Raises:
            ValueError: on bad parameters, an empty or invalid prompt, or a request that can never fit (its
                prompt plus ``max_tokens`` exceeds the maximum context length or the KV pool).
            Exception: whatever else the tokenizer or detokenizer raise on this input (our fault, not the
                user's). Nothing is queued when it raises.
        """
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt)
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if params.max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; "
                                 f"the prompt has {len(ids)} tokens, leaving no room to generate.")
        else:
            max_tokens = params.max_tokens
        eos = () if params.ignore_eos else self.config.model.eos_token_ids
        request = Request(request_id, ids, params, arrival_time or time.monotonic(), priority=priority,
                          eos_token_ids=eos, max_tokens=max_tokens,
                          prompt=prompt if isinstance(prompt, str) else None, cache_salt=cache_salt)
        detokenizer = IncrementalDetokenizer(self.tokenizer.backend_tokenizer, ids, params.stop,
                                             params.skip_special_tokens)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = detokenizer
        if params.logprobs is not None:
            self._logprobs[request_id] = ([], [])
        return request

    def abort(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Abort requests (unknown or finished ids are ignored); their KV blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED, time.monotonic())
        for rid in ids:
            self._detokenizers.pop(rid, None)
            self._logprobs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute, postprocess.

        Returns:
            A ``RequestOutput`` for every request that produced a token or finished this step.

        Raises:
            RuntimeError: if requests are pending but nothing could be scheduled (a broken invariant).
        """
        t0 = time.monotonic()
        self.last_schedule = None
        sched = self.scheduler.schedule(t0)
        if sched.is_empty:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("requests are pending but the scheduler scheduled nothing")
            return []
        sampled = self.runner.execute(sched)
        now = time.monotonic()
        outputs = [self._fail(self.scheduler.get_request(rid), s.error, now)
                   for rid, s in sampled.items() if s.error is not None]
        self.scheduler.update_from_output(
            sched, {rid: s.token_id for rid, s in sampled.items() if s.error is None}, now)
        for s in sched.scheduled:
            req = s.request
            token = sampled.get(req.request_id)
            if token is None or token.error is not None:
                continue
            try:
                outputs.append(self._process_token(req, token, now))
            except Exception as e:  # noqa: BLE001 - this request alone fails; the engine serves on (C19)
                logger.exception("processing the output of request %s failed", req.request_id)
                outputs.append(self._fail(req, f"processing its output failed: {type(e).__name__}: {e}", now))
        self.stats.record_step(sched, now - t0, self.scheduler)
        self.last_schedule = sched
        return outputs

    def _process_token(self, req: Request, token: SampledToken, now: float) -> RequestOutput:
        """Detokenise a request's new token, record its logprobs, apply stop strings; build its output."""
        detok = self._detokenizers[req.request_id]
        params = req.sampling_params
        if req.request_id in self._logprobs:
            lp, top = self._logprobs[req.request_id]
            lp.append(token.logprob)
            top.append(token.top_logprobs or [])
        stop = detok.add_token(token.token_id, check_stop=req.num_output_tokens >= params.min_tokens)
        if stop is not None:
            req.stop_reason = stop
            if req.is_finished:  # finished on length/EOS in the same token: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED, now)
        output = self._make_output(req)
        if req.is_finished:
            self._detokenizers.pop(req.request_id, None)
            self._logprobs.pop(req.request_id, None)
        return output

    def _fail(self, req: Request, error: str, now: float) -> RequestOutput:
        """End one request whose own processing raised: free its blocks and return its failed output.

        Args:
            req: The request (it may already have finished on length or EOS in this step).
            error: What went wrong (for the client's error message).
            now: Current time in seconds.
        """
        rid = req.request_id
        self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ERROR, now)
        self._detokenizers.pop(rid, None)
        self._logprobs.pop(rid, None)
        completion = CompletionOutput(index=0, text="", token_ids=list(req.output_token_ids), finish_reason="error")
        return RequestOutput(rid, req.prompt, req.prompt_token_ids, [completion], True,
                             RequestMetrics.from_request(req), error=f"request {rid}: {error}")

    def _make_output(self, req: Request) -> RequestOutput:
        detok = self._detokenizers[req.request_id]
        logprobs = self._logprobs.get(req.request_id)
        text = detok.text if req.is_finished else detok.stable_text
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(logprobs[0]) if logprobs else None,
            top_logprobs=list(logprobs[1]) if logprobs else None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.is_finished, RequestMetrics.from_request(req))
