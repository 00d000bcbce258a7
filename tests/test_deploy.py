"""The deployment files in ``deploy/``, checked without Docker: the Compose file (YAML, anchors and
merge keys, images and builds, bind mounts, env files and the variables it interpolates, service
references), the Dockerfile's build inputs, the Dagster instance file (Dagster's own validation,
down to each configured class's config schema), the workspace file (Dagster's own loader) and the
pipeline configuration (the project's own loaders, and the code location it builds) — and that
these files agree with each other: ports, hosts, paths, the image name, the environment the run
launcher forwards.
"""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from dagster._config import process_config, resolve_to_config_type
from dagster._core.errors import DagsterInvalidConfigError
from dagster._core.instance.config import dagster_instance_config
from dagster._core.instance.ref import InstanceRef
from dagster._core.remote_origin import GrpcServerCodeLocationOrigin
from dagster._core.workspace.config_schema import ensure_workspace_config
from dagster._core.workspace.load import location_origins_from_yaml_paths
from packaging.requirements import Requirement

from cdc_assets.config import load_config
from cdc_assets.config.jdbc import jdbc_url
from cdc_sandbox.s3server import ThrowawayS3Server
from dagster_project.factory import build_definitions
from dagster_project.settings import load_settings
from tests.support.dagster_env import DSN_VARIABLE, ROOT

DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DAGSTER_SERVICES = ("code_location", "webserver", "daemon")  # each loads the instance file
INSTANCE_ENV = {"DAGSTER_PG_USER": "dagster", "DAGSTER_PG_PASSWORD": "secret", "DAGSTER_PG_DB": "dagster"}
# Host paths a service may bind that are not part of the repository.
HOST_BINDS = {"/var/run/docker.sock"}  # the Docker run launcher starts run containers through it
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


# -- reading the files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(document, dict) and isinstance(document.get("services"), dict)
    return document


@pytest.fixture
def instance_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    for name, value in INSTANCE_ENV.items():
        monkeypatch.setenv(name, value)
    yield INSTANCE_ENV


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}[{index}]")


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or ``KEY=VALUE`` list form)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(type, source, target)`` of each entry in a service's ``volumes`` (short or long syntax)."""
    mounts = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, str):
            source, _, rest = entry.partition(":")
            target = rest.split(":")[0]
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        else:
            kind, source, target = entry["type"], entry.get("source", ""), entry["target"]
        mounts.append((kind, source, target))
    return mounts


def pipeline_environ(compose: dict[str, Any], documented: dict[str, str]) -> dict[str, str]:
    """The variables cdc.yaml reads besides the source DSN — ``CDC_S3_*`` and ``CDC_METASTORE_DSN`` —
    as the Dagster services get them, resolved from ``documented`` (.env's keys)."""
    env = environment(compose["services"]["code_location"])
    return {
        name: _INTERPOLATION.sub(lambda m: documented[m.group(1) or m.group(3)], str(env[name]))
        for name in env
        if name.startswith(("CDC_S3_", "CDC_METASTORE_"))
    }


def env_file_keys(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, "a continuation line ends the Dockerfile"
    return instructions


def copies() -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of each COPY/ADD from the build context, destinations made absolute."""
    result, workdir = [], "/"
    for keyword, arguments in dockerfile_instructions():
        if keyword == "WORKDIR":
            workdir = arguments if arguments.startswith("/") else f"{workdir.rstrip('/')}/{arguments}"
        if keyword in ("COPY", "ADD"):
            words = shlex.split(arguments)
            if any(w.startswith("--from") for w in words):
                continue  # from another stage, not the context
            *sources, destination = [w for w in words if not w.startswith("--")]
            if not destination.startswith("/"):
                destination = f"{workdir.rstrip('/')}/{destination.removeprefix('./')}"
            result.append((sources, destination))
    return result


def image_env() -> dict[str, str]:
    env = {}
    for keyword, arguments in dockerfile_instructions():
        if keyword == "ENV":
            for word in shlex.split(arguments):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def build_context(service: dict[str, Any]) -> tuple[Path, Path]:
    build = service["build"]
    if isinstance(build, str):
        build = {"context": build}
    context = (DEPLOY / build.get("context", ".")).resolve()
    return context, context / build.get("dockerfile", "Dockerfile")


# -- docker-compose.yml ----------------------------------------------------------------------------------


def test_compose_anchors_and_merge_keys_resolve_into_every_service(compose: dict[str, Any]) -> None:
    # safe_load fails on an undefined alias; what is left to check is that every merge was applied.
    leftovers = [path for path, node in walk(compose) if isinstance(node, dict) and "<<" in node]
    assert not leftovers, f"unresolved merge keys at {leftovers}"
    image, dagster_env = compose["x-cdc-image"], compose["x-dagster-env"]
    services = compose["services"]
    for name in ("code_location", "webserver", "daemon", "spark_connect", "spark_master", "spark_worker"):
        assert services[name]["build"] == image["build"] and services[name]["image"] == image["image"], name
    for name in DAGSTER_SERVICES:
        assert dagster_env.items() <= environment(services[name]).items(), name
    # The code location tells the run launcher which image to start runs in: the one built here.
    assert environment(services["code_location"])["DAGSTER_CURRENT_IMAGE"] == image["image"]


def test_compose_services_have_an_image_or_a_build_whose_context_and_dockerfile_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert "image" in service or "build" in service, f"service {name} has neither image nor build"
        if "build" in service:
            context, dockerfile = build_context(service)
            assert context.is_dir(), f"{name}: build context {context} does not exist"
            assert dockerfile.is_file(), f"{name}: Dockerfile {dockerfile} does not exist"
            assert dockerfile == DOCKERFILE and context == ROOT, name  # the checks below read these
        for dependency in service.get("depends_on") or []:
            assert dependency in compose["services"], f"{name} depends on unknown service {dependency}"
            condition = service["depends_on"][dependency] if isinstance(service["depends_on"], dict) else {}
            if (condition or {}).get("condition") == "service_healthy":
                assert "healthcheck" in compose["services"][dependency], f"{dependency} has no healthcheck"
        for network in service.get("networks") or []:
            assert network in (compose.get("networks") or {}), f"{name}: undeclared network {network}"


def test_compose_bind_mounts_named_volumes_and_env_files_exist(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    binds = []
    for name, service in compose["services"].items():
        for kind, source, target in volume_mounts(service):
            assert target.startswith("/"), f"{name}: mount target {target} is not absolute"
            if kind == "volume":
                assert source in declared, f"{name}: volume {source} is not declared under volumes:"
            elif source.startswith("/"):
                assert source in HOST_BINDS, f"{name}: binds host path {source}"
            else:
                host = (DEPLOY / source).resolve()
                assert host.exists(), f"{name}: bind-mounted {source} ({host}) does not exist"
                binds.append(host)
        env_files = service.get("env_file") or []
        for entry in [env_files] if isinstance(env_files, (str, dict)) else env_files:
            path = entry if isinstance(entry, str) else entry["path"]
            if Path(path).name == ".env":  # the operator's copy of .env.example
                assert (DEPLOY / path).with_name(".env.example").is_file(), f"{name}: {path} has no .env.example"
            elif not (isinstance(entry, dict) and entry.get("required") is False):
                assert (DEPLOY / path).is_file(), f"{name}: env_file {path} does not exist"
    assert DEPLOY / "dagster.yaml" in binds and DEPLOY / "workspace.yaml" in binds


def test_compose_interpolates_only_variables_that_env_example_documents(compose: dict[str, Any]) -> None:
    documented = env_file_keys(DEPLOY / ".env.example")
    used: dict[str, bool] = {}  # variable → has a default
    for match in _INTERPOLATION.finditer(COMPOSE_FILE.read_text()):
        name = match.group(1) or match.group(3)
        used[name] = used.get(name, False) or bool(match.group(2) and match.group(2).lstrip(":").startswith("-"))
    assert "CDC_SOURCE_DSN" in used and used["CDC_SOURCE_DSN"] is False
    assert set(used) <= set(documented), f"not in .env.example: {set(used) - set(documented)}"
    # The documented DSN is one the project's configuration accepts.
    environ = {DSN_VARIABLE: documented[DSN_VARIABLE], **pipeline_environ(compose, documented)}
    config = load_config(DEPLOY / "cdc.yaml", environ=environ)
    assert config.source.dsn == documented[DSN_VARIABLE]
    assert config.storage.secret_access_key == documented["MINIO_ROOT_PASSWORD"]


# -- Dockerfile ----------------------------------------------------------------------------------------


def test_dockerfile_copies_files_that_exist_and_matches_what_compose_expects_in_the_image(
    compose: dict[str, Any],
) -> None:
    copied: dict[str, str] = {}  # image path → context path
    for sources, destination in copies():
        for source in sources:
            matches = list(ROOT.glob(source))
            assert matches, f"COPY source {source} does not exist in the build context {ROOT}"
            target = (
                destination if len(sources) == 1 and not destination.endswith("/") else destination + Path(source).name
            )
            copied[target.rstrip("/")] = source
    assert {"pyproject.toml", "README.md", "cdc_assets", "dagster_project"} <= set(copied.values())

    env, workdir = image_env(), next(a for k, a in reversed(dockerfile_instructions()) if k == "WORKDIR")
    # The build step runs the copied installer; the pipeline's configuration is where CDC_CONFIG says.
    installer = next(a for k, a in dockerfile_instructions() if k == "RUN" and "install_delta_jars.py" in a)
    script = next(w for w in shlex.split(installer) if w.endswith("install_delta_jars.py"))
    assert copied[f"{workdir}/{script}"] == "deploy/install_delta_jars.py"
    assert copied[env["CDC_CONFIG"]] == "deploy/cdc.yaml"
    # What compose mounts and sets lands where the image looks for it.
    for name in DAGSTER_SERVICES:
        service = compose["services"][name]
        targets = {target: source for _, source, target in volume_mounts(service)}
        assert targets[f"{env['DAGSTER_HOME']}/dagster.yaml"] == "./dagster.yaml", name
        assert environment(service)["CDC_CONFIG"] == env["CDC_CONFIG"], name

    # The image pins one Dagster release inside pyproject.toml's range, and Dagster's libraries to
    # its release line (1.X.Y ↔ 0.(X+16).Y).
    pins = dict(
        re.findall(r"(dagster[a-z0-9-]*)==([\w.]+)", " ".join(a for k, a in dockerfile_instructions() if k == "RUN"))
    )
    assert {"dagster", "dagster-postgres", "dagster-docker"} <= set(pins), pins
    dagster = pins.pop("dagster")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [supported] = [r for r in map(Requirement, project["dependencies"]) if r.name == "dagster"]
    assert supported.specifier.contains(dagster), (dagster, str(supported))
    _, minor, patch = dagster.split(".")
    line = f"0.{int(minor) + 16}.{patch}"
    for name, version in pins.items():
        assert version == line, (name, version, line)


# -- dagster.yaml ----------------------------------------------------------------------------------------


def test_instance_file_passes_dagsters_validation_down_to_each_configured_class(
    instance_env: dict[str, str], compose: dict[str, Any]
) -> None:
    # (What the pools and run monitoring settings do is tested in test_dagster.py.)
    settings, custom_class = dagster_instance_config(str(DEPLOY))
    assert custom_class is None and settings["telemetry"] == {"enabled": False}
    assert settings["nux"] == {"enabled": False}  # the UI's first screen is the pipeline, no pop-up over it

    # The storage, run launcher and run coordinator classes exist and accept their config (Dagster
    # only checks these sections' shape; the classes check the rest when the instance starts).
    ref = InstanceRef.from_dir(str(DEPLOY))
    configured = {
        "storage": ref.storage_data,
        "run_launcher": ref.run_launcher_data,
        "run_coordinator": ref.run_coordinator_data,
    }
    classes: dict[str, tuple[str, dict[str, Any]]] = {}
    for section, data in configured.items():
        assert data is not None, section
        klass = getattr(importlib.import_module(data.module_name), data.class_name)
        result = process_config(resolve_to_config_type(klass.config_type()), yaml.safe_load(data.config_yaml) or {})
        assert result.success, (section, [e.message for e in result.errors or []])
        classes[section] = (data.class_name, dict(result.value or {}))
    assert classes["storage"][0] == "DagsterPostgresStorage"
    assert classes["run_coordinator"][0] == "QueuedRunCoordinator"
    launcher_name, launcher = classes["run_launcher"]
    assert launcher_name == "DockerRunLauncher"
    postgres = classes["storage"][1]["postgres_db"]
    assert (postgres["username"], postgres["password"], postgres["db_name"]) == (
        instance_env["DAGSTER_PG_USER"], instance_env["DAGSTER_PG_PASSWORD"], instance_env["DAGSTER_PG_DB"]
    )  # fmt: skip

    # ... and agree with the compose file: the storage host is its database service, run containers
    # join its network and mount its data volume, and get every variable the runs need.
    services = compose["services"]
    assert postgres["hostname"] in services and "postgres" in services[postgres["hostname"]]["image"]
    assert launcher["network"] == compose["networks"]["default"]["name"]
    volume, _, target = launcher["container_kwargs"]["volumes"][0].partition(":")
    assert volume in {f"{compose['name']}_{v}" for v in compose["volumes"]}, volume
    assert (volume.removeprefix(f"{compose['name']}_"), target) in {
        (source, t) for _, source, t in volume_mounts(services["code_location"])
    }
    for name in ("daemon", "webserver"):
        assert set(launcher["env_vars"]) <= set(environment(services[name])), name
    assert {DSN_VARIABLE, "CDC_CONFIG", *INSTANCE_ENV} <= set(launcher["env_vars"])


def test_instance_validation_rejects_a_broken_copy(tmp_path: Path, instance_env: dict[str, str]) -> None:
    # The validation above is not vacuous: an unknown key in a section Dagster checks is an error.
    broken = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    broken["run_monitoring"]["free_slots_after_run_end"] = broken["run_monitoring"].pop(
        "free_slots_after_run_end_seconds"
    )
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(DagsterInvalidConfigError, match="free_slots_after_run_end"):
        dagster_instance_config(str(tmp_path))


# -- workspace.yaml ---------------------------------------------------------------------------------------


def test_workspace_file_loads_as_a_dagster_workspace_pointing_at_the_code_location_service(
    compose: dict[str, Any],
) -> None:
    path = DEPLOY / "workspace.yaml"
    ensure_workspace_config(yaml.safe_load(path.read_text()), str(path))
    origins = location_origins_from_yaml_paths([str(path)])
    assert len(origins) == 1
    origin = origins[0]
    assert isinstance(origin, GrpcServerCodeLocationOrigin)
    assert origin.location_name == "cdc_assets"
    # The host is the code location service, which serves the project's module on that port.
    code_location = compose["services"][origin.host]
    command = shlex.split(code_location["command"])
    assert command[:3] == ["dagster", "code-server", "start"]
    assert command[command.index("-p") + 1] == str(origin.port)
    assert command[command.index("-m") + 1] == "dagster_project.definitions"
    assert str(origin.port) in code_location["healthcheck"]["test"]
    for name in ("webserver", "daemon"):
        service = compose["services"][name]
        mounted = {t for _, s, t in volume_mounts(service) if s == "./workspace.yaml"}
        assert mounted, name
        assert shlex.split(service["command"])[-1] in mounted, name  # -w points at the mounted file


# -- cdc.yaml --------------------------------------------------------------------------------------------


def test_pipeline_config_loads_and_builds_the_code_location(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, s3_server: ThrowawayS3Server, tmp_path: Path
) -> None:
    dsn = "host=db.example.com dbname=shop user=cdc password=pw"
    keys = pipeline_environ(compose, env_file_keys(DEPLOY / ".env.example"))
    config = load_config(DEPLOY / "cdc.yaml", environ={DSN_VARIABLE: dsn, **keys})
    assert config.source.dsn == dsn
    assert [str(t.name) for t in config.tables] == ["public.orders"]

    # Spark: every run a session of the Spark Connect service, by the alias the other containers
    # resolve, on its port; that server runs on the master service, which the worker joins.
    services = compose["services"]
    remote = re.fullmatch(r"sc://([\w.-]+):(\d+)", config.spark.remote or "")
    assert remote is not None and config.spark.master is None, config.spark
    server = shlex.split(services["spark_connect"]["command"])
    assert server[:2] == ["cdc-assets", "spark-server"] and server[server.index("--port") + 1] == remote.group(2)
    assert remote.group(1) in services["spark_connect"]["networks"]["default"]["aliases"]
    assert environment(services["spark_connect"])["CDC_CONFIG"] == "/opt/dagster/cdc.yaml"  # reads this file
    master = re.fullmatch(r"spark://([\w.-]+):(\d+)", server[server.index("--master") + 1])
    assert master is not None, server
    command = shlex.split(services["spark_master"]["command"])
    assert command[command.index("--port") + 1] == master.group(2)
    assert master.group(1) in services["spark_master"]["networks"]["default"]["aliases"]
    assert master.group(0) in services["spark_worker"]["command"]
    assert services["daemon"]["depends_on"]["spark_connect"]["condition"] == "service_healthy"

    # Every mirror by name in the server's catalog, kept in the metastore_postgres service's database
    # (by its alias: a JDBC host name), which the server waits for.
    assert config.warehouse.catalog == "spark_catalog" and config.spark.metastore_dsn is not None
    metastore = services["metastore_postgres"]
    assert jdbc_url(config.spark.metastore_dsn).startswith(
        f"jdbc:postgresql://{metastore['networks']['default']['aliases'][0]}:5432/{environment(metastore)['POSTGRES_DB']}"
    )
    assert "password=" + env_file_keys(DEPLOY / ".env.example")["METASTORE_PG_PASSWORD"] in config.spark.metastore_dsn
    assert services["spark_connect"]["depends_on"]["metastore_postgres"]["condition"] == "service_healthy"

    # The change log and the warehouse are in the bucket the minio_bucket service creates on the
    # minio service, which the code location waits for; Spark reaches it through s3a.
    bucket = shlex.split(services["minio_bucket"]["command"][0])[-1].removeprefix("lake/")
    for path in (config.changelog.path, config.warehouse.path, *(config.target_path(t) for t in config.tables)):
        assert path.startswith(f"s3://{bucket}/"), path
    assert config.storage.endpoint == "http://minio:9000" and "minio" in services
    assert services["code_location"]["depends_on"]["minio_bucket"]["condition"] == "service_completed_successfully"
    assert config.spark.storage == config.storage
    instance = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    for name in ("code_location", "daemon", "webserver"):
        assert set(keys) <= set(environment(services[name])), name
    assert set(keys) <= set(instance["run_launcher"]["config"]["env_vars"])
    for variable, value in keys.items():
        monkeypatch.setenv(variable, value)

    # The code location's own loader (the DSN stays an environment reference) and its definitions,
    # which read the change log's checkpoint: from the test's S3 server in place of the minio service.
    monkeypatch.delenv(DSN_VARIABLE, raising=False)
    s3_server.create_bucket(bucket)
    local = tmp_path / "cdc.yaml"
    local.write_text((DEPLOY / "cdc.yaml").read_text().replace(config.storage.endpoint, s3_server.endpoint))
    settings = load_settings(str(local))
    assert settings.dsn_env == DSN_VARIABLE
    defs = build_definitions(settings)
    dg.Definitions.validate_loadable(defs)
    keys = {"/".join(spec.key.path) for spec in defs.resolve_all_asset_specs()}
    assert keys == {
        "cdc/changelog",
        "cdc/snapshot",
        "cdc/rebuild",
        "cdc/verify",
        "cdc/consistent_point",
        "delta/public/orders",
        "maintenance/public/orders",
        "history/public/orders",
    }
    assert defs.resolve_schedule_def("cdc_drain_schedule").cron_schedule == config.schedule.drain_cron
    assert {s.name for s in defs.sensors or []} == {"cdc_merges__public__orders", "cdc_consistent_point"}
    [orders] = [spec for spec in defs.resolve_all_asset_specs() if spec.key.path == ["delta", "public", "orders"]]
    assert orders.metadata["dagster/table_name"] == "spark_catalog.public.orders"  # the UI shows the name
