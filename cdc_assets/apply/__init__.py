"""Applying the change log to Delta tables: the Spark/Delta merge of a table's planned net change,
the merges of a following drain, change history, and Delta table maintenance."""
