"""Each token's own bytes (server/token_bytes.py, case C15): byte-level BPE and SentencePiece-style vocabularies."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from goodserve.server.token_bytes import TextOffsets, TokenBytes
from tiny_models import SMOLLM2_VOCAB, smollm2_tokenizer


def test_byte_level_tokens_joined_are_the_text_C15():
    tok = smollm2_tokenizer()
    tb = TokenBytes(tok, SMOLLM2_VOCAB + 64)  # the model may have more ids than the tokenizer
    for text in ("你好🎉 héllo wörld", " The capital of France is Paris.\n\n  x", "<|im_end|> done", "🐸🐸"):
        ids = tok.encode(text)
        joined = b"".join(tb.bytes(i) for i in ids)
        assert joined == tok.decode(ids, skip_special_tokens=True).encode()
        assert b"".join(tb.bytes(i, skip_special_tokens=False) for i in ids) == tok.decode(ids).encode()
    ids = tok.encode("你")
    assert [tb.bytes(i) for i in ids] == [b"\xe4\xbd", b"\xa0"]  # one character split over two tokens
    assert [tb.token(i) for i in ids] == ["\\xe4\\xbd", "\\xa0"]
    assert tb.token(2) == "<|im_end|>" and tb.bytes(2) == b"" and tb.bytes(2, False) == b"<|im_end|>"
    assert tb.bytes(SMOLLM2_VOCAB + 5) == b""


def test_sentencepiece_style_tokens_and_byte_fallback():
    vocab = {"<unk>": 0, "\u2581hello": 1, "<0xE4>": 2, "<0xBD>": 3, "<0xA0>": 4, "\u2581": 5, "x": 6}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tb = TokenBytes(tok, len(vocab))
    assert [tb.bytes(i) for i in (1, 2, 3, 4, 5, 6)] == [b" hello", b"\xe4", b"\xbd", b"\xa0", b" ", b"x"]
    assert b"".join(tb.bytes(i) for i in (1, 2, 3, 4)).decode() == " hello你"


def test_text_offsets_index_the_text_C15():
    offsets = TextOffsets(start=3)  # after three characters of echoed prompt
    pieces = [b"ab", b"\xe4\xbd", b"\xa0", b"c", b"\xf0\x9f", b"\x8e\x89", b"!"]
    got = [offsets.next(p) for p in pieces]
    text = "xyz" + b"".join(pieces).decode()  # "xyzab你c🎉!"
    assert got == [3, 5, 5, 6, 7, 7, 8]
    assert text[got[1]] == "你" and text[got[4]] == "🎉" and text[got[6]] == "!"
