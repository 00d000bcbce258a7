"""The two binary copy paths (``cdc_assets/source/copy_rows.py``) — C (``_copy_rows.c``) and pure
Python (``rows_in_python.py``) — on the same real COPY BINARY data: every type the copy tests
cover, in binary and as text, NULLs, empty and multi-megabyte values, in blocks cut by rows and by
bytes. Both paths must yield the same blocks, buffer for buffer, and the values the server sends."""

from __future__ import annotations

import sys
from collections import Counter

import pyarrow as pa
import pytest

from cdc_assets.names import TableName
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.source import apply_pinned_settings, load_type_catalog
from cdc_assets.source.binary_copy import BLOCK_BYTES, CopySelect, read_columns
from cdc_assets.source.catalog import describe_table
from cdc_assets.source.copy_rows import PATHS
from cdc_assets.source.rows_in_python import RECEIVE_ENDED, RECEIVE_FAILED, RECEIVE_LIMIT, RECEIVE_WAIT
from tests.support.copied import assert_same_layout, block_rows, raw_rows
from tests.support.database import Database

SCHEMA = (
    "CREATE TYPE mood AS ENUM ('sad', 'happy');"
    " CREATE TYPE pair AS (x int, y text);"
    " CREATE DOMAIN posint AS int CHECK (VALUE > 0);"
    " CREATE TABLE typed (id int8 PRIMARY KEY, k int4, s int2, b bool, c char(4), ip inet, ts timestamptz,"
    " tsn timestamp, iv interval, by bytea, arr int[], grid int[][], m mood, moods mood[], d posint, p pair,"
    " f float8, r float4, n numeric(12,3), j jsonb, js json, t text, tarr text[], dt date, tm time, u uuid,"
    " big text);"
    " CREATE PUBLICATION cdc_pub FOR TABLE typed"
)
# 20,000 rows, each column NULL in its own pattern; then the values the copy tests find tricky: line
# breaks, quotes, backslashes, a lone "\." (text COPY's end marker), empty strings, non-ASCII,
# special numbers and dates, a row of NULLs, and a 5 MB value (more than one block's bytes).
ROWS = (
    "INSERT INTO typed SELECT g, g * 7919 % 100003, (g % 30000)::int2, CASE WHEN g % 3 = 0 THEN NULL ELSE g % 2 = 0 END,"
    " CASE WHEN g % 5 = 0 THEN NULL ELSE left(md5(g::text), g % 5) END, ('10.0.' || g % 256 || '.' || g % 7)::inet,"
    " timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second 7 ms', timestamp '2000-02-29' - g * interval '1 hour',"
    " g * interval '1 day 3 min', CASE WHEN g % 4 = 0 THEN NULL ELSE decode(md5(g::text), 'hex') END,"
    " ARRAY[g, NULL, -g], ARRAY[[g, 1], [2, g]], (ARRAY['sad', 'happy'])[g % 2 + 1]::mood, '{sad,happy}',"
    " CASE WHEN g % 6 = 0 THEN NULL ELSE g END, ROW(g, 'p' || g)::pair, g / 7.0, (g / 3.0)::float4, g / 11.0,"
    " jsonb_build_object('g', g, 'a', ARRAY[g]), json_build_array(g, 'x'), repeat('t', g % 50),"
    " ARRAY['a' || g, NULL, ''], date '2024-02-29' + g, time '00:00' + g * interval '1 second',"
    " md5(g::text)::uuid, NULL"
    " FROM generate_series(1, 20000) AS g;"
    " INSERT INTO typed (id, b, c, ip, ts, iv, by, arr, m, moods, p, f, r, n, j, js, t, tarr, dt, big) VALUES"
    " (-1, true, 'ü', '::1/128', '-infinity', '-1 day 02:03:04', '\\x', '{}', 'happy', '{}', ROW(NULL, NULL),"
    "  'NaN', '-Infinity', 'NaN', '\"str\"', '[]', E'line\\nbreak \"quoted\", \\\\ \\t', '{\"\",NULL}',"
    "  '0044-03-15 BC', ''),"
    " (-2, false, '', '192.168.0.0/16', 'infinity', '1 year 2 mons', '\\x00ff', '{}', 'sad', '{}', NULL,"
    "  '-0', 'Infinity', 12.5, 'null', 'null', E'\\\\.', '{\"line\nbreak\"}', 'infinity', 'ünïcødé ✓ 日本'),"
    " (-3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
    "  NULL, repeat('big', 1700000))"
)
BLOCKS = [
    pytest.param(sys.maxsize, BLOCK_BYTES, 2, id="default-blocks"),  # the 5 MB value fills a block of its own
    pytest.param(97, BLOCK_BYTES, 207, id="97-rows"),
    pytest.param(sys.maxsize, 50_000, 150, id="50-kB"),
]


def test_receive_codes_are_the_c_modules() -> None:
    from cdc_assets.source import _copy_rows

    assert (RECEIVE_LIMIT, RECEIVE_WAIT, RECEIVE_ENDED, RECEIVE_FAILED) == (
        _copy_rows.RECEIVE_LIMIT,
        _copy_rows.RECEIVE_WAIT,
        _copy_rows.RECEIVE_ENDED,
        _copy_rows.RECEIVE_FAILED,
    )


@pytest.fixture(scope="module")
def typed(pg_module: Database) -> tuple[Database, RelationSchema, tuple[bool, ...]]:
    """The table, its published columns, and which of them convert from binary."""
    pg_module.execute(SCHEMA)
    pg_module.execute(ROWS)
    with pg_module.connect() as conn:
        relation = describe_table(conn, TableName("public", "typed"), "cdc_pub")
        catalog = TypeCatalog.of(load_type_catalog(conn, [c.type_oid for c in relation.columns]))
        binary = ChangeRecordBuilder(relation, catalog).binary_supported
    assert sum(binary) == len(binary) - 2  # inet and the composite as text
    return pg_module, relation, binary


@pytest.mark.parametrize("as_text", [False, True], ids=["binary", "text"])
@pytest.mark.parametrize(("rows", "size", "blocks"), BLOCKS)
def test_both_paths_copy_the_same_blocks(
    typed: tuple[Database, RelationSchema, tuple[bool, ...]], as_text: bool, rows: int, size: int, blocks: int
) -> None:
    assert set(PATHS) == {"c", "python"}, "the C module is not built (pip install could not compile it)"
    pg, relation, binary = typed
    with pg.connect(autocommit=False) as conn:
        apply_pinned_settings(conn)
        select = CopySelect.of(conn, relation, [False] * len(binary) if as_text else binary)
        copied = {
            path: list(
                read_columns(
                    conn, select.query("ONLY typed"), len(binary), block_rows=rows, block_bytes=size, path=path
                )
            )
            for path in PATHS
        }
        expected = raw_rows(conn, f"SELECT {select.columns} FROM ONLY typed")
    c, python = copied["c"], copied["python"]
    assert [len(block[0]) for block in c] == [len(block[0]) for block in python]
    for c_block, python_block in zip(c, python, strict=True):
        for c_array, python_array in zip(c_block, python_block, strict=True):
            assert_same_layout(c_array, python_array)
            assert c_array.type == pa.binary()
    assert Counter(block_rows(c)) == Counter(expected)
    assert len(expected) == 20_003
    assert len(c) >= blocks
