"""Incremental detokenisation and stop-string matching for one request.

Text is grown one token at a time with ``tokenizers``' ``DecodeStream``, which holds back bytes until they
form valid UTF-8, so every piece of text handed out is whole characters. Stop strings are matched on the
text itself, so they are found across token boundaries; the match and everything after it are dropped.
While a request runs, text that could still turn out to be the start of a stop string is held back from
``stable_text``, so a streamed delta never has to be taken back.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream as context, so the first output token decodes as it would mid-text
# (e.g. SentencePiece's leading-space marker).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Detokenises one request's output and finds its stop strings.

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (``PreTrainedTokenizerFast.backend_tokenizer``).
        prompt_token_ids: The prompt, used as decoding context only.
        stop: Stop strings (non-empty).
        skip_special_tokens: Drop special tokens from the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stop = list(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.stop_matched: Optional[str] = None

    def add_token(self, token_id: int, check_stop: bool = True) -> Optional[str]:
        """Append one token's text and look for a stop string.

        Args:
            token_id: The new token.
            check_stop: Whether stop strings count yet (false before ``min_tokens``).

        Returns:
            The stop string that matched (the text is then cut before it), or ``None``.
        """
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not (check_stop and self._stop):
            return None
        # A match must end inside the new piece; start looking where such a match could begin.
        search_from = max(0, old_len - self._max_stop + 1)
        best: Optional[tuple[int, str]] = None
        for s in self._stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stop_matched = best[1]
        return best[1]

    @property
    def stable_text(self) -> str:
        """The text minus any tail that is a proper prefix of a stop string (safe to stream now)."""
        held = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return self.text[: len(self.text) - held] if held else self.text
