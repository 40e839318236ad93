"""Token-level stop rules, applied by the scheduler to every sampled token (stop strings are matched on the
text downstream, by the output processor)."""

from __future__ import annotations

from typing import Optional

from goodserve.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int) -> Optional[RequestStatus]:
    """Whether ``token``, just appended to ``req``, ends it: a stop token id, then EOS (both only from
    ``min_tokens`` on, EOS not with ``ignore_eos``), then ``max_tokens`` or ``max_model_len``.

    Sets ``req.stop_reason`` to the stop token id when one matched (the caller is the scheduler, the only
    writer of a request).

    Returns:
        ``FINISHED_STOPPED``, ``FINISHED_LENGTH``, or ``None`` to go on.
    """
    params = req.sampling_params
    past_min = req.num_output_tokens >= params.min_tokens
    if token in params.stop_token_ids and past_min:
        req.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if token in req.eos_token_ids and not params.ignore_eos and past_min:
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
