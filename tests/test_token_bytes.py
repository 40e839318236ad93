"""Each token's own bytes (server/token_bytes.py, cases C15 and C22): byte-level BPE, SentencePiece with byte
fallback (as transformers builds it from a GGUF), and decoders the table knows nothing of."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel, WordPiece
from transformers import PreTrainedTokenizerFast

from goodserve.engine.detokenizer import IncrementalDetokenizer
from goodserve.server.token_bytes import TextOffsets, TokenBytes
from tiny_models import SMOLLM2_VOCAB, smollm2_tokenizer

ZWJ_SCIENTISTS = "\U0001F468\u200d\U0001F52C" * 3  # "👨‍🔬👨‍🔬👨‍🔬": man, zero-width joiner, microscope
U_FFFD = list("\ufffd".encode())  # [239, 191, 189]


def assert_c22(tok, tb: TokenBytes, prompt: str, output: str) -> list[bytes]:
    """C22 on ``output`` as the engine would produce it after ``prompt``: no token's bytes are U+FFFD's, and
    the bytes joined are exactly the UTF-8 of the text the engine's detokenizer makes of those tokens."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(prompt + output, add_special_tokens=False)
    assert ids[:len(prompt_ids)] == prompt_ids
    ids = ids[len(prompt_ids):]
    detok = IncrementalDetokenizer(tok.backend_tokenizer, prompt_ids, stop=[])
    for i in ids:
        detok.add_token(i)
    assert detok.text == output
    got = [tb.bytes(i) for i in ids]
    assert all(list(b) != U_FFFD for b in got)
    assert b"".join(got) == detok.text.encode()
    return got


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


def test_c22_zwj_emoji_byte_level_bpe(default_model_path):
    """C22, byte-level BPE (the default GGUF, through the engine's own GGUF tokenizer): the scientist emoji's
    tokens are its real byte pieces, shown as ``\\xNN``; no id of the vocabulary is left unresolved."""
    from goodserve.models.gguf_reader import GGUFFile
    from goodserve.models.gguf_tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(GGUFFile(default_model_path), default_model_path)
    tb = TokenBytes(tok, SMOLLM2_VOCAB)
    assert tb.num_unresolved == 0
    got = assert_c22(tok, tb, "Repeat:", ZWJ_SCIENTISTS)
    assert got == [b"\xf0\x9f", b"\x91", b"\xa8", b"\xe2\x80", b"\x8d", b"\xf0\x9f", b"\x94", b"\xac"] * 3
    ids = tok.encode(ZWJ_SCIENTISTS, add_special_tokens=False)
    assert [tb.token(i) for i in ids[:5]] == ["\\xf0\\x9f", "\\x91", "\\xa8", "\\xe2\\x80", "\\x8d"]
    replacement = tok.encode("\ufffd", add_special_tokens=False)  # the one token that *is* U+FFFD
    assert [list(tb.bytes(i)) for i in replacement] == [U_FFFD] and tb.token(replacement[0]) == "\ufffd"


def _sentencepiece_gguf(path: str) -> str:
    """A tokenizer-only GGUF with a llama (SentencePiece, byte-fallback) vocabulary: the 256 byte tokens, ``▁``
    pieces, and the man emoji and the joiner as whole tokens (the microscope only as bytes)."""
    import gguf

    words = ["\u2581", ":", "\U0001F468", "\u200d"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))  # unknown, control, byte, normal
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_c22_zwj_emoji_byte_fallback_sentencepiece(tmp_path):
    """C22, SentencePiece with byte fallback (a llama GGUF, read by transformers as the loader reads one): a
    ``<0xNN>`` token is its one byte, a ``▁`` piece starts with a space, whole emoji tokens are their UTF-8."""
    from goodserve.models.checkpoint import load_gguf_tokenizer

    tok = load_gguf_tokenizer(_sentencepiece_gguf(str(tmp_path / "spm.gguf")))
    tb = TokenBytes(tok, len(tok))
    assert tb.num_unresolved == 0
    got = assert_c22(tok, tb, "Repeat:", ZWJ_SCIENTISTS)
    man, microscope = "\U0001F468".encode(), [bytes([b]) for b in "\U0001F52C".encode()]
    assert got == ([man, "\u200d".encode()] + microscope) * 3
    ids = tok.encode(ZWJ_SCIENTISTS, add_special_tokens=False)
    assert [tb.token(i) for i in ids[3:7]] == ["\\xf0", "\\x9f", "\\x94", "\\xac"]  # after "▁", man, joiner
    prompt = [tb.bytes(i) for i in tok.encode("Repeat:", add_special_tokens=False)]
    assert prompt[0] == b" " and b"".join(prompt) == b" Repeat:"  # "▁" is a space mid-text


def test_whole_tokens_are_what_the_tokenizers_own_decoder_makes_of_them():
    """A decoder the table has no rule for (WordPiece's ``##`` continuations): a whole token's bytes are its
    text mid-sentence as the tokenizer decodes it, so the bytes joined are the detokenizer's text."""
    vocab = {"[UNK]": 0, "play": 1, "##ing": 2, "fun": 3, "##\U0001F468": 4}
    backend = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tb = TokenBytes(tok, len(vocab))
    assert [tb.bytes(i) for i in (1, 2, 3, 4)] == [b" play", b"ing", b" fun", "\U0001F468".encode()]
    detok = IncrementalDetokenizer(backend, [3], stop=[])
    for i in (1, 2, 4):
        detok.add_token(i)
    assert b"".join(tb.bytes(i) for i in (1, 2, 4)) == detok.text.encode() == " playing\U0001F468".encode()
