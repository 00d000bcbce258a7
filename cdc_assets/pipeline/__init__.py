"""The pipeline's use cases, what the command line and Dagster both call: set up, drain, copy
again online, check parity, report status."""
