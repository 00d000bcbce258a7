"""A relation's schema version: what a Relation message says, plus array dimensions.

:class:`RelationSchema` is the unit of schema versioning in the change log: two Relation
messages describe the same version when their column names, type OIDs, typmods, key flags and
dimensions, and the replica identity, are equal. It serialises to JSON for Parquet metadata and
the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cdc_assets.names import TableName
from cdc_assets.pgoutput.messages import RelationMessage


@dataclass(slots=True, frozen=True)
class ColumnSchema:
    """One published column: ``is_key`` is pgoutput's replica-identity flag, ``ndims`` the array
    dimensions (0 for non-arrays); ``attnum`` its number in ``pg_attribute`` where the catalog was
    read (a copy's columns; a Relation message has none), which no schema version is told by."""

    name: str
    type_oid: int
    type_modifier: int
    is_key: bool
    ndims: int = 0
    attnum: int | None = field(default=None, compare=False)


@dataclass(slots=True, frozen=True)
class RelationSchema:
    """A relation as pgoutput describes it; equal instances are the same schema version."""

    relation_oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[ColumnSchema, ...]

    @classmethod
    def from_message(cls, message: RelationMessage, ndims: Mapping[str, int] | None = None) -> RelationSchema:
        """From a Relation message; ``ndims`` by column name (0, not an array, where absent)."""
        dims = ndims or {}
        return cls(
            relation_oid=message.relation_oid,
            namespace=message.namespace or "pg_catalog",
            name=message.relation_name,
            replica_identity=message.replica_identity,
            columns=tuple(
                ColumnSchema(c.name, c.type_oid, c.type_modifier, c.is_key, dims.get(c.name, 0))
                for c in message.columns
            ),
        )

    @property
    def table(self) -> TableName:
        return TableName(self.namespace, self.name)

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"

    @property
    def key_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.is_key)

    def same_version(self, other: RelationSchema) -> bool:
        """Whether ``other`` describes the same columns (the OID may differ after a rewrite)."""
        return (self.namespace, self.name, self.replica_identity, self.columns) == (
            other.namespace,
            other.name,
            other.replica_identity,
            other.columns,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "relation_oid": self.relation_oid,
            "namespace": self.namespace,
            "name": self.name,
            "replica_identity": self.replica_identity,
            "columns": [
                {
                    "name": c.name,
                    "type_oid": c.type_oid,
                    "type_modifier": c.type_modifier,
                    "key": c.is_key,
                    "ndims": c.ndims,
                }
                | ({} if c.attnum is None else {"attnum": c.attnum})
                for c in self.columns
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RelationSchema:
        return cls(
            relation_oid=int(data["relation_oid"]),
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            replica_identity=str(data["replica_identity"]),
            columns=tuple(
                ColumnSchema(
                    str(c["name"]),
                    int(c["type_oid"]),
                    int(c["type_modifier"]),
                    bool(c["key"]),
                    int(c["ndims"]),
                    None if c.get("attnum") is None else int(c["attnum"]),
                )
                for c in data["columns"]
            ),
        )
