"""N-gram (prompt lookup) proposals: draft tokens copied from the request's own context.

Input-grounded generation (summaries, edits, code completion of a given file, answers quoting a document)
repeats spans of its context; the tokens that followed the latest earlier occurrence of the request's last
``n`` tokens are a free guess at what comes next (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram``
method, llama.cpp's lookup decoding). No model runs: the cost is one vectorised scan of the context.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens by matching the context's suffix earlier in the context.

    Args:
        min_n: The shortest suffix matched (tokens).
        max_n: The longest suffix matched; longer matches are tried first (they predict better).
    """

    #: Seconds the last call spent reading context it had missed: none, proposals are read off the context.
    catch_up_seconds = 0.0

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """:meth:`propose` for each ``(request_id, context, k)``."""
        return {rid: self.propose(tokens, k) for rid, tokens, k in items}

    def finish(self, request_ids: Sequence[str]) -> None:
        """Nothing to drop: proposals are read off the context each time."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Draft tokens after ``token_ids`` (prompt + output so far).

        For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens occurred earlier, return the (up
        to ``k``) tokens that followed their latest earlier occurrence with ``k`` tokens after it (else their
        earliest); else ``[]``.
        """
        total = len(token_ids)
        if k <= 0 or total < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = ids[total - n:]
            # Windows starting at 0 .. total - n - 1 (the suffix itself excluded), each n tokens long.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest earlier occurrence followed by k tokens, else the earliest (the longest run):
                # in a repeating span the latest occurrence ends just before the suffix.
                full = hits[hits + n + k <= total]
                start = int(full[-1] if full.size else hits[0]) + n
                return ids[start:start + k].tolist()
        return []
