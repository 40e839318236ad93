"""Each token's own bytes, for the ``token``, ``bytes`` and ``text_offset`` fields of logprobs (case C15).

Decoding one token id on its own gives U+FFFD for a token that holds part of a UTF-8 character; the OpenAI
fields need the token's real bytes instead. They are read from the vocabulary: a byte-level BPE token
(GPT-2, Llama 3, SmolLM2: the tokenizer's decoder is ``ByteLevel``) maps each of its characters back to one
byte (the inverse of GPT-2's ``bytes_to_unicode`` table); a SentencePiece token is its text with ``▁`` read as
a space, and a byte-fallback token ``<0xNN>`` is the byte ``NN``. Special tokens that the text skips
contribute no bytes, so a choice's bytes joined are its text's UTF-8 (up to a stop string, which is cut from
the text but not from its tokens).
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


class TokenBytes:
    """The bytes of every token id of one tokenizer (a table built once, a few tens of ms for 50k ids).

    Args:
        tokenizer: A ``transformers`` tokenizer.
        vocab_size: Token ids the model can produce (ids past the tokenizer's vocabulary have no bytes).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
        special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.special_ids = frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        if _is_byte_level(tokenizer):
            inverse = {c: b for b, c in bytes_to_unicode().items()}
            def to_bytes(piece: str) -> bytes:
                return bytes(inverse[c] for c in piece) if all(c in inverse for c in piece) else piece.encode()
        else:
            def to_bytes(piece: str) -> bytes:
                m = _BYTE_FALLBACK.fullmatch(piece)
                return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        self._bytes = [special[i].encode() if i in special else to_bytes(p or "") for i, p in enumerate(pieces)]
        self._bytes += [b""] * (vocab_size - len(self._bytes))

    def bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The token's bytes (empty for a special token the text skips, or an id outside the vocabulary)."""
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """The token as a string: its bytes as UTF-8, with a byte that is not (yet) a whole character written
        as ``\\xNN`` (as OpenAI does); a special token by its name even when the text skips it."""
        if token_id in self.special_ids:
            return self._bytes[token_id].decode()
        return self.bytes(token_id).decode("utf-8", errors="backslashreplace")


class TextOffsets:
    """Completions ``text_offset``: where each token starts in the text, counted in characters.

    A token that continues a character begun by the previous one starts where that character does, so
    ``text[text_offset[i]:]`` always holds token ``i``'s text.

    Args:
        start: The offset of the first token (the length of echoed text before it).
    """

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes; then account for them."""
        offset = self.chars
        self.chars += len(self._decoder.decode(token_bytes))
        return offset
