"""Definitions, one module per domain (filled in as the pipeline grows)."""
