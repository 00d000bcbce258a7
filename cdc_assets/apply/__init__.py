"""Applying the change log to Delta tables: planning (pure) and the Spark/Delta merge."""
