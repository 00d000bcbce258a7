"""PostgreSQL type identities: built-in OIDs and a catalog of user-defined types.

pgoutput names a column's type only by OID and typmod. Built-in OIDs are fixed (``pg_type.dat``);
everything else — enums, domains, composites, extension types, their arrays — is looked up in a
:class:`TypeCatalog` that the source module fills from ``pg_type`` (a Type message alone gives only
namespace and name, so such entries have category ``'u'``, unknown).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

BOOL = 16
BYTEA = 17
CHAR = 18
NAME = 19
INT8 = 20
INT2 = 21
INT4 = 23
TEXT = 25
OID = 26
XID = 28
JSON = 114
FLOAT4 = 700
FLOAT8 = 701
BPCHAR = 1042
VARCHAR = 1043
DATE = 1082
TIME = 1083
TIMESTAMP = 1114
TIMESTAMPTZ = 1184
INTERVAL = 1186
TIMETZ = 1266
NUMERIC = 1700
UUID = 2950
JSONB = 3802

BOX_ARRAY = 1020  # box[] uses ';' between elements: it is kept whole, as text

# Built-in array type OID -> element type OID (pg_type.typelem of typcategory 'A').
BUILTIN_ARRAY_ELEMENTS: dict[int, int] = {
    1000: BOOL, 1001: BYTEA, 1002: CHAR, 1003: NAME, 1005: INT2, 1006: 22, 1007: INT4,
    1008: 24, 1009: TEXT, 1010: 27, 1011: XID, 1012: 29, 1013: 30, 1014: BPCHAR, 1015: VARCHAR,
    1016: INT8, 1017: 600, 1018: 601, 1019: 602, 1021: FLOAT4, 1022: FLOAT8, 1027: 604,
    1028: OID, 1034: 1033, 1040: 829, 1041: 869, 1115: TIMESTAMP, 1182: DATE, 1183: TIME,
    1185: TIMESTAMPTZ, 1187: INTERVAL, 1231: NUMERIC, 1270: TIMETZ, 1561: 1560, 1563: 1562,
    143: 142, 199: JSON, 271: 5069, 629: 628, 651: 650, 719: 718, 775: 774, 791: 790,
    2201: 1790, 2207: 2202, 2208: 2203, 2209: 2204, 2210: 2205, 2211: 2206, 2949: 2970,
    2951: UUID, 3221: 3220, 3643: 3614, 3644: 3642, 3645: 3615, 3735: 3734, 3770: 3769,
    3807: JSONB, 3905: 3904, 3907: 3906, 3909: 3908, 3911: 3910, 3913: 3912, 3927: 3926,
    4073: 4072, 4090: 4089, 4097: 4096, 4192: 4191, 5039: 5038, 6150: 4451, 6151: 4532,
    6152: 4533, 6153: 4534, 6155: 4535, 6157: 4536,
}  # fmt: skip

FIRST_GENBKI_OID = 10000
"""Types from this OID on are the database's own: pgoutput sends a Type message for them."""

# pg_type.typtype values.
CATEGORY_DOMAIN = "d"
CATEGORY_ENUM = "e"
CATEGORY_UNKNOWN = "u"  # known only from a pgoutput Type message


@dataclass(slots=True, frozen=True)
class PgTypeInfo:
    """One ``pg_type`` row, as much as value conversion needs.

    ``base_oid``/``base_modifier`` are a domain's ``typbasetype``/``typtypmod`` (else 0 / -1);
    ``element_oid`` is an array type's ``typelem`` (else 0; leave it 0 for the fixed-length
    subscriptable base types such as ``point``, whose values are not array literals).
    """

    oid: int
    namespace: str
    name: str
    category: str
    base_oid: int = 0
    base_modifier: int = -1
    element_oid: int = 0

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(slots=True)
class TypeCatalog:
    """User-defined types by OID."""

    _types: dict[int, PgTypeInfo] = field(default_factory=dict)

    @classmethod
    def of(cls, types: Iterable[PgTypeInfo]) -> TypeCatalog:
        return cls({info.oid: info for info in types})

    def add(self, info: PgTypeInfo) -> None:
        self._types[info.oid] = info

    def note_type_message(self, oid: int, namespace: str, name: str) -> None:
        """Record a pgoutput Type message for a type not known yet. An entry read from ``pg_type``
        is kept as it is: a domain's message names its base type, not the domain, and a type keeps
        its OID through a rename."""
        self._types.setdefault(oid, PgTypeInfo(oid, namespace, name, CATEGORY_UNKNOWN))

    def unresolved(self, oids: Iterable[int]) -> list[int]:
        """The OIDs among ``oids`` that have no entry read from ``pg_type``."""
        return [oid for oid in oids if (info := self._types.get(oid)) is None or info.category == CATEGORY_UNKNOWN]

    def get(self, oid: int) -> PgTypeInfo | None:
        return self._types.get(oid)

    def __contains__(self, oid: object) -> bool:
        return oid in self._types

    def __iter__(self) -> Iterator[PgTypeInfo]:
        return iter(self._types.values())

    def __len__(self) -> int:
        return len(self._types)
