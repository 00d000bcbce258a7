"""pgoutput column values -> typed Arrow arrays, a whole column at a time.

``column_converter(type_oid, typmod, catalog, ndims)`` builds a :class:`ColumnConverter` whose
``convert(raw, binary)`` turns one column's raw values (a binary array, null for NULL or unsent
values) in text or binary format into a :class:`ConvertedColumn`. The type mapping is documented
in ``docs/types.md``.
"""

from cdc_assets.pgoutput.values.base import ConvertedColumn
from cdc_assets.pgoutput.values.converter import ColumnConverter, column_converter

__all__ = ["ColumnConverter", "ConvertedColumn", "column_converter"]
