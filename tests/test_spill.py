"""The spill queue (cdc_assets/transactions/spill.py): converted batches in order with their tags,
in memory up to the budget, past it in temporary Arrow files that are deleted once read back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from cdc_assets.transactions import spill
from tests.support.records import INT4, relation

T = relation("t", ("id", INT4, True))


def batch(*values: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], names=["_cdc_position"])


def tags(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_under_the_budget_batches_stay_in_memory_in_order(tmp_path: Path) -> None:
    queue = spill.SpillQueue(str(tmp_path))
    assert not queue
    queue.append(T, batch(1, 2), tags(0, 1))
    queue.append(T, batch(3), tags(2))
    assert queue and list(tmp_path.iterdir()) == []
    items = list(queue.pop_all())
    assert [(s, b.column(0).to_pylist(), t.tolist()) for s, b, t in items] == [(T, [1, 2], [0, 1]), (T, [3], [2])]
    assert not queue and list(queue.pop_all()) == []


def test_past_the_budget_batches_go_to_files_and_come_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, third = batch(1, 2, 3), batch(4), batch(5, 6)
    monkeypatch.setattr(spill, "SPILL_BYTES", first.nbytes + second.nbytes)
    queue = spill.SpillQueue(str(tmp_path))
    queue.append(T, first, tags(7, 7, 7))
    queue.append(T, second, tags(8))
    queue.append(T, third, tags(9, 9))  # over the budget: spilled
    [spilled] = tmp_path.iterdir()
    assert spilled.name.startswith("cdc-spill-") and spilled.suffix == ".arrow"
    items = [(b.column(0).to_pylist(), t.tolist()) for _, b, t in queue.pop_all()]
    assert items == [([1, 2, 3], [7, 7, 7]), ([4], [8]), ([5, 6], [9, 9])]
    assert list(tmp_path.iterdir()) == []
    queue.append(T, first, tags(1, 1, 1))  # the budget is free again after pop_all
    assert list(tmp_path.iterdir()) == []


def test_discard_deletes_spilled_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "SPILL_BYTES", 1)
    queue = spill.SpillQueue(str(tmp_path))
    for i in range(3):
        queue.append(T, batch(i), tags(i))
    assert len(list(tmp_path.iterdir())) == 3
    queue.discard()
    assert not queue and list(tmp_path.iterdir()) == []
