"""Arrays -> nested Arrow lists.

The array values of a column are taken apart into one column of element values, which the element
type's codec converts in bulk; the lists are then rebuilt as ``ndims`` levels of ``list<...>``.

- Text: literals without quotes, backslashes or nesting (``{1,2,NULL}``) are split by Arrow
  compute; the others are parsed one by one (quoting, escapes, ``NULL`` vs ``"NULL"``, nesting).
- Binary (``array_send``: Int32 ndim, has-null flag, element OID, ndim × (length, lower bound), then
  per element Int32 length, -1 for NULL, and the element's bytes): headers are read vectorized, and
  elements by one vectorized step per element position across all values.

A value that does not fit the column's shape — another dimensionality, lower bounds other than 1 —
or that holds a special element is null with its exact text; from binary input that text is rebuilt
the way ``array_out`` writes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.pgoutput.values.base import Codec, ConvertedColumn, ScalarCodec, convert_column
from cdc_assets.pgoutput.values.raw import RawColumn, binary_array, gather, null_where

MAX_DIMENSIONS = 6  # PostgreSQL's MAXDIM
_HEADER = 12  # ndim, has-null flag, element type oid
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([^{},"\\]+)|([{},])', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_NEEDS_QUOTES = re.compile(r'[{}",\\ \t\n\r\v\f]')


@dataclass(slots=True)
class ArrayShape:
    """An array value's dimensions and lower bounds (both empty for an empty array)."""

    dims: tuple[int, ...]
    lower_bounds: tuple[int, ...]


@dataclass(slots=True)
class _Parsed:
    """A column of array values taken apart.

    Per row: ``ndim`` dimensions with their lengths ``dims`` and ``lower_bounds`` (``ndim`` 0 for
    null rows, empty arrays and rows already in ``special``), and ``counts`` elements; ``elements``
    holds every row's element values in row order.
    """

    ndim: np.ndarray
    dims: np.ndarray
    lower_bounds: np.ndarray
    counts: np.ndarray
    elements: pa.Array
    special: dict[int, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> _Parsed:
        shape = (n, MAX_DIMENSIONS)
        return cls(
            np.zeros(n, np.int64),
            np.zeros(shape, np.int64),
            np.ones(shape, np.int64),
            np.zeros(n, np.int64),
            pa.array([], pa.binary()),
        )

    def shape(self, row: int) -> ArrayShape:
        ndim = int(self.ndim[row])
        return ArrayShape(tuple(self.dims[row, :ndim].tolist()), tuple(self.lower_bounds[row, :ndim].tolist()))


def parse_text_array(text: str) -> tuple[list[str | None], tuple[int, ...]] | None:
    """An array literal as array_out writes it -> its elements in order and its dimensions; None
    when it carries explicit bounds (``[0:1]={7,8}``)."""
    if text.startswith("["):
        return None
    if text == "{}":
        return [], ()
    elements: list[str | None] = []
    dims: list[int | None] = []
    counts: list[int] = []
    leaf_depth = 0
    previous = ""  # the kind of the previous token: "{", "}", "," or "e" (element)
    position = 0
    for match in _TOKEN.finditer(text):
        if match.start() != position or (counts == [] and previous == "}"):
            raise ValueError(f"unexpected character at {position}")
        position = match.end()
        quoted, bare, punctuation = match.groups()
        if punctuation == "{":
            if previous not in ("", "{", ",") or (leaf_depth and len(counts) >= leaf_depth):
                raise ValueError(f"misplaced '{{' at {match.start()}")
            if counts:
                counts[-1] += 1
            counts.append(0)
            if len(counts) > len(dims):
                dims.append(None)
        elif punctuation == "}":
            if previous not in ("e", "}"):
                raise ValueError(f"misplaced '}}' at {match.start()}")
            level = len(counts) - 1
            if dims[level] not in (None, counts[level]):
                raise ValueError("sub-arrays have different lengths")
            dims[level] = counts.pop()
        elif punctuation == ",":
            if previous not in ("e", "}"):
                raise ValueError(f"misplaced ',' at {match.start()}")
        else:
            if previous not in ("{", ",") or leaf_depth not in (0, len(counts)):
                raise ValueError(f"misplaced element at {match.start()}")
            leaf_depth = len(counts)
            counts[-1] += 1
            if quoted is not None:
                elements.append(_ESCAPE.sub(r"\1", quoted))
            else:
                elements.append(None if bare.upper() == "NULL" else bare)
        previous = punctuation or "e"
    if position != len(text) or counts or previous != "}":
        raise ValueError("unbalanced braces")
    return elements, tuple(d for d in dims if d is not None)


def format_array(texts: list[str | None], shape: ArrayShape) -> str:
    """array_out: braces, ``NULL``, quoting and escapes, and ``[lo:hi]=`` for non-default bounds."""
    if not shape.dims:
        return "{}"
    items = ["NULL" if t is None else _quote(t) for t in texts]
    for size in reversed(shape.dims):
        items = ["{" + ",".join(items[i : i + size]) + "}" for i in range(0, len(items), size)]
    prefix = ""
    if any(b != 1 for b in shape.lower_bounds):
        prefix = "".join(f"[{b}:{b + d - 1}]" for b, d in zip(shape.lower_bounds, shape.dims, strict=True)) + "="
    return prefix + items[0]


def _quote(text: str) -> str:
    """An element as array_out writes it: quoted (with ``"`` and ``\\`` escaped) when needed."""
    if text == "" or text.upper() == "NULL" or _NEEDS_QUOTES.search(text) is not None:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _parse_text(col: RawColumn) -> _Parsed:
    """Text array values taken apart; simple one-dimensional literals vectorized."""
    n = len(col)
    strings = col.strings()
    simple = col.valid & (col.byte_at(0) == ord("{")) & (col.byte_at(1, from_end=True) == ord("}"))
    for pattern in ('"', "\\"):
        simple &= ~pc.match_substring(strings, pattern).fill_null(False).to_numpy(zero_copy_only=False)
    for brace in ("{", "}"):
        simple &= pc.count_substring(strings, brace).fill_null(0).to_numpy(zero_copy_only=False) == 1
    nonempty = simple & (col.lengths > 2)
    parts = pc.split_pattern(pc.utf8_slice_codeunits(null_where(strings, ~nonempty), 1, -1), ",")
    simple_elements = parts.flatten()
    empty_element = pc.equal(simple_elements, "").to_numpy(zero_copy_only=False)
    if empty_element.any():
        element_rows = np.repeat(np.flatnonzero(nonempty), pc.list_value_length(parts).to_numpy()[nonempty])
        raise col.bad_value(int(element_rows[np.argmax(empty_element)]), "not a valid array literal (empty element)")
    parsed = _Parsed.empty(n)
    parsed.counts = pc.list_value_length(parts).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    parsed.ndim[nonempty] = 1
    parsed.dims[:, 0] = parsed.counts
    complex_elements: list[str | None] = []
    for row in np.flatnonzero(col.valid & ~simple).tolist():
        text = col.text(row)
        try:
            literal = parse_text_array(text)
        except ValueError as exc:
            raise col.bad_value(row, f"not a valid array literal ({exc})") from None
        if literal is None:
            parsed.special[row] = text
            continue
        elements, dims = literal
        parsed.ndim[row] = len(dims)
        parsed.dims[row, : len(dims)] = dims
        parsed.counts[row] = len(elements)
        complex_elements += elements
    values = pc.if_else(pc.match_like(simple_elements, "null", ignore_case=True), None, simple_elements)
    parsed.elements = pc.cast(
        _in_row_order(values, pa.array(complex_elements, pa.string()), simple, parsed.counts), pa.binary()
    )
    return parsed


def _in_row_order(first: pa.Array, second: pa.Array, from_first: np.ndarray, counts: np.ndarray) -> pa.Array:
    """Interleave two element arrays, each in row order, into one: rows flagged ``from_first``
    take their ``counts`` elements from ``first``, the others from ``second``."""
    if len(second) == 0:
        return first
    first_counts, second_counts = np.where(from_first, counts, 0), np.where(from_first, 0, counts)
    source = np.where(
        from_first, np.cumsum(first_counts) - first_counts, len(first) + np.cumsum(second_counts) - second_counts
    )
    offsets = np.cumsum(counts) - counts
    index = np.repeat(source - offsets, counts) + np.arange(int(counts.sum()))
    return pc.take(pa.concat_arrays([first, second]), pa.array(index))


def _be_int32(data: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The big-endian Int32s at ``positions`` of ``data``."""
    return data[positions[..., None] + np.arange(4)].view(">i4")[..., 0].astype(np.int64)


def _parse_binary(col: RawColumn, element_oid: int) -> _Parsed:
    """Binary array values taken apart, vectorized: the headers of all values at once, then their
    elements one position at a time (a step per element of the longest array)."""
    parsed = _Parsed.empty(len(col))
    rows = np.flatnonzero(col.valid)
    starts, ends = col.starts[rows], col.ends[rows]
    lengths = ends - starts

    def check(bad: np.ndarray, detail: str) -> None:
        if bad.any():
            raise col.bad_value(int(rows[np.argmax(bad)]), f"not a valid binary array ({detail})")

    check(lengths < _HEADER, "shorter than an array header")
    ndim, flags, oid = (_be_int32(col.data, starts + 4 * i) for i in range(3))
    oid &= 0xFFFFFFFF
    check((ndim < 0) | (ndim > MAX_DIMENSIONS) | ((flags != 0) & (flags != 1)), "bad array header")
    check(lengths < _HEADER + 8 * ndim, "shorter than its dimensions")
    check(oid != element_oid, f"element type oid is not {element_oid}")
    used = np.arange(MAX_DIMENSIONS) < ndim[:, None]
    positions = np.where(used, starts[:, None] + _HEADER + 8 * np.arange(MAX_DIMENSIONS), 0)
    dims = np.where(used, _be_int32(col.data, positions), 0)
    lower_bounds = np.where(used, _be_int32(col.data, positions + 4), 1)
    check(np.any(dims < 0, axis=1), "negative dimension")
    position = starts + _HEADER + 8 * ndim
    room = (ends - position) // 4  # every element takes at least its 4-byte length
    check((np.where(used, dims, 1).astype(np.float64).prod(axis=1) > room) & (ndim > 0), "more elements than bytes")
    counts = np.where(ndim > 0, np.where(used, dims, 1).prod(axis=1), 0)
    ndim = np.where(counts > 0, ndim, 0)  # a zero-length dimension is an empty array, as array_recv makes it

    first = np.cumsum(counts) - counts
    element_starts = np.zeros(int(counts.sum()), np.int64)
    element_lengths = np.zeros(element_starts.size, np.int64)
    by_count = np.argsort(-counts, kind="stable")
    sorted_counts = counts[by_count]
    for index in range(int(counts.max(initial=0))):
        active = by_count[: np.searchsorted(-sorted_counts, -index, "left")]  # values with > index elements
        at = position[active]
        check(at + 4 > ends[active], "truncated element length")
        length = _be_int32(col.data, at)
        check((length < -1) | (at + 4 + np.maximum(length, 0) > ends[active]), "bad element length")
        element_starts[first[active] + index] = at + 4
        element_lengths[first[active] + index] = length
        position[active] = at + 4 + np.maximum(length, 0)
    check(position != ends, "value length does not match its elements")

    parsed.ndim[rows], parsed.dims[rows], parsed.lower_bounds[rows], parsed.counts[rows] = (
        ndim,
        dims,
        lower_bounds,
        counts,
    )
    offsets, data = gather(col.data, element_starts, np.maximum(element_lengths, 0))
    parsed.elements = binary_array(offsets, data, element_lengths >= 0)
    return parsed


@dataclass(slots=True)
class ArrayCodec(Codec):
    """Arrays of ``element`` values -> ``ndims`` levels of ``list<...>``."""

    name: str
    element: ScalarCodec
    element_oid: int
    ndims: int
    arrow_type: pa.DataType = field(init=False)

    def __post_init__(self) -> None:
        arrow_type = self.element.arrow_type
        for _ in range(self.ndims):
            arrow_type = pa.list_(arrow_type)
        self.arrow_type = arrow_type

    @property
    def binary_supported(self) -> bool:
        return self.element.binary_supported

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        return self._assemble(col, False, _parse_text(col))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        return self._assemble(col, True, _parse_binary(col, self.element_oid))

    def _assemble(self, col: RawColumn, binary: bool, parsed: _Parsed) -> ConvertedColumn:
        """Convert all elements in bulk, settle the special rows, nest the others into lists."""
        element_rows = np.repeat(np.arange(len(col)), parsed.counts)
        element_col = RawColumn.of(parsed.elements, self.element.name, element_rows, f"element of {self.name}")
        converted = convert_column(self.element, element_col, binary)
        misfit = (parsed.ndim > 0) & ((parsed.ndim != self.ndims) | (parsed.lower_bounds != 1).any(axis=1))
        misfit[element_rows[list(converted.special)]] = True
        special = parsed.special
        first = np.cumsum(parsed.counts) - parsed.counts
        for row in np.flatnonzero(misfit).tolist():
            special[row] = self._render(parsed, converted, int(first[row]), row) if binary else col.text(row)
        return ConvertedColumn(self._lists(col, parsed, converted.array, element_rows, special), special)

    def _render(self, parsed: _Parsed, converted: ConvertedColumn, first: int, row: int) -> str:
        """The array_out text of a binary value, from its converted elements."""
        count = int(parsed.counts[row])
        texts = self.element.render(converted.array.slice(first, count))
        texts = [converted.special.get(first + i, text) for i, text in enumerate(texts)]
        return format_array(texts, parsed.shape(row))

    def _lists(
        self, col: RawColumn, parsed: _Parsed, values: pa.Array, element_rows: np.ndarray, special: dict[int, str]
    ) -> pa.Array:
        """Nest the element values into ``ndims`` levels of lists; null and special rows are null."""
        null = ~col.valid
        null[list(special)] = True
        if special:
            values = values.filter(pa.array(~null[element_rows]))
        dims = np.where(null[:, None] | (parsed.ndim[:, None] == 0), 0, parsed.dims[:, : self.ndims])
        for level in reversed(range(self.ndims)):
            sizes = np.repeat(dims[:, level], np.prod(dims[:, :level], axis=1))
            offsets = np.zeros(sizes.size + 1, np.int32)
            np.cumsum(sizes, out=offsets[1:])
            mask = pa.array(null) if level == 0 and null.any() else None
            values = pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)
        return values
