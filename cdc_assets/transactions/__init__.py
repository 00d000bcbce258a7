"""The transaction assembler: the messages of a replication session → committed transactions, written to a sink.

One module per way a transaction arrives, and what they share:

* :mod:`.assembler` — :class:`TransactionAssembler`: per session state, and each message routed to one of
* :mod:`.plain` — plain transactions (Begin … Commit), runs of them taken whole with numpy;
* :mod:`.streamed` — streamed transactions and their subtransaction aborts;
* :mod:`.two_phase` — Begin Prepare … Prepare, Stream Prepare, Commit / Rollback Prepared;
* :mod:`.buffers` — raw and converted changes per table; a transaction buffered on its own;
* :mod:`.spill` — the memory bounds, and converted chunks spilled to temporary Arrow files;
* :mod:`.commit_table` — the commit columns, and the commit values of a batch's plain transactions;
* :mod:`.sink` — :class:`ChangeSink` and what it is given.
"""

from cdc_assets.transactions.assembler import TransactionAssembler
from cdc_assets.transactions.commit_table import COMMIT_FIELDS, with_commit_columns
from cdc_assets.transactions.sink import ChangeSink, CommitInfo, PreparedTransaction, TransactionalMessage

__all__ = [
    "COMMIT_FIELDS",
    "ChangeSink",
    "CommitInfo",
    "PreparedTransaction",
    "TransactionAssembler",
    "TransactionalMessage",
    "with_commit_columns",
]
