"""The NumPy reader of TensorFlow checkpoints, checked against what TensorFlow itself read from the same files."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from tf_checkpoint_writer import write_checkpoint

from ran_hf.files.tf_checkpoint import (
    CheckpointFormatError,
    TFCheckpointReader,
    _crc32c,
    _crc32c_python,
    _parse_entry,
    _slice_key,
)


FIXTURES = Path(__file__).parent / "fixtures" / "rannet"


@pytest.fixture
def checkpoint_copy(tmp_path):
    """A copy of a small official checkpoint (`model.ckpt.*`), to damage; returns its prefix."""
    for path in (FIXTURES / "l1_d32_w4_last").glob("model.ckpt.*"):
        shutil.copy(path, tmp_path)
    return tmp_path / "model.ckpt"


def test_reads_every_dtype_from_several_shards_as_tensorflow_does():
    """bfloat16, float16/32/64, integers, bool, a scalar and an empty tensor, spread over shards, large ones in slices
    (some starting past row 63, where slice keys need multi-byte numbers)."""
    reader = TFCheckpointReader(FIXTURES / "tf_bundle" / "sharded")
    with np.load(FIXTURES / "tf_bundle" / "expected.npz") as expected:
        names, dtypes = list(expected["names"]), list(expected["dtypes"])
        assert set(reader.entries) == set(names) | {"_CHECKPOINTABLE_OBJECT_GRAPH"}
        assert reader.num_shards >= 2
        assert len({reader.entries[name].shard for name in names}) >= 2
        slice_starts = [start for name in names for extents in reader.entries[name].slices for start, _ in extents]
        assert max(slice_starts) >= 64
        for i, (name, dtype) in enumerate(zip(names, dtypes, strict=True)):
            value, tensorflow_value = reader.read(name), expected[f"tensor_{i}"]
            assert reader.entries[name].dtype == dtype, name
            assert value.dtype == tensorflow_value.dtype and value.shape == tensorflow_value.shape, name
            np.testing.assert_array_equal(value, tensorflow_value, err_msg=name)
    assert {"bfloat16", "float16", "int64", "bool"} <= set(dtypes)


def test_lists_the_official_variables_in_name_order():
    reader = TFCheckpointReader(FIXTURES / "l2_d24_w6_mean" / "model.ckpt")
    shapes = reader.shapes()
    assert len(shapes) == 86  # RanNet.variable_mapping(ran_layers=2)
    assert list(shapes) == sorted(shapes)
    assert shapes["rannet/token-embedding/embeddings"] == (80, 24)
    assert shapes["rannet/ran-1/encode-attn/dense-o/kernel"] == (16, 24)
    assert "rannet/mlm-matching/bias" in reader


def test_strings_are_listed_but_not_read():
    reader = TFCheckpointReader(FIXTURES / "l3_d16_w8_max_training" / "01.weights")
    assert reader.entries["_CHECKPOINTABLE_OBJECT_GRAPH"].dtype == "string"
    with pytest.raises(CheckpointFormatError, match="_CHECKPOINTABLE_OBJECT_GRAPH.*strings"):
        reader.read("_CHECKPOINTABLE_OBJECT_GRAPH")


def test_unknown_tensor_name():
    reader = TFCheckpointReader(FIXTURES / "l1_d32_w4_last" / "model.ckpt")
    with pytest.raises(KeyError, match="no/such/tensor"):
        reader.read("no/such/tensor")


def test_written_checkpoints_read_back_exactly(tmp_path):
    """The test writer (used to build broken checkpoints) round-trips, scalars and empty tensors included."""
    rng = np.random.default_rng(0)
    tensors = {
        "a/matrix": rng.normal(size=(3, 4)).astype(np.float32),
        "b/vector": rng.normal(size=5),
        "c/half": rng.normal(size=(2, 2)).astype(np.float16),
        "d/ints": rng.integers(-(2**40), 2**40, size=(2, 3)),
        "e/scalar": np.float32(1.5),
        "f/empty": np.zeros((0, 3), np.int32),
    }
    write_checkpoint(tmp_path / "model.ckpt", tensors)
    reader = TFCheckpointReader(tmp_path / "model.ckpt")
    assert reader.shapes() == {name: np.shape(value) for name, value in tensors.items()}
    for name, value in tensors.items():
        read = reader.read(name)
        assert read.dtype == np.asarray(value).dtype, name
        np.testing.assert_array_equal(read, value, err_msg=name)


def test_missing_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.ckpt.index"):
        TFCheckpointReader(tmp_path / "model.ckpt")


def test_missing_data_file(checkpoint_copy):
    Path(f"{checkpoint_copy}.data-00000-of-00001").unlink()
    reader = TFCheckpointReader(checkpoint_copy)  # the index alone lists the tensors
    with pytest.raises(FileNotFoundError, match="model.ckpt.data-00000-of-00001"):
        reader.read("rannet/mlm-matching/bias")


def test_truncated_data_file(checkpoint_copy):
    data = Path(f"{checkpoint_copy}.data-00000-of-00001")
    data.write_bytes(data.read_bytes()[:100])
    reader = TFCheckpointReader(checkpoint_copy)
    last = max(reader.entries.values(), key=lambda entry: entry.offset)
    with pytest.raises(CheckpointFormatError, match="runs past the end"):
        reader.read(last.name)


def test_damaged_index(checkpoint_copy):
    index = Path(f"{checkpoint_copy}.index")
    content = bytearray(index.read_bytes())
    content[100] ^= 0xFF
    index.write_bytes(bytes(content))
    with pytest.raises(CheckpointFormatError, match="model.ckpt.index: block checksum mismatch"):
        TFCheckpointReader(checkpoint_copy)


def test_not_a_checkpoint_index(tmp_path):
    (tmp_path / "model.ckpt.index").write_bytes(b"not a checkpoint" * 8)
    with pytest.raises(CheckpointFormatError, match="not a TensorFlow checkpoint index"):
        TFCheckpointReader(tmp_path / "model.ckpt")


def test_compressed_index_blocks_are_refused(tmp_path):
    write_checkpoint(tmp_path / "model.ckpt", {"x": np.zeros(2, np.float32)}, compression=1)
    with pytest.raises(CheckpointFormatError, match="compressed index blocks"):
        TFCheckpointReader(tmp_path / "model.ckpt")


# ---- tensor checksums --------------------------------------------------------------------------------------------


def test_crc32c_matches_the_byte_by_byte_definition():
    """The sliced NumPy CRC32C equals the plain loop at every size class (odd slice counts, padding, one slice)."""
    assert _crc32c(b"123456789") == 0xE3069283  # the CRC32C check value
    rng = np.random.default_rng(0)
    for size in (0, 3, 4095, 4096, 4097, 65_537, 1_000_003):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert _crc32c(data) == _crc32c_python(data), size


def flip_data_byte(prefix, entry, position=5, shard=0):
    """Flip one byte of a tensor's bytes in its data shard (XOR 0x01: a silent change to one float)."""
    path = Path(f"{prefix}.data-{shard:05d}-of-{TFCheckpointReader(prefix).num_shards:05d}")
    content = bytearray(path.read_bytes())
    content[entry.offset + position] ^= 0x01
    path.write_bytes(bytes(content))


def test_a_flipped_byte_in_the_data_file_names_the_tensor(checkpoint_copy):
    """A TensorFlow-written checkpoint with one damaged byte: the tensor that holds it fails, the others read."""
    name = "rannet/ran-0/encode-attn/dense-q/kernel"
    reader = TFCheckpointReader(checkpoint_copy)
    intact = reader.read(name)
    flip_data_byte(checkpoint_copy, reader.entries[name])
    reader = TFCheckpointReader(checkpoint_copy)
    with pytest.raises(CheckpointFormatError, match=rf"data-00000-of-00001: tensor '{name}' fails its checksum"):
        reader.read(name)
    reader.read("rannet/mlm-matching/bias")  # other tensors are unaffected
    damaged = TFCheckpointReader(checkpoint_copy, verify_checksums=False).read(name)  # what was read before
    assert np.isfinite(damaged).all() and (damaged != intact).sum() == 1


def test_a_flipped_byte_in_a_large_or_sliced_tensor(tmp_path):
    """Large tensors take the NumPy path; tensors saved in slices are checked slice by slice."""
    rng = np.random.default_rng(1)
    write_checkpoint(tmp_path / "model.ckpt", {"big": rng.normal(size=(300, 1000)).astype(np.float32)})
    reader = TFCheckpointReader(tmp_path / "model.ckpt")
    reader.read("big")
    flip_data_byte(tmp_path / "model.ckpt", reader.entries["big"], position=1_000_001)
    with pytest.raises(CheckpointFormatError, match="tensor 'big' fails its checksum"):
        TFCheckpointReader(tmp_path / "model.ckpt").read("big")

    folder = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "tf_bundle", folder)
    reader = TFCheckpointReader(folder / "sharded")
    name = next(name for name, entry in sorted(reader.entries.items()) if entry.slices)
    first_slice = _parse_entry(name, reader.slice_entries[_slice_key(name, reader.entries[name].slices[0])], "")
    flip_data_byte(folder / "sharded", first_slice, position=0, shard=first_slice.shard)
    with pytest.raises(CheckpointFormatError, match=f"tensor '{name}' fails its checksum"):
        TFCheckpointReader(folder / "sharded").read(name)
