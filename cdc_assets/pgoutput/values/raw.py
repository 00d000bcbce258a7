"""A column of raw pgoutput values seen through numpy, and the checks every codec shares.

Values stay in the Arrow buffers they arrived in: ``data`` is the data buffer as ``uint8``,
``offsets`` the value boundaries into it (``int64``, one more than the row count) and ``valid`` the
rows that carry a value. Codecs read fixed-width values, first/last bytes or padded windows from
these without creating a Python object per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.errors import DecodeError

RawArray = pa.BinaryArray | pa.LargeBinaryArray

_MAX_INT32_BYTES = 2**31 - 1
_SHOWN_BYTES = 60


@dataclass(slots=True)
class RawColumn:
    """Raw values of one column (or of the elements of an array column).

    For array elements, ``rows`` maps each value to the row of the column it came from and
    ``context`` says whose elements they are, so that errors name the row the caller knows.
    """

    type_name: str
    array: pa.Array
    data: np.ndarray
    offsets: np.ndarray
    valid: np.ndarray
    rows: np.ndarray | None = None
    context: str = "value"

    @classmethod
    def of(cls, array: pa.Array, type_name: str, rows: np.ndarray | None = None, context: str = "value") -> RawColumn:
        if not (pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type)):
            raise TypeError(f"raw values must be binary or large_binary, not {array.type}")
        n = len(array)
        validity, offsets_buf, data_buf = array.buffers()
        offset_type = np.int64 if pa.types.is_large_binary(array.type) else np.int32
        offsets = np.frombuffer(offsets_buf, offset_type, n + 1, array.offset * offset_type().itemsize)
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.empty(0, np.uint8)
        if array.null_count:
            bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
            valid = bits[array.offset : array.offset + n].astype(bool)
        else:
            valid = np.ones(n, bool)
        return cls(type_name, array, data, offsets.astype(np.int64), valid, rows, context)

    def __len__(self) -> int:
        return len(self.valid)

    @property
    def starts(self) -> np.ndarray:
        return self.offsets[:-1]

    @property
    def ends(self) -> np.ndarray:
        return self.offsets[1:]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def has_nulls(self) -> bool:
        return bool(self.array.null_count > 0)

    @property
    def mask(self) -> np.ndarray | None:
        """The null mask for ``pa.array(..., mask=)``, ``None`` when every row has a value."""
        return ~self.valid if self.has_nulls else None

    def raw(self, index: int) -> bytes:
        return self.data[self.offsets[index] : self.offsets[index + 1]].tobytes()

    def text(self, index: int) -> str:
        """A value's text, as PostgreSQL sent it (the exact text recorded for special values)."""
        return self.raw(index).decode("utf-8")

    def error(self, index: int, detail: str) -> DecodeError:
        """A DecodeError for value ``index``, naming the column type and its row."""
        row = int(self.rows[index]) if self.rows is not None else int(index)
        return DecodeError(f"{self.type_name} {self.context} at row {row}: {detail}", message_type=None, offset=None)

    def bad_value(self, index: int, detail: str) -> DecodeError:
        shown = self.raw(index)
        suffix = b"..." if len(shown) > _SHOWN_BYTES else b""
        return self.error(index, f"{detail}: {shown[:_SHOWN_BYTES] + suffix!r}")

    def check(self, bad: np.ndarray, detail: str) -> None:
        """Raise for the first row with a value that ``bad`` flags."""
        hits = np.flatnonzero(bad & self.valid)
        if hits.size:
            raise self.bad_value(int(hits[0]), detail)

    def fixed(self, width: int) -> np.ndarray:
        """Values that must be exactly ``width`` bytes, as an ``(n, width)`` matrix (zeros for nulls)."""
        lengths = self.lengths
        wrong = self.valid & (lengths != width)
        if wrong.any():
            index = int(np.flatnonzero(wrong)[0])
            raise self.bad_value(index, f"expected {width} bytes, got {lengths[index]}")
        start, end = int(self.offsets[0]), int(self.offsets[-1])
        compact = self.data[start:end]
        if (lengths == width).all():  # every row, null or not, holds `width` bytes
            return compact.reshape(len(self), width)
        out = np.zeros((len(self), width), np.uint8)
        if end - start == int(self.valid.sum()) * width:  # null rows are empty: values are contiguous
            out[self.valid] = compact.reshape(-1, width)
        else:
            rows = np.flatnonzero(self.valid)
            out[rows] = self.data[self.offsets[rows, None] + np.arange(width)]
        return out

    def padded(self, width: int, fill: int) -> np.ndarray:
        """Values of at most ``width`` bytes, left-aligned in an ``(n, width)`` matrix of ``fill``."""
        lengths = self.lengths
        self.check(lengths > width, f"longer than {width} bytes")
        lengths = np.where(self.valid, lengths, 0)
        positions = np.arange(width)
        inside = positions < lengths[:, None]
        index = np.where(inside, self.offsets[:-1, None] + positions, 0)
        return np.where(inside, self.data[index] if self.data.size else fill, fill).astype(np.uint8)

    def byte_at(self, position: int, from_end: bool = False) -> np.ndarray:
        """The byte at ``position`` of each value (counted from the end when ``from_end``, where 1
        is the last byte), or 0 where the value is null or too short."""
        inside = self.valid & (self.lengths >= (position if from_end else position + 1))
        index = np.where(inside, (self.ends - position) if from_end else (self.starts + position), 0)
        return np.where(inside, self.data[index] if self.data.size else 0, 0)

    def strings(self) -> pa.StringArray:
        """The values as UTF-8 strings (validated)."""
        try:
            return pc.cast(self.array, pa.string())
        except pa.ArrowInvalid as exc:
            for index in np.flatnonzero(self.valid):
                try:
                    self.raw(int(index)).decode("utf-8")
                except UnicodeDecodeError:
                    raise self.bad_value(int(index), "invalid UTF-8") from None
            raise self.error(0, f"column too large for one string array: {exc}") from None

    def binaries(self) -> pa.BinaryArray:
        return self.array if pa.types.is_binary(self.array.type) else pc.cast(self.array, pa.binary())

    def cast(self, values: pa.Array, target: pa.DataType) -> pa.Array:
        """``pc.cast`` that names the first value it rejects in a DecodeError."""
        try:
            return pc.cast(values, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            for index in np.flatnonzero(self.valid):
                try:
                    pc.cast(values.slice(int(index), 1), target)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as row_exc:
                    raise self.bad_value(int(index), f"not a valid {self.type_name} ({row_exc})") from None
            raise self.error(0, f"cast to {target} failed: {exc}") from None

    def to_arrow(self, values: np.ndarray, arrow_type: pa.DataType, nulls: np.ndarray | None = None) -> pa.Array:
        """A typed array from numpy values, null where the column is null or ``nulls`` is set."""
        mask = self.mask if nulls is None else (~self.valid | nulls)
        return pa.array(values, type=arrow_type, mask=mask)

    def drop_prefix(self, size: int) -> RawColumn:
        """The same column without the first ``size`` bytes of each value (values are checked to
        be at least that long by the caller)."""
        drop = np.where(self.valid, size, 0)
        offsets, data = gather(self.data, self.starts + drop, self.lengths - drop)
        array = binary_array(offsets, data, self.valid)
        return RawColumn(self.type_name, array, data, offsets, self.valid, self.rows, self.context)


def null_where(values: pa.Array, mask: np.ndarray) -> pa.Array:
    """``values`` with the rows flagged in ``mask`` set to null."""
    return pc.if_else(pa.array(mask), pa.scalar(None, values.type), values) if mask.any() else values


def big_endian(data: np.ndarray, at: np.ndarray, width: int, *, signed: bool = True) -> np.ndarray:
    """The big-endian integers of ``width`` (2 or 4) bytes at each of ``at``, as int32 (unsigned
    4-byte values: int64), gathered through a view of ``data`` that has a value at every byte (one
    unaligned gather, about three times as fast as gathering a byte at a time)."""
    kind = np.dtype(f">{'i' if signed else 'u'}{width}")
    result = np.int64 if width == 4 and not signed else np.int32
    if len(data) < width:
        empty: np.ndarray = np.empty(0, result)[at]  # nothing to read: an empty ``at``, or IndexError
        return empty
    every = np.ndarray((len(data) - width + 1,), kind, buffer=data, strides=(1,))
    values: np.ndarray = every[at].astype(result)
    return values


def gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``data[starts[i]:starts[i]+lengths[i]]``: returns (offsets, bytes)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return offsets, data[index]


def validity_buffer(valid: np.ndarray) -> pa.Buffer | None:
    if valid.all():
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def binary_array(
    offsets: np.ndarray, data: np.ndarray, valid: np.ndarray, arrow_type: pa.DataType = pa.binary()
) -> pa.Array:
    """A binary (or string) array over numpy offsets (starting at 0) and bytes."""
    if offsets[-1] > _MAX_INT32_BYTES:
        raise DecodeError(
            f"{offsets[-1]} bytes of {arrow_type} values: more than one array holds; convert smaller batches",
            message_type=None,
            offset=None,
        )
    return pa.Array.from_buffers(
        arrow_type,
        len(valid),
        [validity_buffer(valid), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(np.ascontiguousarray(data))],
    )
