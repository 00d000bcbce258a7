# ruff: noqa: B018, F821
# Names vulture (run by .ci/run over cdc_assets and dagster_project) finds unused that are used:
# each line names one, and says who uses it. vulture reads this file as code that uses them.

# -- used from outside the packages ----------------------------------------------------------------
add_demo_command  # the `demo` command: pyproject.toml's entry point cdc_assets.commands loads it
point_query  # public API: reading a consistent point with delta-rs (README, "Reading every table as of one moment")
register_views  # public API: a consistent point as Spark views (README, "Reading every table as of one moment")
CdcComponent  # the component type: pyproject.toml's entry point dagster_dg_cli.registry_modules, a defs.yaml's `type:`
_.build_defs  # the same: Dagster calls it to load a component
_.get_scaffold_params  # dagster_project/scaffold.py: `dg scaffold defs` calls the scaffolder's
_.scaffold  # the same

# -- used by name ------------------------------------------------------------------------------
_.flag  # config/loader.py: SectionReader methods, called by the kind a setting names (getattr)
_.positive  # the same
_.identifier  # the same
_.isolation_level  # source/snapshot.py: a psycopg connection's setting, assigned
_.read_only  # the same
traceback  # apply/follower.py: a parameter of __exit__, which the context manager protocol passes

# -- records: every field the message or result carries, read by the tests ------------------------
not_null  # changelog/schema_changes.py: a captured column, as the DDL capture's JSON has it
has_missing  # the same
command_tag  # the same: the capture message's command
reconnects  # pipeline/drain.py: DrainResult, how often a following drain reconnected
_.reconnects  # the same

# -- read by the tests only: what a test observes of a running object -------------------------------
_.receiver_pid  # stream/reader.py: which receiving process holds the stream (its reuse across sessions)
_.open_streams  # transactions/assembler.py: streamed transactions open in the session
