"""`GGUFFile` reads what `gguf.GGUFReader` reads: every metadata value and every tensor
(name, type, shape, offset, the bytes as the same numpy view) of the default model, of
a file with every value type, and of a big-endian one; a file cut anywhere is a
ValueError, never a crash or a short tensor."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from gguf.quants import quantize

from radixserve.model.gguf_file import GGUFFile


def assert_same_as_gguf_reader(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.fields[key] == value and type(ours.fields[key]) is type(value), key
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)  # fmt: skip
        assert a.shape == tuple(b.shape.tolist())
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable
    return ours


def test_the_default_model_reads_as_gguf_reads_it(default_checkpoint):
    ours = assert_same_as_gguf_reader(default_checkpoint.path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in ours.tensors} == {"F32", "Q4_1", "Q8_0"}


def _write(path, endianess=GGUFEndian.LITTLE, alignment: int | None = None):
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "endianess, alignment",
    [(GGUFEndian.LITTLE, None), (GGUFEndian.LITTLE, 64), (GGUFEndian.BIG, None)],
)
def test_every_value_type_alignment_and_byte_order(tmp_path, endianess, alignment):
    ours = assert_same_as_gguf_reader(_write(tmp_path / "t.gguf", endianess, alignment))
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.strs"] == ["a", "", "ünï"]
    assert ours.fields["t.u64"] == 2**63 + 5
    assert ours.data_offset % (alignment or 32) == 0
    f32 = next(t for t in ours.tensors if t.name == "f32")
    assert f32.shape == (5, 3) and f32.data.shape == (3, 5)  # GGUF order, numpy order


def test_a_file_cut_anywhere_is_a_value_error(tmp_path):
    path = _write(tmp_path / "whole.gguf")
    whole = path.read_bytes()
    used = max(t.data_offset + t.n_bytes for t in GGUFFile(path).tensors)  # then padding
    cut = tmp_path / "cut.gguf"
    for end in [*range(0, 400, 3), *range(400, used, 97), used - 1]:
        cut.write_bytes(whole[:end])
        with pytest.raises(ValueError):  # (an empty file: numpy cannot map it)
            GGUFFile(cut)
    cut.write_bytes(whole[:used])  # the last tensor's padding is not needed
    assert len(GGUFFile(cut).tensors) == 4


@pytest.mark.parametrize(
    "patch, message",
    [((0, b"GGUX"), "magic"), ((4, b"\x07\x00\x00\x00"), "version 7")],
)
def test_a_bad_magic_or_version_is_named(tmp_path, patch, message):
    data = bytearray(_write(tmp_path / "t.gguf").read_bytes())
    at, value = patch
    data[at : at + len(value)] = value
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=message):
        GGUFFile(tmp_path / "bad.gguf")
