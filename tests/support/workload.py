"""A seeded random workload against a real PostgreSQL database, for the apply differential and
crash tests (``tests/test_apply_differential.py``, ``tests/test_apply_crash.py``).

:class:`Workload` owns one schema with eight tables, each there for a piece of the semantics the
apply must get right (``docs/architecture.md``, "Semantics applied downstream"):

==========  ==========================================================================================
``kinds``   primary key; enum, ``int[]``, ``text[]`` (quotes, commas, backslashes, ``"NULL"``, NULL
            elements), jsonb, ``numeric(12,2)``, unconstrained numeric (huge, tiny, ``NaN``,
            ``±Infinity``), timestamptz (odd offsets, µs), bytea (NULs, empty), bool
``docs``    primary key; ``body`` is ~20 kB of md5-chain hex with ``SET STORAGE EXTERNAL`` (stored
            out of line, never compressed), so updates that leave it alone send it as unchanged
            TOAST (``'u'``) — also across key changes and swaps
``parent``  primary key, referenced by ``child`` (``ON UPDATE CASCADE ON DELETE CASCADE``):
``child``   cascaded updates and deletes, ``TRUNCATE parent CASCADE``
``bag``     ``REPLICA IDENTITY FULL``, no key, duplicate rows on purpose (one copy or all copies
            updated or deleted through ``ctid``); ``memo`` is stored out of line (``'u'`` in the
            new row, the value in the ``'O'`` old row)
``coded``   ``REPLICA IDENTITY USING INDEX`` on ``(region, code)``, plus an identity column (for
            ``TRUNCATE … RESTART IDENTITY``)
``events``  no key at all: append-only (insert only; truncated sometimes)
``orders``  mirrored with the consumer-side row filter :data:`ROW_FILTER`; updates move rows in
            and out of it, with and without key changes; ``memo`` is stored out of line, so a row
            can enter the filter with its memo sent as unchanged TOAST
==========  ==========================================================================================

Operations are single DML statements; every statement executed counts as one operation
(:attr:`WorkloadStats.ops`), including those a rollback later undoes. They are grouped into
*units*: an autocommit statement; a transaction of several statements, sometimes with a
savepoint rolled back, sometimes rolled back as a whole; a prepared transaction committed or
rolled back (``COMMIT PREPARED`` / ``ROLLBACK PREPARED``, possibly only at the start of the next
:meth:`Workload.run`, so a drain sees it pending); now and then a *large* transaction of several
thousand rows (bulk insert, bulk update, bulk delete, a savepoint rollback in the middle) that
exceeds the cluster's ``logical_decoding_work_mem`` (64 kB) and so spills to disk, or streams
when the drain uses ``streaming: on``. Key changes are plain (to a fresh key, or to a key that
was deleted before) or swaps of two keys through a temporary key.

Everything is decided by ``random.Random(seed)`` against a Python model of the keys each table
holds (rolled back with the transaction or savepoint), so a seed always replays the same
statements — a failing seed is its own reproduction. The model only picks keys; it is never used
as the expected result: the tests compare Delta with ``SELECT *`` of the source.
"""

from __future__ import annotations

import copy
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from cdc_assets.changelog.store import LogStore

TABLES = ("kinds", "docs", "parent", "child", "bag", "coded", "events", "orders")
ROW_FILTER = "status <> 'draft' AND amount > 10"
FILTERED = {"orders": ROW_FILTER}
MOODS = ("sad", "ok", "happy", "très bien", 'a\'b "c"')
BODY_CHARS = 20_000  # ~20 kB: 625 md5 digests

DDL = """
CREATE SCHEMA {s};
CREATE TYPE {s}.mood AS ENUM ('sad', 'ok', 'happy', 'très bien', 'a''b "c"');
CREATE TABLE {s}.kinds (
    id bigint PRIMARY KEY, mood {s}.mood, ints int[], tags text[], doc jsonb, amount numeric(12,2),
    exact numeric, at timestamptz, blob bytea, flag bool);
CREATE TABLE {s}.docs (id bigint PRIMARY KEY, version int NOT NULL, title text, body text);
ALTER TABLE {s}.docs ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE {s}.parent (id bigint PRIMARY KEY, name text NOT NULL, score numeric(12,2));
CREATE TABLE {s}.child (
    id bigint PRIMARY KEY,
    parent_id bigint NOT NULL REFERENCES {s}.parent (id) ON UPDATE CASCADE ON DELETE CASCADE,
    note text, at timestamptz);
CREATE TABLE {s}.bag (a int, b text, c numeric(12,2), tags text[], memo text);
ALTER TABLE {s}.bag ALTER COLUMN memo SET STORAGE EXTERNAL;
ALTER TABLE {s}.bag REPLICA IDENTITY FULL;
CREATE TABLE {s}.coded (
    serial bigint GENERATED ALWAYS AS IDENTITY, region int NOT NULL, code text NOT NULL, qty int, note text);
CREATE UNIQUE INDEX coded_key ON {s}.coded (region, code);
ALTER TABLE {s}.coded REPLICA IDENTITY USING INDEX coded_key;
CREATE TABLE {s}.events (n bigint GENERATED ALWAYS AS IDENTITY, kind text, payload jsonb, at timestamptz);
CREATE TABLE {s}.orders (
    id bigint PRIMARY KEY, status text NOT NULL, amount numeric(12,2), customer text, memo text);
ALTER TABLE {s}.orders ALTER COLUMN memo SET STORAGE EXTERNAL;
"""

TAGS = ("a", "with space", "comma,inside", 'quo"te', "back\\slash", "NULL", "", "ünïcødé ✓", "{brace}", "x y,z")
WORDS = ("alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θ", "iota", "kappa")


@dataclass(slots=True)
class WorkloadStats:
    ops: int = 0  # DML statements executed (those later rolled back included)
    rolled_back_ops: int = 0
    units: int = 0
    transactions: int = 0  # explicit multi-statement transactions (prepared ones included)
    rollbacks: int = 0
    savepoint_rollbacks: int = 0
    prepared_commits: int = 0
    prepared_rollbacks: int = 0
    prepared_left_pending: int = 0
    large_transactions: int = 0
    truncates: int = 0
    key_changes: int = 0
    swaps: int = 0
    by_table: dict[str, int] = field(default_factory=dict)

    def add(self, other: WorkloadStats) -> None:
        for name in self.__slots__:
            if name == "by_table":
                for table, count in other.by_table.items():
                    self.by_table[table] = self.by_table.get(table, 0) + count
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def line(self) -> str:
        return (
            f"{self.ops:,} ops ({self.rolled_back_ops:,} rolled back), {self.transactions:,} transactions,"
            f" {self.rollbacks} rollbacks, {self.savepoint_rollbacks} savepoint rollbacks,"
            f" prepared {self.prepared_commits} committed / {self.prepared_rollbacks} rolled back"
            f" ({self.prepared_left_pending} across a sync), {self.large_transactions} large,"
            f" {self.truncates} truncates, {self.key_changes} key changes, {self.swaps} swaps"
        )


@dataclass(slots=True)
class Model:
    """The keys each table holds (dicts as insertion-ordered sets, so choices are reproducible)."""

    kinds: dict[int, None] = field(default_factory=dict)
    docs: dict[int, None] = field(default_factory=dict)
    parent: dict[int, None] = field(default_factory=dict)
    child: dict[int, int] = field(default_factory=dict)  # child id -> parent id
    bag: list[tuple[Any, ...]] = field(default_factory=list)
    coded: dict[tuple[int, str], None] = field(default_factory=dict)
    orders: dict[int, None] = field(default_factory=dict)
    freed: dict[str, list[Any]] = field(default_factory=dict)  # keys deleted earlier, for reuse
    next_key: int = 1


def md5_chain(start: str, chars: int = BODY_CHARS) -> str:
    """``chars`` of hex: md5(start), md5(that), … — incompressible, reproducible."""
    parts, digest, total = [], start, 0
    while total < chars:
        digest = hashlib.md5(digest.encode()).hexdigest()
        parts.append(digest)
        total += len(digest)
    return "".join(parts)[:chars]


class RolledBack(Exception):
    """Internal: the unit decided to roll back."""


class Workload:
    """Random statements against the tables of ``schema``; see the module docstring."""

    def __init__(self, dsn: str, schema: str, seed: int, *, application_name: str = "workload") -> None:
        self.dsn = dsn
        self.schema = schema
        self.seed = seed
        self.rng = random.Random(seed)
        self.model = Model()
        self.stats = WorkloadStats()
        self.conn = psycopg.connect(dsn, autocommit=True, application_name=application_name)
        self.pending: tuple[str, Model, int] | None = None  # a prepared transaction left open
        self._gids = 0
        self._in_transaction = False
        self._unit_ops = 0
        self.log: list[str] | None = None  # set to a list to record every statement (reproductions)

    # -- set-up -------------------------------------------------------------------------------

    def qualified(self, table: str) -> str:
        return f"{self.schema}.{table}"

    @property
    def tables(self) -> list[str]:
        return [self.qualified(t) for t in TABLES]

    def create(self) -> None:
        self.conn.execute(DDL.format(s=self.schema))

    def populate(self, rows: int = 25) -> None:
        """Initial rows (autocommit inserts) so the snapshot has content in every table; they are
        not counted as operations (the snapshot copies them; no change records)."""
        for _ in range(rows):
            for insert in self._inserts():
                insert()
        self.stats.__init__()

    def close(self) -> None:
        self.conn.close()

    def _inserts(self) -> tuple[Callable[[], None], ...]:
        """One insert into each table."""
        return (
            self._insert_kinds,
            self._insert_docs,
            self._insert_parent,
            self._insert_child,
            self._insert_bag,
            self._insert_coded,
            self._insert_events,
            self._insert_orders,
        )

    # -- running ------------------------------------------------------------------------------

    def run(self, ops: int, *, allow_pending: bool = True, large_at: int | None = None) -> WorkloadStats:
        """Execute units until at least ``ops`` more operations ran. ``large_at``: force a large
        transaction once that many operations ran; ``allow_pending``: the last unit may be a
        prepared transaction left open (resolved by the next :meth:`run` or :meth:`finish`)."""
        before = copy.deepcopy(self.stats)
        self._resolve_pending()
        target = self.stats.ops + ops
        forced = None if large_at is None else self.stats.ops + large_at
        while self.stats.ops < target:
            if forced is not None and self.stats.ops >= forced:
                forced = None
                self._unit(large=True)
            else:
                self._unit()
        if allow_pending and self.rng.random() < 0.5:
            self._prepared_unit(leave_pending=True)
        return self._since(before)

    def one_kind(self, kind: str, ops: int) -> None:
        """``ops`` operations of one ``kind`` in autocommit: ``insert`` (fresh or freed keys) or
        ``update`` (plain updates of held rows: no key changes, swaps or truncates) — batches the
        merge writes by its cheaper paths (an append; a MERGE without its insert clause)."""
        self._resolve_pending()
        target = self.stats.ops + ops
        while self.stats.ops < target:
            tables = [t for t in TABLES if kind == "insert" or (t != "events" and self._size(t))]
            self._unit_ops = 0
            getattr(self, f"_{kind}_{self.rng.choice(tables)}")()

    def finish(self) -> None:
        """Resolve a prepared transaction left open."""
        self._resolve_pending()

    def touch_all(self) -> None:
        """One transaction that changes every table (so every table has changes to apply)."""
        self._begin()
        for insert in self._inserts():
            insert()
        self._commit()

    def _since(self, before: WorkloadStats) -> WorkloadStats:
        out = WorkloadStats()
        for name in out.__slots__:
            if name == "by_table":
                out.by_table = {t: c - before.by_table.get(t, 0) for t, c in self.stats.by_table.items()}
            else:
                setattr(out, name, getattr(self.stats, name) - getattr(before, name))
        return out

    # -- units --------------------------------------------------------------------------------

    def _unit(self, large: bool = False) -> None:
        rng = self.rng
        self.stats.units += 1
        r = rng.random()
        if large or r < 0.002:
            self._large_unit()
        elif r < 0.03:
            self._prepared_unit(leave_pending=False)
        elif r < 0.45:
            self._transaction_unit()
        else:
            self._unit_ops = 0
            self._operation()  # autocommit (a swap wraps its three statements in a transaction)

    def _transaction_unit(self) -> None:
        rng = self.rng
        saved = copy.deepcopy(self.model)
        self._begin()
        self._unit_ops = 0
        try:
            for _ in range(rng.randint(2, 8)):
                if rng.random() < 0.15:
                    self._savepoint_block()
                else:
                    self._operation()
            if rng.random() < 0.05:
                raise RolledBack
            self._commit()
        except RolledBack:
            self._execute("ROLLBACK", dml=False)
            self._in_transaction = False
            self.stats.rollbacks += 1
            self.stats.rolled_back_ops += self._unit_ops
            self.model = saved

    def _savepoint_block(self) -> None:
        rng = self.rng
        saved = copy.deepcopy(self.model)
        counted = self._unit_ops
        self._execute("SAVEPOINT sp", dml=False)
        for _ in range(rng.randint(1, 4)):
            self._operation()
        if rng.random() < 0.6:
            self._execute("ROLLBACK TO SAVEPOINT sp", dml=False)
            self.stats.savepoint_rollbacks += 1
            self.stats.rolled_back_ops += self._unit_ops - counted
            self._unit_ops = counted  # a later whole rollback must not count them twice
            self.model = saved
        else:
            self._execute("RELEASE SAVEPOINT sp", dml=False)

    def _prepared_unit(self, *, leave_pending: bool) -> None:
        rng = self.rng
        saved = copy.deepcopy(self.model)
        self._begin()
        self._unit_ops = 0
        for _ in range(rng.randint(1, 6)):
            # No TRUNCATE in a transaction that may stay prepared: its lock would block readers.
            self._operation(truncate=not leave_pending)
        self._gids += 1
        gid = f"{self.schema}_{self.seed}_{self._gids}"
        self._execute(f"PREPARE TRANSACTION '{gid}'", dml=False)
        self._in_transaction = False
        ops = self._unit_ops
        if leave_pending:
            self.pending = (gid, saved, ops)
            self.stats.prepared_left_pending += 1
        else:
            self._finish_prepared(gid, saved, ops)

    def _resolve_pending(self) -> None:
        if self.pending is not None:
            gid, saved, ops = self.pending
            self.pending = None
            self._finish_prepared(gid, saved, ops)

    def _finish_prepared(self, gid: str, saved: Model, ops: int) -> None:
        if self.rng.random() < 0.7:
            self._execute(f"COMMIT PREPARED '{gid}'", dml=False)
            self.stats.prepared_commits += 1
        else:
            self._execute(f"ROLLBACK PREPARED '{gid}'", dml=False)
            self.stats.prepared_rollbacks += 1
            self.stats.rolled_back_ops += ops
            self.model = saved

    def _large_unit(self) -> None:
        """Several thousand rows in one transaction: bulk insert, update and delete, and a bulk
        insert rolled back to a savepoint in the middle (a streamed subtransaction abort)."""
        rng = self.rng
        self.stats.large_transactions += 1
        self._begin()
        self._unit_ops = 0
        n = rng.randint(2000, 3500)
        lo = self._fresh_range(n)
        self._dml(
            "kinds",
            f"INSERT INTO {self.qualified('kinds')} (id, mood, ints, tags, doc, amount, exact, at, blob, flag)"
            " SELECT g, (enum_range(NULL::{s}.mood))[1 + g %% 5], ARRAY[g::int, (g %% 7)::int, NULL],"
            " ARRAY['bulk', g::text, 'q\"' || (g %% 3)], jsonb_build_object('g', g, 'half', g / 2.0),"
            " (g %% 100000) / 100.0, (g * 7)::numeric / 1000, timestamptz '2024-02-29 12:00:00.123456+05:30'"
            " + g * interval '1 second', decode(md5(g::text), 'hex'), g %% 2 = 0"
            " FROM generate_series(%s::bigint, %s::bigint) g".replace("{s}", self.schema),
            (lo, lo + n - 1),
        )
        self.model.kinds.update(dict.fromkeys(range(lo, lo + n)))
        third = n // 3
        self._dml(
            "kinds",
            f"UPDATE {self.qualified('kinds')} SET flag = NOT flag, tags = tags || 'upd'::text"
            " WHERE id BETWEEN %s AND %s",
            (lo, lo + third),
        )
        self._execute("SAVEPOINT big", dml=False)
        m = rng.randint(500, 1500)
        self._dml(
            "events",
            f"INSERT INTO {self.qualified('events')} (kind, payload, at)"
            " SELECT 'rolled back', jsonb_build_object('g', g), now() FROM generate_series(1, %s) g",
            (m,),
        )
        bag_rows = rng.randint(300, 800)
        self._dml(
            "bag",
            f"INSERT INTO {self.qualified('bag')} (a, b, c, tags, memo) SELECT g %% 3, 'gone', 1.00, NULL, NULL"
            " FROM generate_series(1, %s) g",
            (bag_rows,),
        )
        self._execute("ROLLBACK TO SAVEPOINT big", dml=False)
        self.stats.savepoint_rollbacks += 1
        self.stats.rolled_back_ops += 2
        self._unit_ops -= 2
        self._dml(
            "kinds",
            f"DELETE FROM {self.qualified('kinds')} WHERE id BETWEEN %s AND %s AND id %% 4 = 0",
            (lo + third, lo + 2 * third),
        )
        for key in range(lo + third, lo + 2 * third + 1):
            if key % 4 == 0:
                self.model.kinds.pop(key, None)
        copies = rng.randint(200, 600)
        row = (1, "bulk", Decimal("2.50"), ("x", None), None)
        self._dml(
            "bag",
            f"INSERT INTO {self.qualified('bag')} (a, b, c, tags, memo) SELECT %s, %s, %s, %s::text[], %s"
            " FROM generate_series(1, %s)",
            (*self._bag_params(row), copies),
        )
        self.model.bag.extend([row] * copies)
        self._dml(
            "events",
            f"INSERT INTO {self.qualified('events')} (kind, payload, at)"
            " SELECT 'bulk', jsonb_build_object('g', g, 's', repeat('x', g %% 50)), now() FROM generate_series(1, %s) g",
            (rng.randint(500, 1500),),
        )
        self._commit()

    # -- operations ---------------------------------------------------------------------------

    def _operation(self, truncate: bool = True) -> None:
        rng = self.rng
        if truncate and rng.random() < 0.006:
            self._truncate()
            return
        table = rng.choices(TABLES, weights=(20, 12, 7, 10, 12, 12, 7, 15))[0]
        size = self._size(table)
        r = rng.random()
        if table == "events":
            self._insert_events()
            return
        if r < 0.28 or size == 0 or (size < 40 and r < 0.6):
            getattr(self, f"_insert_{table}")()
        elif r < 0.40 or (size > 120 and 0.55 <= r < 0.7):
            getattr(self, f"_delete_{table}")()
        elif r < 0.48 and table != "bag":
            self._key_change(table)
        elif r < 0.52 and table not in ("bag", "child") and size >= 2:
            self._swap(table)
        else:
            getattr(self, f"_update_{table}")()

    def _size(self, table: str) -> int:
        m = self.model
        if table == "events":
            return 1
        held = getattr(m, table)
        return len(held)

    def _key(self) -> int:
        key = self.model.next_key
        self.model.next_key += 1
        return key

    def _fresh_range(self, n: int) -> int:
        lo = self.model.next_key
        self.model.next_key += n
        return lo

    def _new_key(self, table: str) -> int:
        """A fresh key, or now and then one that was deleted before (re-insert of a key)."""
        freed = self.model.freed.get(table)
        if freed and self.rng.random() < 0.25:
            return freed.pop(self.rng.randrange(len(freed)))
        return self._key()

    def _free(self, table: str, key: Any) -> None:
        freed = self.model.freed.setdefault(table, [])
        freed.append(key)
        if len(freed) > 50:
            del freed[0]

    def _pick(self, held: dict[Any, Any]) -> Any:
        return list(held)[self.rng.randrange(len(held))]

    # kinds -------------------------------------------------------------------------------

    def _kinds_values(self) -> dict[str, Any]:
        rng = self.rng
        return {
            "mood": self._maybe(lambda: rng.choice(MOODS)),
            "ints": self._maybe(self._ints),
            "tags": self._maybe(self._tags),
            "doc": self._maybe(lambda: Jsonb(self._json(2))),
            "amount": self._maybe(self._money),
            "exact": self._maybe(self._exact),
            "at": self._maybe(self._timestamp),
            "blob": self._maybe(self._bytes),
            "flag": self._maybe(lambda: rng.random() < 0.5),
        }

    def _insert_kinds(self) -> None:
        key = self._new_key("kinds")
        values = self._kinds_values()
        columns = ", ".join(["id", *values])
        marks = ", ".join(["%s"] * (len(values) + 1))
        self._dml(
            "kinds", f"INSERT INTO {self.qualified('kinds')} ({columns}) VALUES ({marks})", (key, *values.values())
        )
        self.model.kinds[key] = None

    def _update_kinds(self) -> None:
        key = self._pick(self.model.kinds)
        values = self._kinds_values()
        chosen = self.rng.sample(list(values), self.rng.randint(1, 4))
        sets = ", ".join(f"{c} = %s" for c in chosen)
        self._dml(
            "kinds", f"UPDATE {self.qualified('kinds')} SET {sets} WHERE id = %s", (*[values[c] for c in chosen], key)
        )

    def _delete_kinds(self) -> None:
        key = self._pick(self.model.kinds)
        self._dml("kinds", f"DELETE FROM {self.qualified('kinds')} WHERE id = %s", (key,))
        del self.model.kinds[key]
        self._free("kinds", key)

    # docs (TOAST) ------------------------------------------------------------------------

    def _body(self) -> str | None:
        r = self.rng.random()
        if r < 0.05:
            return None
        if r < 0.2:
            return f"short body {self.rng.randrange(10**6)}"
        return md5_chain(f"{self.seed}-{self.rng.randrange(10**9)}")

    def _insert_docs(self) -> None:
        key = self._new_key("docs")
        self._dml(
            "docs",
            f"INSERT INTO {self.qualified('docs')} (id, version, title, body) VALUES (%s, 0, %s, %s)",
            (key, self._maybe(self._word), self._body()),
        )
        self.model.docs[key] = None

    def _update_docs(self) -> None:
        key = self._pick(self.model.docs)
        if self.rng.random() < 0.75:  # body unchanged: sent as 'u' when stored out of line
            self._dml(
                "docs",
                f"UPDATE {self.qualified('docs')} SET version = version + 1, title = %s WHERE id = %s",
                (self._maybe(self._word), key),
            )
        else:
            self._dml(
                "docs",
                f"UPDATE {self.qualified('docs')} SET version = version + 1, body = %s WHERE id = %s",
                (self._body(), key),
            )

    def _delete_docs(self) -> None:
        key = self._pick(self.model.docs)
        self._dml("docs", f"DELETE FROM {self.qualified('docs')} WHERE id = %s", (key,))
        del self.model.docs[key]
        self._free("docs", key)

    # parent / child ----------------------------------------------------------------------

    def _insert_parent(self) -> None:
        key = self._new_key("parent")
        self._dml(
            "parent",
            f"INSERT INTO {self.qualified('parent')} (id, name, score) VALUES (%s, %s, %s)",
            (key, self._word(), self._maybe(self._money)),
        )
        self.model.parent[key] = None

    def _update_parent(self) -> None:
        key = self._pick(self.model.parent)
        self._dml(
            "parent",
            f"UPDATE {self.qualified('parent')} SET name = %s, score = %s WHERE id = %s",
            (self._word(), self._maybe(self._money), key),
        )

    def _delete_parent(self) -> None:
        key = self._pick(self.model.parent)
        self._dml("parent", f"DELETE FROM {self.qualified('parent')} WHERE id = %s", (key,))  # cascades to children
        del self.model.parent[key]
        self._free("parent", key)
        for child, parent in list(self.model.child.items()):
            if parent == key:
                del self.model.child[child]
                self._free("child", child)

    def _insert_child(self) -> None:
        if not self.model.parent:
            self._insert_parent()
        key = self._new_key("child")
        parent = self._pick(self.model.parent)
        self._dml(
            "child",
            f"INSERT INTO {self.qualified('child')} (id, parent_id, note, at) VALUES (%s, %s, %s, %s)",
            (key, parent, self._maybe(self._word), self._maybe(self._timestamp)),
        )
        self.model.child[key] = parent

    def _update_child(self) -> None:
        key = self._pick(self.model.child)
        if self.model.parent and self.rng.random() < 0.4:
            parent = self._pick(self.model.parent)
            self._dml("child", f"UPDATE {self.qualified('child')} SET parent_id = %s WHERE id = %s", (parent, key))
            self.model.child[key] = parent
        else:
            self._dml(
                "child",
                f"UPDATE {self.qualified('child')} SET note = %s, at = %s WHERE id = %s",
                (self._maybe(self._word), self._maybe(self._timestamp), key),
            )

    def _delete_child(self) -> None:
        key = self._pick(self.model.child)
        self._dml("child", f"DELETE FROM {self.qualified('child')} WHERE id = %s", (key,))
        del self.model.child[key]
        self._free("child", key)

    # bag (REPLICA IDENTITY FULL, duplicates) --------------------------------------------

    def _bag_row(self) -> tuple[Any, ...]:
        rng = self.rng
        return (
            self._maybe(lambda: rng.randint(0, 4)),
            self._maybe(lambda: rng.choice(("x", "y", "z"))),
            self._maybe(lambda: Decimal(rng.randint(0, 3)).scaleb(-1).quantize(Decimal("0.01"))),
            self._maybe(lambda: tuple(rng.choice(("p", "q", None)) for _ in range(rng.randint(0, 2)))),
            self._bag_memo(),
        )

    def _bag_memo(self) -> str | None:
        """NULL, a short text or one of two ~20 kB texts (stored out of line; duplicates stay likely)."""
        r = self.rng.random()
        if r < 0.4:
            return None
        if r < 0.6:
            return "short memo"
        return md5_chain(f"bag-{self.seed}-{int(r * 10) % 2}")

    @staticmethod
    def _bag_params(row: tuple[Any, ...]) -> tuple[Any, ...]:
        return (*row[:3], list(row[3]) if row[3] is not None else None, row[4])

    _BAG_EQUAL = (
        "a IS NOT DISTINCT FROM %s AND b IS NOT DISTINCT FROM %s AND c IS NOT DISTINCT FROM %s"
        " AND tags IS NOT DISTINCT FROM %s::text[] AND memo IS NOT DISTINCT FROM %s"
    )

    def _insert_bag(self) -> None:
        row = self._pick_bag() if self.model.bag and self.rng.random() < 0.4 else self._bag_row()
        copies = self.rng.choice((1, 1, 1, 2, 3))
        self._dml(
            "bag",
            f"INSERT INTO {self.qualified('bag')} (a, b, c, tags, memo) SELECT %s, %s, %s, %s::text[], %s"
            " FROM generate_series(1, %s)",
            (*self._bag_params(row), copies),
        )
        self.model.bag.extend([row] * copies)

    def _pick_bag(self) -> tuple[Any, ...]:
        return self.model.bag[self.rng.randrange(len(self.model.bag))]

    def _update_bag(self) -> None:
        old = self._pick_bag()
        new = list(self._bag_row())
        for i in self.rng.sample(range(4), self.rng.randint(0, 3)):
            new[i] = old[i]
        if self.rng.random() < 0.7:
            new[4] = old[4]  # memo not set: sent as unchanged TOAST when stored out of line
            sets = "a = %s, b = %s, c = %s, tags = %s::text[]"
            values: tuple[Any, ...] = self._bag_params(tuple(new))[:4]
        else:
            sets = "a = %s, b = %s, c = %s, tags = %s::text[], memo = %s"
            values = self._bag_params(tuple(new))
        new_row = tuple(new)
        if self.rng.random() < 0.7:  # one copy
            self._dml(
                "bag",
                f"UPDATE {self.qualified('bag')} SET {sets} WHERE ctid ="
                f" (SELECT ctid FROM {self.qualified('bag')} WHERE {self._BAG_EQUAL} LIMIT 1)",
                (*values, *self._bag_params(old)),
            )
            self.model.bag.remove(old)
            self.model.bag.append(new_row)
        else:  # every copy
            self._dml(
                "bag",
                f"UPDATE {self.qualified('bag')} SET {sets} WHERE {self._BAG_EQUAL}",
                (*values, *self._bag_params(old)),
            )
            count = self.model.bag.count(old)
            self.model.bag = [r for r in self.model.bag if r != old] + [new_row] * count

    def _delete_bag(self) -> None:
        old = self._pick_bag()
        if self.rng.random() < 0.7:
            self._dml(
                "bag",
                f"DELETE FROM {self.qualified('bag')} WHERE ctid ="
                f" (SELECT ctid FROM {self.qualified('bag')} WHERE {self._BAG_EQUAL} LIMIT 1)",
                self._bag_params(old),
            )
            self.model.bag.remove(old)
        else:
            self._dml("bag", f"DELETE FROM {self.qualified('bag')} WHERE {self._BAG_EQUAL}", self._bag_params(old))
            self.model.bag = [r for r in self.model.bag if r != old]

    # coded (REPLICA IDENTITY USING INDEX on (region, code)) -----------------------------

    def _code_key(self) -> tuple[int, str]:
        freed = self.model.freed.get("coded")
        if freed and self.rng.random() < 0.25:
            key = freed.pop(self.rng.randrange(len(freed)))
            if key not in self.model.coded:
                return key
        return (self.rng.randint(1, 4), f"C-{self._key()}")

    def _insert_coded(self) -> None:
        key = self._code_key()
        self._dml(
            "coded",
            f"INSERT INTO {self.qualified('coded')} (region, code, qty, note) VALUES (%s, %s, %s, %s)",
            (*key, self._maybe(lambda: self.rng.randint(-5, 500)), self._maybe(self._word)),
        )
        self.model.coded[key] = None

    def _update_coded(self) -> None:
        region, code = self._pick(self.model.coded)
        self._dml(
            "coded",
            f"UPDATE {self.qualified('coded')} SET qty = %s, note = %s WHERE region = %s AND code = %s",
            (self._maybe(lambda: self.rng.randint(-5, 500)), self._maybe(self._word), region, code),
        )

    def _delete_coded(self) -> None:
        key = self._pick(self.model.coded)
        self._dml("coded", f"DELETE FROM {self.qualified('coded')} WHERE region = %s AND code = %s", key)
        del self.model.coded[key]
        self._free("coded", key)

    # events (no key: insert only) -------------------------------------------------------

    def _insert_events(self) -> None:
        rows = self.rng.choice((1, 1, 1, 2, 5))
        values = []
        for _ in range(rows):
            values.extend([self._word(), Jsonb(self._json(1)), self._maybe(self._timestamp)])
        marks = ", ".join(["(%s, %s, %s)"] * rows)
        self._dml("events", f"INSERT INTO {self.qualified('events')} (kind, payload, at) VALUES {marks}", values)

    # orders (row filter) ----------------------------------------------------------------

    def _order_values(self) -> tuple[str, Decimal | None]:
        rng = self.rng
        status = rng.choice(("draft", "open", "paid", "void"))
        amount = None if rng.random() < 0.1 else Decimal(rng.randint(0, 3000)).scaleb(-2)
        return status, amount

    def _insert_orders(self) -> None:
        key = self._new_key("orders")
        status, amount = self._order_values()
        self._dml(
            "orders",
            f"INSERT INTO {self.qualified('orders')} (id, status, amount, customer, memo) VALUES (%s, %s, %s, %s, %s)",
            (key, status, amount, self._maybe(self._word), self._order_memo()),
        )
        self.model.orders[key] = None

    def _update_orders(self) -> None:
        key = self._pick(self.model.orders)
        status, amount = self._order_values()
        which = self.rng.random()
        if which < 0.4:
            self._dml("orders", f"UPDATE {self.qualified('orders')} SET status = %s WHERE id = %s", (status, key))
        elif which < 0.8:
            self._dml("orders", f"UPDATE {self.qualified('orders')} SET amount = %s WHERE id = %s", (amount, key))
        elif which < 0.9:
            self._dml(
                "orders",
                f"UPDATE {self.qualified('orders')} SET customer = %s WHERE id = %s",
                (self._maybe(self._word), key),
            )
        else:
            self._dml(
                "orders",
                f"UPDATE {self.qualified('orders')} SET status = %s, memo = %s WHERE id = %s",
                (status, self._order_memo(), key),
            )

    def _order_memo(self) -> str | None:
        r = self.rng.random()
        if r < 0.3:
            return None
        if r < 0.5:
            return f"memo {self.rng.randrange(1000)}"
        return md5_chain(f"order-{self.seed}-{self.rng.randrange(10**9)}")

    def _delete_orders(self) -> None:
        key = self._pick(self.model.orders)
        self._dml("orders", f"DELETE FROM {self.qualified('orders')} WHERE id = %s", (key,))
        del self.model.orders[key]
        self._free("orders", key)

    # key changes, swaps, truncates -------------------------------------------------------

    def _key_change(self, table: str) -> None:
        self.stats.key_changes += 1
        if table == "coded":
            old = self._pick(self.model.coded)
            new = self._code_key()
            if new in self.model.coded:
                new = (old[0], f"C-{self._key()}")
            self._dml(
                "coded",
                f"UPDATE {self.qualified('coded')} SET region = %s, code = %s, qty = coalesce(qty, 0) + 1"
                " WHERE region = %s AND code = %s",
                (*new, *old),
            )
            del self.model.coded[old]
            self.model.coded[new] = None
            self._free("coded", old)
            return
        held = getattr(self.model, table)
        old = self._pick(held)
        new = self._new_key(table)
        extra = {
            "kinds": (", flag = NOT coalesce(flag, false)", ()),
            "docs": (", version = version + 1", ()),  # body unchanged: 'u' across a key change
            "parent": ("", ()),
            "child": (", note = %s", (self._maybe(self._word),)),
            "orders": (", status = %s", (self._order_values()[0],)) if self.rng.random() < 0.5 else ("", ()),
        }[table]
        self._dml(table, f"UPDATE {self.qualified(table)} SET id = %s{extra[0]} WHERE id = %s", (new, *extra[1], old))
        if table == "child":
            self.model.child[new] = self.model.child.pop(old)
        else:
            del held[old]
            held[new] = None
        if table == "parent":  # ON UPDATE CASCADE
            for child, parent in self.model.child.items():
                if parent == old:
                    self.model.child[child] = new
        self._free(table, old)

    def _swap(self, table: str) -> None:
        """Swap two keys through a temporary one (three statements, one transaction)."""
        self.stats.swaps += 1
        own = not self._in_transaction
        if own:
            self._begin()
        if table == "coded":
            a, b = self.rng.sample(list(self.model.coded), 2)
            temp = (a[0], f"T-{self._key()}")
            where = "region = %s AND code = %s"
            for new, old in ((temp, a), (a, b), (b, temp)):
                self._dml(
                    "coded", f"UPDATE {self.qualified('coded')} SET region = %s, code = %s WHERE {where}", (*new, *old)
                )
        else:
            held = getattr(self.model, table)
            a, b = self.rng.sample(list(held), 2)
            temp = -self._key()
            for new, old in ((temp, a), (a, b), (b, temp)):
                self._dml(table, f"UPDATE {self.qualified(table)} SET id = %s WHERE id = %s", (new, old))
            if table == "parent":
                for child, parent in self.model.child.items():
                    if parent in (a, b):
                        self.model.child[child] = b if parent == a else a
        if own:
            self._commit()

    TRUNCATES = (
        ("TRUNCATE {s}.parent CASCADE", ("parent", "child")),
        ("TRUNCATE {s}.parent, {s}.child RESTART IDENTITY", ("parent", "child")),
        ("TRUNCATE {s}.child", ("child",)),
        ("TRUNCATE {s}.coded RESTART IDENTITY", ("coded",)),
        ("TRUNCATE {s}.events", ("events",)),
        ("TRUNCATE {s}.docs", ("docs",)),
        ("TRUNCATE {s}.kinds, {s}.orders", ("kinds", "orders")),
        ("TRUNCATE {s}.bag", ("bag",)),
        ("TRUNCATE {s}.orders", ("orders",)),
    )

    def _truncate(self) -> None:
        sql, tables = self.rng.choice(self.TRUNCATES)
        self.stats.truncates += 1
        self._dml(tables[0], sql.format(s=self.schema), ())
        for table in tables:
            if table == "events":
                continue
            held = getattr(self.model, table)
            if isinstance(held, list):
                held.clear()
            else:
                for key in list(held):
                    self._free(table, key)
                held.clear()

    # values ------------------------------------------------------------------------------

    def _maybe(self, make: Callable[[], Any], null: float = 0.12) -> Any:
        return None if self.rng.random() < null else make()

    def _word(self) -> str:
        rng = self.rng
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) + f" {rng.randrange(1000)}"

    def _ints(self) -> list[int | None]:
        rng = self.rng
        pool = (0, 1, -1, 2**31 - 1, -(2**31), 42)
        return [
            None if rng.random() < 0.1 else (rng.choice(pool) if rng.random() < 0.3 else rng.randint(-(10**6), 10**6))
            for _ in range(rng.randint(0, 5))
        ]

    def _tags(self) -> list[str | None]:
        rng = self.rng
        return [None if rng.random() < 0.1 else rng.choice(TAGS) for _ in range(rng.randint(0, 4))]

    def _json(self, depth: int) -> Any:
        rng = self.rng
        r = rng.random()
        if depth > 0 and r < 0.5:
            return {rng.choice(WORDS) + str(i): self._json(depth - 1) for i in range(rng.randint(0, 4))}
        if depth > 0 and r < 0.7:
            return [self._json(depth - 1) for _ in range(rng.randint(0, 3))]
        return rng.choice(
            (
                None,
                True,
                False,
                rng.randint(-(10**12), 10**12),
                rng.random() * 1000,
                'ünï "q" \\ \n tab\t',
                rng.choice(WORDS),
                1.5,
                10**20,
            )
        )

    def _money(self) -> Decimal:
        rng = self.rng
        return Decimal(
            rng.randint(-(10**10) + 1, 10**10 - 1) if rng.random() < 0.3 else rng.randint(-5000, 100000)
        ).scaleb(-2)

    def _exact(self) -> Decimal:
        rng = self.rng
        r = rng.random()
        if r < 0.05:
            return Decimal(rng.choice(("NaN", "Infinity", "-Infinity")))
        if r < 0.1:
            return Decimal("0." + "0" * rng.randint(0, 6))
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))
        scale = rng.randint(0, min(len(digits) + 10, 30))
        value = Decimal(int(digits)).scaleb(-scale)
        return -value if rng.random() < 0.3 else value

    def _timestamp(self) -> datetime:
        rng = self.rng
        offset = timedelta(minutes=rng.choice((0, 0, 60, -300, 330, 345, -570, 840)))
        base = datetime(1950, 1, 1, tzinfo=UTC) + timedelta(
            seconds=rng.randint(0, 120 * 365 * 86400), microseconds=rng.randint(0, 999_999)
        )
        return base.astimezone(timezone(offset))

    def _bytes(self) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.1:
            return b""
        if r < 0.2:
            return b"\x00\\x00\x00'\""
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 48)))

    # execution ---------------------------------------------------------------------------

    def _begin(self) -> None:
        self._execute("BEGIN", dml=False)
        self._in_transaction = True
        self.stats.transactions += 1

    def _commit(self) -> None:
        self._execute("COMMIT", dml=False)
        self._in_transaction = False

    def _dml(self, table: str, sql: str, params: Any) -> None:
        self._execute(sql, params, dml=True)
        self.stats.by_table[table] = self.stats.by_table.get(table, 0) + 1

    def _execute(self, sql: str, params: Any = None, *, dml: bool) -> None:
        if self.log is not None:
            self.log.append(sql if not params else f"{sql} -- {params!r}")
        try:
            self.conn.execute(sql, params)
        except psycopg.Error as error:
            raise AssertionError(
                f"workload seed {self.seed}: statement failed (the workload's model is wrong): {sql} {params!r}: {error}"
            ) from error
        if dml:
            self.stats.ops += 1
            self._unit_ops += 1


def log_coverage(changelog: str | LogStore) -> dict[str, dict[str, int]]:
    """What the change log of a run holds, per table: records by operation, key changes, updates
    with unchanged TOAST columns, old images by kind — evidence that the workload exercised what
    it claims to."""
    import numpy as np
    import pyarrow.compute as pc

    from cdc_assets.changelog.reader import ChangeLogReader

    reader = ChangeLogReader(changelog)
    out: dict[str, dict[str, int]] = {}
    for table in reader.tables():
        counts: dict[str, int] = {}
        for chunk in reader.read_changes(table):
            records = chunk.records
            for op, n in zip(*np.unique(records.column("_cdc_op").to_numpy(zero_copy_only=False), return_counts=True)):
                counts[str(op)] = counts.get(str(op), 0) + int(n)
            kinds = records.column("_cdc_old_kind").to_pylist()
            for kind in ("K", "O"):
                counts[f"old {kind}"] = counts.get(f"old {kind}", 0) + kinds.count(kind)
            unchanged = pc.list_value_length(records.column("_cdc_unchanged")).fill_null(0)
            counts["unchanged TOAST"] = counts.get("unchanged TOAST", 0) + int(
                pc.sum(pc.greater(unchanged, 0)).as_py() or 0
            )
        out[table] = counts
    return out


def tables_section(tables: list[str]) -> dict[str, dict[str, str]]:
    """The ``tables`` section (:func:`tests.support.config_file.write_config`) for the workload's
    ``tables`` (``schema.table``): the filtered ones with their row filter."""
    return {
        table: ({"row_filter": FILTERED[table.split(".", 1)[1]]} if table.split(".", 1)[1] in FILTERED else {})
        for table in tables
    }
