"""The change log: committed transactions as Parquet segments with their checkpoint, the reader,
the planner of a table's net change (pure), and retention with its compacted bases."""
