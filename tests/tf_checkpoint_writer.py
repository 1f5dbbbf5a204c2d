"""Write small TensorFlow V2 checkpoints without TensorFlow, so that tests can build broken or altered ones.

The layout is the one `ran_hf.files.tf_checkpoint` documents and reads: an SSTable index (one data block, no prefix
compression, uncompressed) of serialized `BundleEntryProto`s, and one data shard.
"""

import struct

import numpy as np

from ran_hf.files.tf_checkpoint import _crc32c


_DTYPE_CODES = {"float32": 1, "float64": 2, "int32": 3, "int64": 9, "float16": 19}
_TABLE_MAGIC = 0xDB4775248B80FB57


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    """One protocol buffer field: a varint, or length-delimited bytes."""
    if isinstance(value, bytes):
        return _varint(number << 3 | 2) + _varint(len(value)) + value
    return _varint(number << 3) + _varint(value)


def _masked_crc(data: bytes) -> int:
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A block with a restart point at every entry (no shared key prefixes)."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += _varint(0) + _varint(len(key)) + _varint(len(value)) + key + value
    for restart in restarts or [0]:
        body += struct.pack("<I", restart)
    body += struct.pack("<I", len(restarts) or 1)
    return bytes(body)


def write_checkpoint(prefix: str, tensors: dict[str, np.ndarray], *, compression: int = 0) -> None:
    """Write `tensors` as checkpoint `prefix` (`prefix.index`, `prefix.data-00000-of-00001`), keys sorted.

    `compression` is written as the block compression type (0 = none), to test readers against other values.
    """
    data, entries = bytearray(), []
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes(order="C")
        shape = b"".join(_field(2, _field(1, dim)) for dim in array.shape)
        entry = (
            _field(1, _DTYPE_CODES[array.dtype.name])
            + _field(2, shape)
            + _field(4, len(data))
            + _field(5, len(raw))
            + _varint(6 << 3 | 5)
            + struct.pack("<I", _masked_crc(raw))
        )
        entries.append((name.encode("utf-8"), entry))
        data += raw
    header = _field(1, 1) + _field(3, _field(1, 1))  # one shard, little-endian, producer version 1

    table = bytearray()

    def append_block(block: bytes) -> bytes:
        """Append a block and its trailer; return its serialized BlockHandle."""
        handle = _varint(len(table)) + _varint(len(block))
        trailer_type = bytes([compression])
        table.extend(block + trailer_type + struct.pack("<I", _masked_crc(block + trailer_type)))
        return handle

    data_handle = append_block(_block([(b"", header)] + entries))
    metaindex_handle = append_block(_block([]))
    last_key = entries[-1][0] if entries else b""
    index_handle = append_block(_block([(last_key + b"\xff", data_handle)]))
    footer = (metaindex_handle + index_handle).ljust(40, b"\0") + struct.pack("<Q", _TABLE_MAGIC)
    table.extend(footer)

    with open(f"{prefix}.index", "wb") as file:
        file.write(table)
    with open(f"{prefix}.data-00000-of-00001", "wb") as file:
        file.write(data)
