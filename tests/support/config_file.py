"""The one writer of the tests' ``cdc.yaml``.

:func:`write_config` builds the document from its sections — ``source`` (settings beside
:data:`SOURCE`: the DSN from ``$CDC_SOURCE_DSN``, slot ``cdc_slot``, publication ``cdc_pub``),
``changelog`` and ``warehouse`` (settings beside the paths ``./changelog`` and ``./warehouse``,
relative to the file's folder; a ``path`` replaces them), the optional sections as given
(``spark``, ``storage``, ``drain``, ``schedule``: left out when ``None``) and ``tables`` (names, or
name → settings such as ``row_filter``) — and writes it with ``yaml.safe_dump``. The sections are
those of :mod:`cdc_assets.config.model`. Tests of the parser's errors write their literal text
themselves (``tests/test_config.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

DSN_VARIABLE = "CDC_SOURCE_DSN"
SOURCE = {"dsn": "${" + DSN_VARIABLE + "}", "slot": "cdc_slot", "publication": "cdc_pub"}
FILE_NAME = "cdc.yaml"

Section = Mapping[str, Any]


def write_config(
    folder: Path,
    tables: Mapping[str, Section] | Iterable[str],
    *,
    source: Section | None = None,
    changelog: Section | None = None,
    warehouse: Section | None = None,
    spark: Section | None = None,
    storage: Section | None = None,
    drain: Section | None = None,
    schedule: Section | None = None,
    name: str = FILE_NAME,
) -> Path:
    """Write ``folder/name`` (``cdc.yaml``; the folder made if missing) and return its path."""
    document: dict[str, Any] = {
        "source": {**SOURCE, **(source or {})},
        "changelog": {"path": "./changelog", **(changelog or {})},
        "warehouse": {"path": "./warehouse", **(warehouse or {})},
    }
    optional = {"storage": storage, "spark": spark, "drain": drain, "schedule": schedule}
    document |= {section: dict(settings) for section, settings in optional.items() if settings is not None}
    named = tables.items() if isinstance(tables, Mapping) else ((table, {}) for table in tables)
    document["tables"] = {table: dict(settings) for table, settings in named}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path
