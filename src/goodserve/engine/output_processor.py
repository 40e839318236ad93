"""From the engine core's per-request results to what users see: one :class:`RequestState` per request.

The engine core (scheduler + runner) hands back :class:`EngineCoreOutput`\\ s: new token ids, a finish
reason, logprobs, timestamps. The output processor keeps, per request, everything that turns those into a
:class:`RequestOutput`: the incremental detokenizer and its stop strings, the logprobs so far, and the one
record of its timestamps (:class:`RequestMetrics`). A stop string found in the text finishes the request
here; its id is handed back so the engine can tell the scheduler (``finish_requests``), the only writer of
the scheduler's state. Outputs are deltas unless the request asked for cumulative or final-only ones.
(vLLM v1's ``OutputProcessor`` and ``RequestState`` are the model for this split.)

If processing one request's output raises (a detokenizer or stop-string bug, say), that request alone
fails with ``finish_reason="error"``; the others in the same step are unaffected (case C19).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from goodserve.engine.detokenizer import IncrementalDetokenizer
from goodserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from goodserve.sampling_params import RequestOutputKind, SamplingParams
from goodserve.scheduler.output import EngineCoreOutput

logger = logging.getLogger(__name__)


class RequestState:
    """Everything the output side knows about one request.

    Args:
        request_id: Its id.
        prompt: The prompt text, if it came as text.
        prompt_token_ids: The prompt.
        params: Its sampling parameters (stop strings, ``min_tokens``, logprobs, output kind).
        arrival_time: When it was added (seconds, engine monotonic clock).
        detokenizer: Its incremental detokenizer.
    """

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, detokenizer: IncrementalDetokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[float]] = [] if params.logprobs is not None else None
        self.top_logprobs: Optional[list[list[tuple[int, float]]]] = [] if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int | str] = None
        self.error: Optional[str] = None
        self.prompt_logprobs: Optional[list] = None
        self.kv_transfer_params: Optional[dict] = None
        self._sent_prompt_logprobs = False
        self._sent_text = 0  # characters of text already handed out (delta outputs)
        self._sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Take one step's result: timestamps, new tokens (detokenised, stop strings checked), logprobs.

        Returns:
            Whether a stop string finished the request here (the scheduler must be told).
        """
        m = self.metrics
        m.first_scheduled_time = out.first_scheduled_time
        m.num_cached_tokens, m.num_preemptions = out.num_cached_tokens, out.num_preemptions
        if out.kv_transfer is not None:
            m.kv_transfer_bytes, m.kv_transfer_seconds = out.kv_transfer
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        stopped_here = False
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *out.prompt_logprobs]
        for i, token in enumerate(out.new_token_ids):
            if self.finished:  # a stop string ended it at an earlier token of this step (speculation)
                break
            if m.first_token_time is None:
                m.first_token_time = out.timestamp
            m.last_token_time = out.timestamp
            self.token_ids.append(token)
            m.num_output_tokens = len(self.token_ids)
            if self.logprobs is not None and out.logprobs is not None:
                self.logprobs.append(out.logprobs[i])
                self.top_logprobs.append(out.top_logprobs[i] if out.top_logprobs else [])
            stop = self.detokenizer.add_token(token, check_stop=len(self.token_ids) >= self.params.min_tokens)
            if stop is not None and not self.finished:
                # A stop string wins over EOS or length reached by the same token.
                self.finish_reason, self.stop_reason = "stop", stop
                stopped_here = not out.finished
        if out.finished and not self.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            if out.error is not None:
                self.error = f"request {self.request_id}: {out.error}"
        if self.finished:
            m.finished_time = out.timestamp
        return stopped_here

    def fail(self, error: str, now: float) -> None:
        """End the request as failed (its own processing raised)."""
        self.finish_reason, self.error = "error", error
        self.metrics.finished_time = now

    def make_output(self) -> Optional[RequestOutput]:
        """The output to hand out now, by the request's output kind (``None``: nothing to hand out yet)."""
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        t0, c0 = (self._sent_tokens, self._sent_text) if kind == RequestOutputKind.DELTA else (0, 0)
        if self.error is not None:
            text = ""  # a failed request hands out no more text
        else:
            full = self.detokenizer.text if self.finished else self.detokenizer.stable_text
            if len(full) < self._sent_text:
                raise RuntimeError(f"request {self.request_id}: text shrank below what was already sent")
            text, self._sent_text = full[c0:], len(full)
        self._sent_tokens = len(self.token_ids)
        completion = CompletionOutput(
            index=0, text=text, token_ids=self.token_ids[t0:], finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=None if self.logprobs is None else self.logprobs[t0:],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[t0:])
        prompt_logprobs = None
        if self.prompt_logprobs is not None and (kind != RequestOutputKind.DELTA or not self._sent_prompt_logprobs):
            prompt_logprobs, self._sent_prompt_logprobs = self.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], self.finished,
                             self.metrics.snapshot(), error=self.error, prompt_logprobs=prompt_logprobs,
                             kv_transfer_params=self.kv_transfer_params if self.finished else None)


@dataclass
class ProcessedOutputs:
    """What one step's processing yields.

    Attributes:
        request_outputs: One per request with something to hand out, in the step's order.
        stopped: Requests a stop string finished here; the scheduler must finish them (``FINISHED_STOPPED``).
        failed: Requests whose processing raised here; the scheduler must finish them (``FINISHED_ERROR``).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class OutputProcessor:
    """The :class:`RequestState` of every unfinished request.

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``) for the
            detokenizers.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> RequestState:
        """Start tracking a request.

        Raises:
            ValueError: if the id is already tracked.
            Exception: whatever building its detokenizer raises (nothing is tracked then).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens)
        state = RequestState(request_id, prompt, prompt_token_ids, params, arrival_time, detok)
        self.requests[request_id] = state
        return state

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop tracking requests (unknown ids are ignored)."""
        for rid in request_ids:
            self.requests.pop(rid, None)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Turn one step's results into request outputs; finished requests stop being tracked."""
        result = ProcessedOutputs()
        for out in core_outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            try:
                if state.update(out):
                    result.stopped.append(out.request_id)
                output = state.make_output()
            except Exception as e:  # noqa: BLE001 - this request alone fails; the engine serves on (C19)
                logger.exception("processing the output of request %s failed", out.request_id)
                state.fail(f"request {out.request_id}: processing its output failed: {type(e).__name__}: {e}",
                           out.timestamp)
                if not out.finished:
                    result.failed.append(out.request_id)
                output = state.make_output()
            if output is not None:
                result.request_outputs.append(output)
            if state.finished:
                del self.requests[out.request_id]
        return result
