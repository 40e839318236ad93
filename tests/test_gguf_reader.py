"""The lean GGUF reader against ``gguf.GGUFReader``: every metadata field and every tensor, field for field."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from goodserve.models.gguf_reader import GGUFFile


@pytest.fixture(scope="module")
def both(default_model_path):
    import gguf

    return GGUFFile(default_model_path), gguf.GGUFReader(default_model_path)


@pytest.mark.slow
def test_metadata_matches_gguf_reader(both):
    ours, ref = both
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key
    assert ours.version == ref.fields["GGUF.version"].contents()
    # the keys the loader reads, spot-checked by value
    assert ours.get("general.architecture") == "llama"
    assert len(ours.get("tokenizer.ggml.tokens")) == 49152
    assert ours.get("tokenizer.ggml.tokens")[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert ours.get("tokenizer.ggml.merges")[0] == ref.fields["tokenizer.ggml.merges"].contents(0)
    assert ours.get("llama.rope.freq_base") == pytest.approx(100000.0)
    assert "<|im_start|>" in ours.get("tokenizer.chat_template")
    assert ours.get("no.such.key", 7) == 7


@pytest.mark.slow
def test_tensors_match_gguf_reader(both):
    ours, ref = both
    assert ours.alignment == ref.alignment and ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(b.shape.tolist()), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    kinds = {t.tensor_type.name for t in ours.tensors}
    assert "Q4_1" in kinds and "F32" in kinds


def _write(path, fields: bytes, n_fields: int, version: int = 3) -> str:
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", version, 0, n_fields) + fields)
    return str(path)


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def test_reads_every_value_type(tmp_path):
    import gguf

    path = str(tmp_path / "values.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_array("t.floats", [1.5, -2.0])
    w.add_array("t.strings", ["a", "é", ""])
    w.add_array("t.bools", [True, False])
    w.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert ours.fields["t.strings"] == ["a", "é", ""] and ours.fields["t.bools"] == [True, False]
    assert np.array_equal(ours.tensors[0].data, ref.tensors[0].data) and ours.tensors[0].shape == (3, 2)


def test_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(tmp_path / "junk.gguf"))
    with pytest.raises(ValueError, match="version 1"):
        GGUFFile(_write(tmp_path / "v1.gguf", b"", 0, version=1))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(_write(tmp_path / "be.gguf", b"", 0, version=3 << 24))
    bad_type = _string("k") + struct.pack("<I", 99)
    with pytest.raises(ValueError, match="value type 99"):
        GGUFFile(_write(tmp_path / "t.gguf", bad_type, 1))
