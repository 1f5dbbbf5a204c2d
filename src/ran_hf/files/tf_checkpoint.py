"""Read TensorFlow checkpoints (the "V2" tensor-bundle format) with NumPy alone, no TensorFlow needed.

A checkpoint with prefix `P` is a set of files:

* `P.index`: an SSTable (the LevelDB table format) that maps every tensor name to a serialized `BundleEntryProto`
  (dtype, shape, shard, offset and size of the tensor's bytes). The empty key holds a `BundleHeaderProto` (number of
  shards, endianness).
* `P.data-SSSSS-of-NNNNN`: the raw tensor bytes of each shard, row-major, in the byte order the header names.

TensorFlow writes the index uncompressed; this reader checks the index's block checksums and every tensor's CRC32C
(stored in its index entry), as TensorFlow does, so that a damaged data file is an error naming the tensor rather
than wrong weights. The CRC32C is computed with NumPy over many slices of the bytes at once (about 0.6 s per 100 MB).

Numeric tensors are read, whole or saved in slices (as TensorFlow's sharding policies save large tensors). Strings
(such as the `_CHECKPOINTABLE_OBJECT_GRAPH` entry of object-based checkpoints) are listed but cannot be read.

Example:

```python
>>> from ran_hf.files.tf_checkpoint import TFCheckpointReader

>>> reader = TFCheckpointReader("pretrained/model.ckpt")
>>> reader.shapes()["rannet/token-embedding/embeddings"]
(30522, 768)
>>> embeddings = reader.read("rannet/token-embedding/embeddings")  # a numpy.ndarray
```
"""

import os
import struct
from dataclasses import dataclass

import numpy as np


__all__ = ["CheckpointFormatError", "TFCheckpointEntry", "TFCheckpointReader"]


class CheckpointFormatError(ValueError):
    """A checkpoint file is missing, damaged, or uses a feature this reader does not support."""


# --------------------------------------------------------------------------------------------------------------------
# Protocol buffer wire format (only what BundleHeaderProto and BundleEntryProto need)
# --------------------------------------------------------------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def _read_varint(buffer: bytes, position: int) -> tuple[int, int]:
    """Decode a base-128 varint at `position`; returns (value, position after it)."""
    result, shift = 0, 0
    while True:
        if position >= len(buffer):
            raise CheckpointFormatError("truncated varint")
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise CheckpointFormatError("varint longer than 64 bits")


def _parse_message(buffer: bytes) -> dict[int, list]:
    """Split a serialized protocol buffer message into {field number: [raw values]} (ints or bytes)."""
    fields: dict[int, list] = {}
    position = 0
    while position < len(buffer):
        key, position = _read_varint(buffer, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, position = _read_varint(buffer, position)
        elif wire_type == _FIXED64:
            value, position = int.from_bytes(buffer[position : position + 8], "little"), position + 8
        elif wire_type == _FIXED32:
            value, position = int.from_bytes(buffer[position : position + 4], "little"), position + 4
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _read_varint(buffer, position)
            value, position = bytes(buffer[position : position + length]), position + length
        else:
            raise CheckpointFormatError(f"unsupported protocol buffer wire type {wire_type}")
        if position > len(buffer):
            raise CheckpointFormatError("truncated protocol buffer message")
        fields.setdefault(number, []).append(value)
    return fields


def _signed(value: int) -> int:
    """Reinterpret a varint-decoded int32/int64 as signed (negative values are encoded in 64 bits)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# --------------------------------------------------------------------------------------------------------------------
# "Ordered code": the key encoding of tensor slices (TensorFlow's `EncodeTensorNameSlice`)
# --------------------------------------------------------------------------------------------------------------------

# Header bits of a signed number encoded in 1 .. 10 bytes.
_SIGNED_HEADER_BITS = [
    (0, 0),
    (0x80, 0),
    (0xC0, 0),
    (0xE0, 0),
    (0xF0, 0),
    (0xF8, 0),
    (0xFC, 0),
    (0xFE, 0),
    (0xFF, 0),
    (0xFF, 0x80),
    (0xFF, 0xC0),
]


def _ordered_unsigned(value: int) -> bytes:
    """A non-negative number: its byte count, then its big-endian bytes."""
    raw = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(raw)]) + raw


def _ordered_string(text: bytes) -> bytes:
    """A string with 0x00 and 0xff escaped, terminated by 0x00 0x01."""
    escaped = bytearray()
    for byte in text:
        escaped += b"\x00\xff" if byte == 0 else b"\xff\x00" if byte == 0xFF else bytes([byte])
    return bytes(escaped) + b"\x00\x01"


def _ordered_signed(value: int) -> bytes:
    """A signed number in 1 to 10 bytes: leading header bits give the length; negative numbers are complemented."""
    magnitude = ~value if value < 0 else value
    if magnitude < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    length = magnitude.bit_length() // 7 + 1
    encoded = bytearray(value.to_bytes(10, "big", signed=True)[10 - length :])
    encoded[0] ^= _SIGNED_HEADER_BITS[length][0]
    encoded[1] ^= _SIGNED_HEADER_BITS[length][1]
    return bytes(encoded)


def _slice_key(name: str, extents: tuple[tuple[int, int | None], ...]) -> bytes:
    """The index key of one saved slice of tensor `name`; a None length is the full extent (encoded as -1)."""
    key = _ordered_unsigned(0) + _ordered_string(name.encode("utf-8")) + _ordered_unsigned(len(extents))
    for start, length in extents:
        key += _ordered_signed(start) + _ordered_signed(-1 if length is None else length)
    return key


# --------------------------------------------------------------------------------------------------------------------
# CRC32C (Castagnoli), for the checksums of index blocks and tensors
# --------------------------------------------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()
_CRC32C_TABLE_NP = np.array(_CRC32C_TABLE, dtype=np.uint32)
_SMALL_INPUT = 4096  # below this many bytes the byte-by-byte loop is fast enough
_MAX_LANES = 1 << 16

# The CRC register is linear over GF(2): a "zero bytes" operator (what feeding N zero bytes does to the register) is
# a 32 x 32 bit matrix, kept as the images of the 32 register bits.
_ONE_ZERO_BYTE = [_CRC32C_TABLE[(1 << bit) & 0xFF] ^ ((1 << bit) >> 8) for bit in range(32)]


def _apply_operator(operator: list[int], register: int) -> int:
    result, bit = 0, 0
    while register:
        if register & 1:
            result ^= operator[bit]
        register >>= 1
        bit += 1
    return result


def _compose(outer: list[int], inner: list[int]) -> list[int]:
    return [_apply_operator(outer, image) for image in inner]


def _zero_bytes_operator(count: int) -> list[int]:
    result, power = [1 << bit for bit in range(32)], _ONE_ZERO_BYTE
    while count:
        if count & 1:
            result = _compose(power, result)
        power = _compose(power, power)
        count >>= 1
    return result


def _apply_operator_np(operator: list[int], registers: np.ndarray) -> np.ndarray:
    """`operator` applied to every register of a uint32 array, through one 256-entry table per register byte."""
    images, values = np.array(operator, dtype=np.uint32), np.arange(256, dtype=np.uint32)
    result = np.zeros_like(registers)
    for byte in range(4):
        table = np.zeros(256, dtype=np.uint32)
        for bit in range(8):
            table ^= np.where((values >> bit) & 1, images[8 * byte + bit], np.uint32(0)).astype(np.uint32)
        result ^= table[(registers >> np.uint32(8 * byte)) & 0xFF]
    return result


def _crc32c_python(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _crc32c(data: bytes) -> int:
    """CRC32C of `data`. Large inputs are cut into up to 65536 equal slices whose registers advance together, one
    NumPy step per byte position; the slices' registers are then merged pairwise with zero-bytes operators."""
    size = len(data)
    if size < _SMALL_INPUT:
        return _crc32c_python(data)
    lanes = min(_MAX_LANES, size // 256)
    length = -(-size // lanes)
    # Leading zero bytes leave a zero register unchanged, so the input is padded at the front; the initial register
    # 0xFFFFFFFF is the same as complementing the first four bytes and starting from zero.
    padded = np.zeros(lanes * length, dtype=np.uint8)
    start = lanes * length - size
    padded[start:] = np.frombuffer(data, dtype=np.uint8)
    padded[start : start + 4] ^= 0xFF
    columns = np.ascontiguousarray(padded.reshape(lanes, length).T)
    registers = np.zeros(lanes, dtype=np.uint32)
    for column in columns:
        registers = _CRC32C_TABLE_NP[(registers ^ column) & 0xFF] ^ (registers >> np.uint32(8))
    operator = _zero_bytes_operator(length)  # advances a register past one slice
    while len(registers) > 1:
        if len(registers) % 2:
            registers = np.concatenate([np.zeros(1, dtype=np.uint32), registers])  # a leading all-zero slice
        registers = _apply_operator_np(operator, registers[0::2]) ^ registers[1::2]
        operator = _compose(operator, operator)
    return int(registers[0]) ^ 0xFFFFFFFF


def _unmask_crc(masked: int) -> int:
    """LevelDB stores checksums "masked" (rotated and offset); undo that."""
    rotated = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------------------------------
# SSTable (LevelDB table format)
# --------------------------------------------------------------------------------------------------------------------

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the 8-byte magic number
_BLOCK_TRAILER_SIZE = 5  # compression type (1 byte) and masked CRC32C (4 bytes)
_NO_COMPRESSION = 0


def _read_block(table: bytes, handle: bytes, path: str) -> bytes:
    """The contents of the block that a serialized BlockHandle (offset, size varints) points to, checksum verified."""
    offset, position = _read_varint(handle, 0)
    size, _ = _read_varint(handle, position)
    end = offset + size
    if end + _BLOCK_TRAILER_SIZE > len(table):
        raise CheckpointFormatError(f"{path}: a block runs past the end of the file (truncated index?)")
    block, compression = table[offset:end], table[end]
    (masked_crc,) = struct.unpack_from("<I", table, end + 1)
    if _crc32c(table[offset : end + 1]) != _unmask_crc(masked_crc):
        raise CheckpointFormatError(f"{path}: block checksum mismatch (the index file is damaged)")
    if compression != _NO_COMPRESSION:
        raise CheckpointFormatError(
            f"{path}: compressed index blocks (type {compression}) are not supported; TensorFlow writes checkpoint "
            "indexes uncompressed"
        )
    return block


def _block_entries(block: bytes, path: str):
    """Yield (key, value) of every entry of a block; keys are prefix-compressed against the previous key."""
    if len(block) < 4:
        raise CheckpointFormatError(f"{path}: block too short")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    entries_end = len(block) - 4 - 4 * num_restarts
    if entries_end < 0:
        raise CheckpointFormatError(f"{path}: bad block restart array")
    key, position = b"", 0
    while position < entries_end:
        shared, position = _read_varint(block, position)
        unshared, position = _read_varint(block, position)
        value_length, position = _read_varint(block, position)
        if shared > len(key) or position + unshared + value_length > entries_end:
            raise CheckpointFormatError(f"{path}: corrupt block entry")
        key = key[:shared] + block[position : position + unshared]
        position += unshared
        yield key, block[position : position + value_length]
        position += value_length


def _read_table(path: str) -> dict[bytes, bytes]:
    """All key/value pairs of an SSTable file."""
    with open(path, "rb") as file:
        table = file.read()
    if len(table) < _FOOTER_SIZE:
        raise CheckpointFormatError(f"{path}: too short to be a TensorFlow checkpoint index")
    footer = table[-_FOOTER_SIZE:]
    (magic,) = struct.unpack_from("<Q", footer, _FOOTER_SIZE - 8)
    if magic != _TABLE_MAGIC:
        raise CheckpointFormatError(
            f"{path}: not a TensorFlow checkpoint index (bad magic number); only the V2 (tensor bundle) format is read"
        )
    _, position = _read_varint(footer, 0)  # metaindex handle: offset (unused)
    _, position = _read_varint(footer, position)  # metaindex handle: size (unused)
    index_handle = footer[position:]
    entries = {}
    for _, data_handle in _block_entries(_read_block(table, index_handle, path), path):
        for key, value in _block_entries(_read_block(table, data_handle, path), path):
            entries[bytes(key)] = bytes(value)
    return entries


# --------------------------------------------------------------------------------------------------------------------
# Tensor bundle
# --------------------------------------------------------------------------------------------------------------------

# TensorFlow DataType enum -> (name, little-endian NumPy dtype). bfloat16 has no NumPy dtype: read as uint16, widened.
_DTYPES = {
    1: ("float32", "<f4"),
    2: ("float64", "<f8"),
    3: ("int32", "<i4"),
    4: ("uint8", "u1"),
    5: ("int16", "<i2"),
    6: ("int8", "i1"),
    7: ("string", None),
    9: ("int64", "<i8"),
    10: ("bool", "?"),
    14: ("bfloat16", "<u2"),
    17: ("uint16", "<u2"),
    19: ("float16", "<f2"),
    22: ("uint32", "<u4"),
    23: ("uint64", "<u8"),
}


@dataclass(frozen=True)
class TFCheckpointEntry:
    """Where one tensor lives: its dtype and shape, and the byte range in its data shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    slices: tuple  # ((start, length or None) per axis) for each saved slice; empty for a tensor saved whole
    masked_crc32c: int = 0  # the CRC32C of the bytes, masked as LevelDB masks it (proto3: absent means 0)


def _parse_entry(name: str, value: bytes, path: str) -> TFCheckpointEntry:
    fields = _parse_message(value)
    dtype_code = fields.get(1, [0])[-1]
    if dtype_code not in _DTYPES:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has an unsupported dtype (TensorFlow enum {dtype_code})")
    shape = ()
    if 2 in fields:
        shape_fields = _parse_message(fields[2][-1])
        if shape_fields.get(3, [0])[-1]:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has an unknown rank")
        shape = tuple(_signed(_parse_message(dim).get(1, [0])[-1]) for dim in shape_fields.get(2, []))
    return TFCheckpointEntry(
        name=name,
        dtype=_DTYPES[dtype_code][0],
        shape=shape,
        shard=fields.get(3, [0])[-1],
        offset=fields.get(4, [0])[-1],
        size=fields.get(5, [0])[-1],
        slices=tuple(_parse_slice(raw) for raw in fields.get(7, [])),
        masked_crc32c=fields.get(6, [0])[-1],
    )


def _parse_slice(raw: bytes) -> tuple[tuple[int, int | None], ...]:
    """A TensorSliceProto: (start, length) per axis, length None for the full extent."""
    extents = []
    for extent in _parse_message(raw).get(1, []):
        fields = _parse_message(extent)
        extents.append((_signed(fields.get(1, [0])[-1]), _signed(fields[2][-1]) if 2 in fields else None))
    return tuple(extents)


class TFCheckpointReader:
    """List and read the tensors of a TensorFlow V2 checkpoint, given its prefix (e.g. `folder/model.ckpt`).

    Every tensor read is checked against the CRC32C its index entry holds (`verify_checksums=False` skips that).
    """

    def __init__(self, prefix: str | os.PathLike, verify_checksums: bool = True):
        self.prefix = os.fspath(prefix)
        self.verify_checksums = verify_checksums
        self.index_path = self.prefix + ".index"
        if not os.path.isfile(self.index_path):
            raise FileNotFoundError(f"TensorFlow checkpoint index not found: {self.index_path}")
        table = _read_table(self.index_path)
        if b"" not in table:
            raise CheckpointFormatError(f"{self.index_path}: the bundle header (empty key) is missing")
        header = _parse_message(table.pop(b""))
        self.num_shards = header.get(1, [1])[-1]
        if header.get(2, [0])[-1] != 0:
            raise CheckpointFormatError(f"{self.index_path}: big-endian checkpoints are not supported")
        # Keys of tensor slices start with a 0 byte; the whole tensor's entry lists them.
        self.slice_entries = {key: value for key, value in table.items() if key.startswith(b"\x00")}
        self.entries = {}
        for key, value in table.items():
            if not key.startswith(b"\x00"):
                name = key.decode("utf-8")
                self.entries[name] = _parse_entry(name, value, self.index_path)

    def data_path(self, shard: int) -> str:
        return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{tensor name: shape} for every tensor, in name order (what `tf.train.list_variables` lists)."""
        return {name: self.entries[name].shape for name in sorted(self.entries)}

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` as a NumPy array (bfloat16 is widened to float32)."""
        if name not in self.entries:
            raise KeyError(f"{self.prefix}: no tensor named {name!r}")
        entry = self.entries[name]
        if _DTYPES_BY_NAME[entry.dtype] is None:
            raise CheckpointFormatError(f"{self.index_path}: tensor {name!r} holds {entry.dtype}s, which are not read")
        if not entry.slices:
            return self._read_entry(entry)
        tensor = None
        for extents in entry.slices:
            key = _slice_key(name, extents)
            if key not in self.slice_entries:
                raise CheckpointFormatError(f"{self.index_path}: a slice of tensor {name!r} is missing")
            part = self._read_entry(_parse_entry(name, self.slice_entries[key], self.index_path))
            if tensor is None:
                tensor = np.zeros(entry.shape, dtype=part.dtype)
            region = tuple(
                slice(start, start + (size if length is None else length))
                for (start, length), size in zip(extents, entry.shape, strict=True)
            )
            tensor[region] = part
        return tensor

    def _read_entry(self, entry: TFCheckpointEntry) -> np.ndarray:
        """The bytes one index entry points to, as an array of its dtype and shape."""
        name, numpy_dtype = entry.name, _DTYPES_BY_NAME[entry.dtype]
        if entry.shard >= self.num_shards:
            raise CheckpointFormatError(
                f"{self.index_path}: tensor {name!r} names shard {entry.shard} of {self.num_shards}"
            )
        dtype = np.dtype(numpy_dtype)
        count = int(np.prod(entry.shape, dtype=np.int64))
        if entry.size != count * dtype.itemsize:
            raise CheckpointFormatError(
                f"{self.index_path}: tensor {name!r} of shape {entry.shape} ({entry.dtype}) should take "
                f"{count * dtype.itemsize} bytes, the index says {entry.size}"
            )
        path = self.data_path(entry.shard)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"TensorFlow checkpoint data file not found: {path}")
        with open(path, "rb") as file:
            file.seek(entry.offset)
            data = file.read(entry.size)
        if len(data) != entry.size:
            raise CheckpointFormatError(f"{path}: tensor {name!r} runs past the end of the file (truncated data?)")
        if self.verify_checksums:
            expected, found = _unmask_crc(entry.masked_crc32c), _crc32c(data)
            if found != expected:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} fails its checksum (CRC32C {found:#010x}, the index says "
                    f"{expected:#010x}): the data file is damaged"
                )
        array = np.frombuffer(data, dtype=dtype, count=count).reshape(entry.shape)
        if entry.dtype == "bfloat16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.astype(dtype.newbyteorder("="), copy=True)


_DTYPES_BY_NAME = dict(_DTYPES.values())
