"""Measures a proposed change, not the library: Begin/Commit handled inline in ``feed_rows``.

    python benchmarks/proposal_feed_rows.py [--pg 16] [--transactions 90000] [--repeat 7]

``TransactionAssembler.feed_rows`` already takes a short path for Insert/Update/Delete of plain
transactions, but every Begin and Commit goes through ``feed`` → ``_control`` →
``PgoutputDecoder.decode`` → a message object → a ``match`` over ~15 classes. With pgbench's
4-change transactions these are a third of all messages and about 40 % of the assembler's time
(see BENCHMARKS.md). ``InlineAssembler`` below (a subclass, for measurement only) unpacks the two
fixed-size layouts itself while a plain transaction is open (Commit) or none is (Begin), and falls
back to ``feed`` for anything else (flags, other lengths, streams, two-phase). The script checks that
both produce identical record batches and transactions on the captured pgbench rows, then times
both, round-robin.

What the subclass leaves out, and a real change would keep: ``_timestamp``'s range check on the
commit time (one comparison) and the ``DecodeError`` context (``feed`` handles every row it does
not recognise, so malformed Begin/Commit still fail there).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Iterable
from struct import Struct
from typing import Any

import _common as common
import decode as bench
import psycopg

import cdc_assets.transactions as tx
from cdc_assets.config import SourceConfig
from cdc_assets.pgoutput.messages import POSTGRES_EPOCH_US
from cdc_assets.source.reader import SlotReader

_BEGIN = Struct(">QqI").unpack_from
_COMMIT = Struct(">BQQq").unpack_from
_OID = Struct(">I").unpack_from


class InlineAssembler(tx.TransactionAssembler):
    """``feed_rows`` with Begin and Commit of plain transactions unpacked inline."""

    def feed_rows(self, rows: Iterable[tuple[int, bytes]]) -> int:
        count = 0
        shared, relations, unpack, commits = self._shared, self._shared_raw, _OID, self._commits
        commit_info, plain_transaction, chunk = tx.CommitInfo, tx._PlainTransaction, tx.CHUNK_ROWS
        plain = self._plain_target()
        seq = self._seq
        for lsn, data in rows:
            count += 1
            first = data[0]
            if plain:
                if (first == 73 or first == 85 or first == 68) and len(data) >= 5:
                    raw = relations.get(unpack(data, 1)[0])
                    if raw is not None:
                        raw.messages.append(data)
                        raw.seqs.append(seq)
                        seq += 1
                        if len(raw.messages) >= chunk:
                            shared.convert(raw.schema.qualified_name)
                        continue
                elif first == 67 and len(data) == 26 and data[1] == 0:  # Commit, flags 0
                    _, commit_lsn, end_lsn, commit_time = _COMMIT(data, 1)
                    txn = self._current
                    assert txn is not None
                    self._current = None
                    self._lsn = lsn
                    info = commit_info(
                        txn.xid, commit_lsn, end_lsn, commit_time + POSTGRES_EPOCH_US, txn.origin, txn.origin_lsn
                    )
                    self.last_end_lsn = max(self.last_end_lsn, end_lsn)
                    self.completed += 1
                    if end_lsn > self.checkpoint_lsn:
                        commits.commit(txn.tag, info)
                        self.sink.transaction(info, seq - txn.start + txn.adjust, txn.messages or [])  # type: ignore[union-attr]
                        if commits.pending >= chunk // 4 and shared.raw_rows >= chunk:
                            self._seq = seq
                            self._write_shared()
                            seq = self._seq
                    plain = False
                    continue
            elif first == 66 and len(data) == 21 and self._current is None and not self._decoder.in_stream:
                _, _, xid = _BEGIN(data, 1)
                self._lsn = lsn
                self._current = plain_transaction(xid, commits.open(seq), False, seq)
                plain = True
                continue
            self._seq = seq
            self.feed(lsn, data)
            seq = self._seq
            plain = self._plain_target()
        self._seq = seq
        return count


class KeepingSink(bench.NullSink):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[str, Any]] = []
        self.commits: list[tuple[int, int, int, int, int]] = []

    def records(self, relation: Any, records: Any) -> None:
        self.kept.append((relation.qualified_name, records))

    def transaction(self, info: Any, changes: int, messages: Any) -> None:
        self.commits.append((info.xid, info.commit_lsn, info.end_lsn, info.commit_time_us, changes))


def assemble(cls: type[tx.TransactionAssembler], rows: list[tuple[int, bytes]], sink: Any) -> Any:
    assembler = cls(streaming="off")
    assembler.start_call(sink, 0)
    assembler.feed_rows(rows)
    assembler.finish_call()
    return sink


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16, choices=(15, 16, 18))
    parser.add_argument("--transactions", type=int, default=90_000)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    load_before = common.load_snapshot()
    cluster, _ = bench.prepare(args)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            source = SourceConfig(dsn=cluster.dsn(), publication=bench.PUBLICATION, slot=bench.SLOT)
            reader = SlotReader(conn, source, cluster.version, two_phase=False)
            with reader.peek(bench.NO_LIMIT) as rows:
                captured = list(rows)
    finally:
        cluster.stop()
    current = assemble(tx.TransactionAssembler, captured, KeepingSink())
    inline = assemble(InlineAssembler, captured, KeepingSink())
    same = current.commits == inline.commits and len(current.kept) == len(inline.kept) and all(
        a == c and b.equals(d) for (a, b), (c, d) in zip(current.kept, inline.kept)
    )
    print(f"{len(captured):,} messages; identical records and transactions: {same}")
    timings: dict[str, list[float]] = {"current feed_rows": [], "inline Begin/Commit": []}
    for _ in range(args.repeat):
        for name, cls in (("current feed_rows", tx.TransactionAssembler), ("inline Begin/Commit", InlineAssembler)):
            gc.collect()
            started = time.perf_counter()
            assemble(cls, captured, bench.NullSink())
            timings[name].append(time.perf_counter() - started)
    rows_out = [
        [name, f"{min(ts):.3f}", f"{statistics.median(ts):.3f}", f"{len(captured) / statistics.median(ts):,.0f}"]
        for name, ts in timings.items()
    ]
    print(common.table(["c. feed_rows -> Arrow", "best s", "median s", "msg/s median"], rows_out))
    gain = statistics.median(timings["current feed_rows"]) / statistics.median(timings["inline Begin/Commit"])
    print(f"speed-up (medians): {gain:.2f}x")
    print(f"before: {common.describe_load(load_before)}\nafter:  {common.describe_load(common.load_snapshot())}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
