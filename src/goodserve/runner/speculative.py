"""The runner's side of speculative decoding: proposing draft tokens after a step, and verifying them in
the next one.

**Verification by sampling each position as decoding would.** A row that verifies drafts ``d_1..d_k`` after
its last token computes ``k + 1`` positions in one pass. Position ``i`` is sampled exactly as sequential
decoding would sample it had ``d_1..d_i`` been the request's output so far: the same logit processors over
that output (penalties, ``min_tokens``, ``logit_bias``), the same temperature and filters, and for a seeded
request the same noise (its generator is seeded by the output's length). Draft ``d_{i+1}`` is accepted if the
token sampled at position ``i`` equals it; the first position whose sample differs ends the row, and that
sample is the step's last token (after ``k`` acceptances, the sample at the last position is a bonus token).
Every emitted token is therefore a sample from the target's own distribution given the tokens before it, so
the output distribution is the target's exactly; a greedy row emits exactly its greedy tokens, and a seeded
row exactly the tokens it samples without speculation. For proposals that are a single token (n-gram lookup,
a draft model decoding greedily) the acceptance probability of ``d`` is ``p(d)``, the same as rejection
sampling's ``min(1, p(d)/q(d))`` with ``q`` a point mass (Leviathan et al. 2023, §2.3), and a rejected
position's sample is distributed as ``p`` without ``d``, as their residual distribution is.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from goodserve.config import EngineConfig
from goodserve.runner.sampling_metadata import SamplingRow
from goodserve.scheduler.output import SampledToken
from goodserve.spec.ngram import NgramProposer


def make_proposer(engine: EngineConfig, draft: Optional[Any] = None) -> Optional[Any]:
    """The proposer ``engine.speculative`` names (``None`` without speculation): an object with
    ``propose_batch([(request_id, context, k), ...]) -> {request_id: drafts}``, ``finish(request_ids)``
    (requests that ended or were preempted) and ``catch_up_seconds`` (what the last call spent reading context
    it had missed).

    Args:
        engine: The engine's config.
        draft: The loaded draft model, for ``draft_model``.

    Raises:
        ValueError: for ``draft_model`` without a loaded draft model, or one whose vocabulary differs.
    """
    config = engine.speculative
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if draft is None:
        raise ValueError("speculative method 'draft_model' needs the draft model loaded by the engine")
    from goodserve.runner.draft_model import DraftModelProposer

    return DraftModelProposer(draft, engine)


def expand_rows(row: SamplingRow, spec_token_ids: Sequence[int]) -> list[SamplingRow]:
    """The sampling rows of a row that verifies ``spec_token_ids``: one per position, the ``i``-th with the
    first ``i`` drafts as if already output (so its penalties, ``min_tokens`` and seeded noise are those of
    sequential decoding at that point)."""
    if not spec_token_ids:
        return [row]
    return [SamplingRow(row.params, row.prompt_token_ids, list(row.output_token_ids) + list(spec_token_ids[:i]),
                        row.eos_token_ids, row.grammar) for i in range(len(spec_token_ids) + 1)]


def verify(samples: Sequence[SampledToken], spec_token_ids: Sequence[int]) -> SampledToken:
    """The step's result for a row from its per-position samples: drafts accepted while each equals the
    sample at the position before it; the last token is the sample at the first position whose draft was
    not accepted (or after all of them).

    Args:
        samples: ``len(spec_token_ids) + 1`` samples, one per position.
        spec_token_ids: The drafts verified.

    Returns:
        The last token, with the accepted drafts' samples in ``accepted``.
    """
    accepted = 0
    while accepted < len(spec_token_ids) and samples[accepted].token_id == spec_token_ids[accepted]:
        accepted += 1
    last = samples[accepted]
    last.accepted = list(samples[:accepted])
    return last
