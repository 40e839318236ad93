"""A request's length limits: whether it can ever fit, checked as it arrives, and the token-level stop rules
applied to every sampled token (stop strings are matched on the text downstream, by the output
processor)."""

from __future__ import annotations

from typing import Any, Optional

from goodserve.request import Request, RequestStatus
from goodserve.validation import ParamError


def check_fits(req: Request, max_model_len: int, num_blocks: int, block_size: int,
               blocks_needed: Optional[int] = None) -> None:
    """Refuse at once a request that can never run.

    Raises:
        ValueError: if ``max_tokens`` is not a positive int; if prompt + ``max_tokens`` exceeds
            ``max_model_len`` tokens, or needs more KV blocks than the whole pool holds (a
            :class:`ParamError` with code ``context_length_exceeded``).
    """
    max_tokens = req.max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"request {req.request_id!r}: max_tokens must be resolved to an int >= 1, "
                         f"got {max_tokens!r}")
    num_prompt = req.num_prompt_tokens
    total = num_prompt + max_tokens
    if total > max_model_len:
        raise ParamError(f"This model's maximum context length is {max_model_len} tokens; this request asks for "
                         f"{total} tokens ({num_prompt} prompt tokens + max_tokens {max_tokens}). Shorten the "
                         "prompt or lower max_tokens.", code="context_length_exceeded")
    if blocks_needed is None:  # else the caller's count (a sliding window holds fewer than all its blocks)
        blocks_needed = -(-total // block_size)
    if blocks_needed > num_blocks:
        raise ParamError(f"this request needs {blocks_needed} KV blocks ({total} tokens at "
                         f"block_size {block_size}), but the KV pool has only {num_blocks} blocks; "
                         "shorten the prompt, lower max_tokens or give the cache more memory",
                         code="context_length_exceeded")


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


def append_tokens(req: Request, tokens: list[Any], now: float, max_model_len: int
                  ) -> tuple[list[Any], Optional[RequestStatus]]:
    """Append a step's tokens to ``req`` in order (one, or under speculation the accepted drafts and the
    token after them), stopping at the first that ends it (:func:`check_stop`); the first token of a request
    sets its ``first_token_time``.

    Args:
        tokens: :class:`~goodserve.scheduler.output.SampledToken` s.

    Returns:
        The tokens appended, and the status that ends the request (``None``: it goes on).
    """
    for i, token in enumerate(tokens):
        req.append_output_token(token.token_id)
        if req.first_token_time is None:
            req.first_token_time = now
        status = check_stop(req, token.token_id, max_model_len)
        if status is not None:
            return tokens[:i + 1], status
    return tokens, None
