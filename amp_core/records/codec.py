"""How a numpy array is stored: a 20-byte header (dtype, shape, CRC-32 of the values), then the values delta-encoded
(integers and float64: the differences of their bit patterns), byte-shuffled and zlib-compressed.

Why numpy bytes + zlib and not Arrow IPC: a chunk is one lane's columns of one flush (a few hundred to a few thousand
values each); stdlib zlib after a byte shuffle stores them in 0-3 bytes a value (constant figures cost nothing), any
language can read the layout above, and decoding needs no pyarrow import (~150 ms) on the page's first view. The CRC is
of the decoded values, so a damaged chunk is always reported, never drawn.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

MAGIC = b"AC"
VERSION = 1
_HEADER = struct.Struct("<2sBB4sIII")  # magic, version, flags, dtype, rows, columns, crc32
_DELTA, _SHUFFLE, _MATRIX = 1, 2, 4
_SET = b"ACS1"
COMPRESS_LEVEL = 1
"""zlib's fastest level: the writer encodes on the training thread, and level 6 saves under 5 % here."""


class DamagedData(ValueError):
    """Stored bytes that do not decode to what was written (a damaged chunk or block)."""


def _as_bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.dtype(f"u{values.dtype.itemsize}"))


def encode_array(values: np.ndarray) -> bytes:
    """One 1-D or 2-D array as bytes (a 2-D array is stored column by column: each column compresses on its own)."""
    values = np.asarray(values)
    if values.ndim not in (1, 2):
        raise ValueError(f"only 1-D and 2-D arrays are stored, got shape {values.shape}")
    rows, cols = values.shape[0], values.shape[1] if values.ndim == 2 else 0
    data = np.ascontiguousarray(values.T if values.ndim == 2 else values)
    crc = zlib.crc32(data.tobytes())
    flags = _MATRIX if values.ndim == 2 else 0
    itemsize = data.dtype.itemsize
    if data.dtype.kind in "iu" or data.dtype == np.float64:
        bits = _as_bits(data)
        data = np.diff(bits, axis=-1, prepend=np.zeros((*bits.shape[:-1], 1), dtype=bits.dtype))
        flags |= _DELTA
    payload = data.tobytes()
    if itemsize > 1:
        payload = np.frombuffer(payload, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()
        flags |= _SHUFFLE
    header = _HEADER.pack(MAGIC, VERSION, flags, values.dtype.str.encode().ljust(4), rows, cols, crc)
    return header + zlib.compress(payload, COMPRESS_LEVEL)


def decode_array(blob: bytes) -> np.ndarray:
    """The array `encode_array` stored; DamagedData if the bytes are not that."""
    if len(blob) < _HEADER.size:
        raise DamagedData(f"{len(blob)} bytes, shorter than a header")
    magic, version, flags, dtype_text, rows, cols, crc = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        raise DamagedData(f"not an array header (magic {magic!r}, version {version})")
    try:
        dtype = np.dtype(dtype_text.decode().strip())
        payload = zlib.decompress(blob[_HEADER.size:])
    except (TypeError, ValueError, UnicodeDecodeError, zlib.error) as exc:
        raise DamagedData(str(exc)) from None
    matrix = bool(flags & _MATRIX)
    count = rows * cols if matrix else rows
    if len(payload) != count * dtype.itemsize:
        raise DamagedData(f"{len(payload)} bytes of values where {count} x {dtype} were written")
    if flags & _SHUFFLE:
        payload = np.frombuffer(payload, dtype=np.uint8).reshape(dtype.itemsize, -1).T.tobytes()
    data = np.frombuffer(payload, dtype=dtype)
    shape = (cols, rows) if matrix else (rows,)
    data = data.reshape(shape)
    if flags & _DELTA:
        data = np.cumsum(_as_bits(data), axis=-1, dtype=_as_bits(data).dtype).view(dtype)
    if zlib.crc32(np.ascontiguousarray(data).tobytes()) != crc:
        raise DamagedData("the values do not match their checksum")
    return data.T.copy() if matrix else data


def encode_columns(columns: dict[str, np.ndarray]) -> bytes:
    """Named arrays as one blob (the marks of a chunk, the buckets of a level block)."""
    parts = [_SET, struct.pack("<I", len(columns))]
    for name, values in columns.items():
        blob = encode_array(values)
        encoded = name.encode()
        parts += [struct.pack("<H", len(encoded)), encoded, struct.pack("<I", len(blob)), blob]
    return b"".join(parts)


def decode_columns(blob: bytes, names=None) -> dict[str, np.ndarray]:
    """What `encode_columns` stored; `names`: decode only these (the others are skipped unread)."""
    if blob[:4] != _SET:
        raise DamagedData("not a column set")
    try:
        (count,), at = struct.unpack_from("<I", blob, 4), 8
        out = {}
        for _ in range(count):
            (length,) = struct.unpack_from("<H", blob, at)
            name = blob[at + 2:at + 2 + length].decode()
            at += 2 + length
            (size,) = struct.unpack_from("<I", blob, at)
            at += 4
            if at + size > len(blob):
                raise DamagedData(f"column {name!r} runs past the end")
            if names is None or name in names:
                out[name] = decode_array(blob[at:at + size])
            at += size
    except (struct.error, UnicodeDecodeError) as exc:
        raise DamagedData(str(exc)) from None
    return out


def encode_rows(columns: dict[str, np.ndarray]) -> bytes:
    """A few whole records (every column, any dtypes) as one float64 matrix plus their names: two arrays to decode
    instead of one per column (a chunk's marks; int64 and bool values are exact in float64 below 2**53)."""
    names = ",".join(columns).encode()
    matrix = np.stack([np.asarray(values, dtype=np.float64) for values in columns.values()], axis=1)
    return encode_columns({"names": np.frombuffer(names, dtype=np.uint8), "values": matrix})


def decode_rows(blob: bytes, dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """What `encode_rows` stored, each column back in its dtype (`dtypes`); columns it did not hold are left out."""
    found = decode_columns(blob)
    try:
        names = found["names"].tobytes().decode().split(",")
        values = found["values"]
    except (KeyError, UnicodeDecodeError) as exc:
        raise DamagedData(f"not a set of rows ({exc})") from None
    if values.ndim != 2 or values.shape[1] != len(names):
        raise DamagedData(f"{values.shape} values for {len(names)} columns")
    return {name: values[:, i].astype(dtypes[name]) for i, name in enumerate(names) if name in dtypes}
