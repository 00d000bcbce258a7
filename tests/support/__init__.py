"""Helpers shared by the tests; every one has one home here (the fixtures are ``tests/conftest.py``'s).

The source and its configuration:

* ``database`` — the database fixture type: :class:`Database` (a fresh database on a throwaway
  cluster; ``pg``, ``pg_module`` and ``pg_any`` in conftest), the cluster pool.
* ``config_file`` — the one writer of ``cdc.yaml`` (:func:`write_config`, section by section) and
  ``DSN_VARIABLE``.
* ``bucket`` — a bucket of the test run's S3 server (the ``bucket`` fixture): its ``storage``
  section, environment and Spark settings.
* ``commit_time`` — transactions committed at a chosen time.

Pipelines to drive:

* ``pipeline`` — :class:`Pipeline`: setup, drain and the CLI around one database; ``wait_until``.
* ``mirror`` — :class:`Mirror`: the same for the apply tests, on the shared Spark session, with
  :meth:`Mirror.check` (Spark and delta-rs against the source).
* ``dagster_env`` — the Dagster code location driven in-process (:class:`DagsterEnv`, its
  ``cdc.yaml`` through ``write_dagster_config``, ``ThreadRunLauncher`` for the run queue, the
  demo's instance settings, a run's ``materialization``).
* ``dagster_rounds`` — rounds of transactions on ``dagster_env``'s tables, with the changes and
  merges each brings.
* ``processes`` — commands run in a subprocess, and what they started (SIGTERM tests).
* ``crash`` — the drain crash tests' CLI runs, ledger workload and log checks.
* ``workload`` — the seeded random workload of the differential and crash tests (its ``tables``
  section: ``tables_section``).
* ``differential`` — one seed of the differential test (:func:`run_seed`, :class:`SeedResult`), and
  the seeds and size of its smaller variants (bucket, Spark Connect).
* ``applied_marker`` — a table's applied LSN recorded without Spark.
* ``spark_host`` — the test run's Spark session as the commands' Spark Connect server
  (``COMMANDS_SPARK``), or a Spark of a command's own (``OWN_SPARK``).

What is right — the oracles:

* ``rows`` — rows as Python values: the source read the way the change log reads it
  (``source_values`` as the log's values, ``source_table`` / ``source_rows`` as Delta should hold
  them), and the one comparison of rows (``freeze``, ``multiset``, ``difference``).
* ``oracle`` — the change log replayed into rows (:class:`Replica`), checked against the source
  (``assert_mirrors``).
* ``mirror_diff`` — a Delta mirror against its source: the two Delta readers (Spark, delta-rs),
  ``assert_delta_equals_source``, and ``compare_all`` / ``report`` (types, specials, both readers).
* ``catalog_read`` — a classic Spark application reading every mirror by name from the
  configuration's catalog (run as ``python -m``), its rows left in Arrow files.

Protocol and change records built by hand (unit tests):

* ``pgoutput_writer`` — typed messages → pgoutput bytes (the decoder's inverse).
* ``peek`` — a pgoutput slot peeked and decoded over the replication stream.
* ``assembly`` — hand-built peek blocks fed to a recording transaction assembler.
* ``records`` — change records in the change log's format, for the planner.
* ``copied`` — rows as their change records hold them, to compare a copy with what pgoutput sends.
"""
