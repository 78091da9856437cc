"""`models.gguf_file.read_gguf` reads what `gguf.GGUFReader` reads (every metadata value
type, F32 and quantised tensors), and refuses truncated or foreign files by name."""

import gguf
import numpy as np
import pytest

from models.gguf_file import read_gguf


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("quant", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensors_equal_gguf_readers(written):
    ours, theirs = read_gguf(written), gguf.GGUFReader(str(written))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.fields["t.strs"] == ["a", "", "Ġthe", "<|im_end|>"]
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.i64"] == -(2**40)
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(n) for n in t.shape)
        assert mine.tensor_type == int(t.tensor_type)
        got = gguf.quants.dequantize(mine.data, gguf.GGMLQuantizationType(mine.tensor_type))
        np.testing.assert_array_equal(got, gguf.quants.dequantize(t.data, t.tensor_type))


@pytest.mark.parametrize("keep", [3, 40, 200, -40])
def test_truncated_file_is_refused_naming_it(written, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(written.read_bytes()[:keep])
    with pytest.raises(ValueError, match=rf"{path}: (truncated|not a GGUF)"):
        read_gguf(path)


def test_other_files_and_versions_are_refused(written, tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + written.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    data = bytearray(written.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf(path)
