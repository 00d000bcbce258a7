"""``dg scaffold defs dagster_project.component.CdcComponent <name>``: the component's folder with a
``defs.yaml`` that names a starting ``cdc.yaml`` beside it, which ``dg check defs`` loads as is.

The key prefix is the folder's name, so a second database scaffolded beside the first collides in
nothing; the DSN comes from ``$<NAME>_DSN`` (``--json-params '{"dsn_env": …}'`` for another), the
slot is ``cdc_<name>``, and the change log and the mirrors go to ``data/<name>/`` of the project.
"""

from __future__ import annotations

import os
import re

import dagster as dg
import yaml
from pydantic import BaseModel, Field

CONFIG_FILE = "cdc.yaml"
STARTING_CONFIG = """\
# cdc-assets configuration (README, "Configuration reference"). Before the first drain:
# cdc-assets setup -c {config_file}   (publication, slot, the initial copy of the tables)
source:
  dsn: ${{{dsn_env}}}
  slot: {slot}
  publication: {slot}
changelog:
  path: {changelog}
warehouse:
  path: {warehouse}
tables:   # the tables to mirror: schema.table, with settings such as row_filter
{tables}"""


class CdcScaffoldParams(BaseModel):
    """``--json-params``: the DSN's environment variable (default ``<NAME>_DSN``) and the tables."""

    dsn_env: str | None = None
    tables: list[str] = Field(default_factory=lambda: ["public.orders"])


def _identifier(name: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", name.lower())


class CdcScaffolder(dg.Scaffolder[CdcScaffoldParams]):
    @classmethod
    def get_scaffold_params(cls) -> type[CdcScaffoldParams]:
        return CdcScaffoldParams

    def scaffold(self, request: dg.ScaffoldRequest[CdcScaffoldParams]) -> None:
        folder = request.target_path
        name = _identifier(folder.name)
        params = request.params
        data = (request.project_root or folder) / "data" / name
        config = STARTING_CONFIG.format(
            config_file=os.path.relpath(folder / CONFIG_FILE, request.project_root or folder),
            dsn_env=params.dsn_env or f"{name.upper()}_DSN",
            slot=f"cdc_{name}"[:63],
            changelog=os.path.relpath(data / "changelog", folder),
            warehouse=os.path.relpath(data / "warehouse", folder),
            tables="".join(f"  {table}: {{}}\n" for table in params.tables),
        )
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_FILE).write_text(config, encoding="utf-8")
        attributes = {"config": CONFIG_FILE, "key_prefix": [name]}
        document = {"type": request.type_name, "attributes": attributes}
        (folder / "defs.yaml").write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
