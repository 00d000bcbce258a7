"""Names of source tables: schema-qualified, parsed from the configuration's spelling, quoted
for SQL."""

from __future__ import annotations

import re
from dataclasses import dataclass

_IDENTIFIER_PART = r'(?:"(?:[^"]|"")+"|[^".]+)'
_QUALIFIED = re.compile(rf"^({_IDENTIFIER_PART})(?:\.({_IDENTIFIER_PART}))?$")


@dataclass(slots=True, frozen=True)
class TableName:
    """A schema-qualified table name, unquoted (``TableName("public", "orders")``)."""

    schema: str
    name: str

    @classmethod
    def parse(cls, text: str) -> TableName:
        """``orders``, ``public.orders`` or ``"My Schema"."My.Table"`` (``public`` by default)."""
        match = _QUALIFIED.match(text.strip())
        if match is None:
            raise ValueError(f"not a table name: {text!r} (expected schema.table)")
        first, second = match.group(1), match.group(2)
        if second is None:
            return cls("public", _unquote(first))
        return cls(_unquote(first), _unquote(second))

    def __str__(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def sql(self) -> str:
        """The name quoted for SQL."""
        return f"{quote_identifier(self.schema)}.{quote_identifier(self.name)}"


def quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _unquote(part: str) -> str:
    return part[1:-1].replace('""', '"') if part.startswith('"') else part
