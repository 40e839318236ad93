"""Each token's own bytes, for the ``token``, ``bytes`` and ``text_offset`` fields of logprobs (cases C15, C22).

A token that holds part of a UTF-8 character (a byte-fallback token ``<0xF0>``, a byte-level BPE piece of an
emoji) decodes on its own to U+FFFD: the tokenizer's decoders (``tokenizers``' ``ByteFallback`` and
``ByteLevel``) turn bytes that are not yet a character into U+FFFD, and the OpenAI fields need the token's
real bytes instead. So the bytes of every token id are worked out once, in two steps:

1. The tokenizer's own decoder, run on ``[context, token]`` minus what ``context`` alone decodes to (a token
   mid-text, as the detokenizer sees it: SentencePiece's ``▁`` is a space there, the first token's stripped
   space is not stripped). When that text holds no U+FFFD, the token is whole characters and its bytes are
   that text's UTF-8, whatever the decoder chain (``Metaspace``, ``Replace``, ``Strip``, ``ByteLevel``, ...).
2. Otherwise the bytes are read from the vocabulary piece, as the decoder that made the U+FFFD reads it: a
   byte-fallback piece ``<0xNN>`` is the byte ``NN`` (when the chain has ``ByteFallback``); a byte-level piece
   maps each character back to one byte (the inverse of GPT-2's ``bytes_to_unicode``; a piece with a character
   outside that alphabet is its own UTF-8, as ``ByteLevel`` decodes it). The result must decode, with U+FFFD
   for what is not UTF-8, to the text of step 1; a token for which it does not is logged and keeps the
   piece's reading (never U+FFFD's bytes, unless the token is U+FFFD).

Special tokens that the text skips contribute no bytes, so a choice's bytes joined are its text's UTF-8 (up to
a stop string, which is cut from the text but not from its tokens).
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from typing import Any, Iterator

from transformers.convert_slow_tokenizer import bytes_to_unicode

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd"


def _decoder_types(decoder: Any) -> set[str]:
    """The ``type`` of every decoder in a serialized decoder (a ``Sequence`` is walked)."""
    def walk(d: Any) -> Iterator[str]:
        if isinstance(d, dict):
            if "type" in d:
                yield d["type"]
            for d2 in d.get("decoders") or ():
                yield from walk(d2)
    return set(walk(decoder))


def _texts_in_context(backend: Any, num_ids: int) -> list[str]:
    """Each token id's text as the decoder renders it mid-text (after a one-character context), or ``""`` where
    the decoded text does not start with the context's (then step 2 alone decides)."""
    context = backend.encode("a", add_special_tokens=False).ids
    prefix = backend.decode(context, skip_special_tokens=False) if context else ""
    if not prefix or _REPLACEMENT in prefix:
        context, prefix = [], ""
    texts = backend.decode_batch([context + [i] for i in range(num_ids)], skip_special_tokens=False)
    return [t[len(prefix):] if t.startswith(prefix) else "" for t in texts]


class TokenBytes:
    """The bytes of every token id of one tokenizer (a table built once: a few hundred ms for 50k ids).

    Args:
        tokenizer: A tokenizer with a ``tokenizers`` backend (``backend_tokenizer``): a ``transformers`` fast
            tokenizer or a :class:`~goodserve.models.gguf_tokenizer.GGUFTokenizer`.
        vocab_size: Token ids the model can produce (ids past the tokenizer's vocabulary have no bytes).

    Raises:
        RuntimeError: If ``tokenizer`` has no ``tokenizers`` backend (the engine's detokenizer needs one too).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise RuntimeError(f"{type(tokenizer).__name__} has no tokenizers backend (backend_tokenizer)")
        num_ids = min(backend.get_vocab_size(with_added_tokens=True), vocab_size)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        decoders = _decoder_types(json.loads(backend.to_str()).get("decoder"))
        byte_fallback, byte_level = "ByteFallback" in decoders, "ByteLevel" in decoders
        inverse = {c: b for b, c in bytes_to_unicode().items()}

        def piece_bytes(piece: str) -> bytes:
            m = _BYTE_FALLBACK.fullmatch(piece) if byte_fallback else None
            if m:
                return bytes([int(m.group(1), 16)])
            if byte_level and all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
            return piece.replace("\u2581", " ").encode()

        texts = _texts_in_context(backend, num_ids)
        self._bytes: list[bytes] = []
        unresolved: list[tuple[int, str]] = []
        for i, text in enumerate(texts):
            if i in self.special_ids:
                self._bytes.append(added[i].content.encode())
                continue
            piece = backend.id_to_token(i) or ""
            if text and _REPLACEMENT not in text:
                self._bytes.append(text.encode())
                continue
            raw = piece_bytes(piece)
            if text and raw.decode("utf-8", errors="replace") != text:
                unresolved.append((i, piece))
            self._bytes.append(raw)
        if unresolved:
            logger.warning("logprob bytes: %d tokens whose vocabulary piece does not decode to the tokenizer's "
                           "text (e.g. %s); their bytes are read from the piece", len(unresolved), unresolved[:5])
        self.num_unresolved = len(unresolved)
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
