"""What every type codec provides, and what a conversion returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import pyarrow as pa

from cdc_assets.pgoutput.values.raw import RawColumn


@dataclass(slots=True)
class ConvertedColumn:
    """A converted column: one typed entry per input row.

    ``array`` is null where the input was null, and where the value is one the Arrow type cannot
    hold; ``special`` maps those rows to the value's exact PostgreSQL text.
    """

    array: pa.Array
    special: dict[int, str] = field(default_factory=dict)


class Codec(ABC):
    """Converts the values of one PostgreSQL type, a whole column at a time, in both formats."""

    __slots__ = ()

    name: str
    arrow_type: pa.DataType

    @property
    def binary_supported(self) -> bool:
        """Whether binary-format values can be converted (a class attribute where fixed)."""
        return True

    @abstractmethod
    def from_text(self, col: RawColumn) -> ConvertedColumn:
        """Values in text format (the type's output function under the pinned session GUCs)."""

    @abstractmethod
    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        """Values in binary format (the type's send function)."""


class ScalarCodec(Codec):
    """A codec for a type that can also be an array element."""

    __slots__ = ()

    @abstractmethod
    def render(self, values: pa.Array) -> list[str | None]:
        """The PostgreSQL text of converted values (None for nulls), for arrays from binary input
        whose exact text must be rebuilt because they are special."""


def convert_column(codec: Codec, col: RawColumn, binary: bool) -> ConvertedColumn:
    """Convert ``col`` with ``codec`` in the given format (all-null columns need no decoding)."""
    if not col.valid.any():
        return ConvertedColumn(pa.nulls(len(col), codec.arrow_type))
    return codec.from_binary(col) if binary else codec.from_text(col)
