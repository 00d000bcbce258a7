"""The assembler's output (cdc_assets/transactions/sink.py): transactions are counted and the
highest end LSN kept whether or not they are written; those at or below the checkpoint are not."""

from __future__ import annotations

import numpy as np

from cdc_assets.transactions.sink import Output
from tests.support.assembly import RecordingSink


def test_ended_counts_and_says_what_to_write() -> None:
    output = Output()
    output.start(RecordingSink(), checkpoint_lsn=0x200)
    assert output.last_end_lsn == 0x200 and output.completed == 0
    assert [output.ended(0x100), output.ended(0x300), output.ended(0x250)] == [False, True, True]
    assert output.completed == 3 and output.last_end_lsn == 0x300
    live = output.ended_many(np.array([0x180, 0x400, 0x200]))
    assert live.tolist() == [False, True, False]
    assert output.completed == 6 and output.last_end_lsn == 0x400
    assert output.ended_many(np.array([], dtype=np.int64)).tolist() == [] and output.last_end_lsn == 0x400


def test_a_new_call_resets_the_count_not_the_end() -> None:
    output = Output()
    output.start(RecordingSink(), checkpoint_lsn=0x100)
    output.ended(0x500)
    sink = RecordingSink()
    output.start(sink, checkpoint_lsn=0x300)
    assert output.sink is sink and output.completed == 0 and output.last_end_lsn == 0x500
