"""The ``storage`` section (``cdc_assets/storage.py``): parsing and refusals, credentials never shown,
and the change log's store and delta-rs reaching the same bucket on a real S3 API server."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from cdc_assets.apply.session import hadoop_version, session_settings
from cdc_assets.apply.table_files import table_files
from cdc_assets.apply.target import applied_lsn
from cdc_assets.changelog.checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.config import parse_config
from cdc_assets.errors import ConfigError, StorageError
from cdc_assets.storage import StorageConfig
from cdc_sandbox.pgcluster import free_port
from tests.support.bucket import Bucket
from tests.support.config_file import write_config

BASE = """
source: {dsn: "host=h user=u password=dsn-secret"}
changelog: {path: s3://lake/changelog}
warehouse: {path: s3://lake/warehouse}
tables: {public.t: {}}
"""
KEY_ID, SECRET = "AKIA-do-not-show", "s3cr3t-do-not-show"
CHECKPOINT = Checkpoint("cdc_slot", 0x20)


def _parse(storage: str, environ: dict[str, str] | None = None) -> object:
    return parse_config(BASE + storage, origin=Path("/etc/cdc/cdc.yaml"), environ=environ or {})


def test_storage_section_configures_every_client_and_hides_its_credentials() -> None:
    config = _parse(
        "storage:\n  endpoint: http://minio:9000/\n  region: eu-west-1\n"
        "  access_key_id: ${KEY}\n  secret_access_key: ${SECRET}\n  session_token: ${TOKEN:-}\n",
        {"KEY": KEY_ID, "SECRET": SECRET},
    )
    storage = config.storage  # type: ignore[attr-defined]
    assert storage == StorageConfig("http://minio:9000", "eu-west-1", None, KEY_ID, SECRET, None)
    assert storage.uses_path_style  # an endpoint of its own: path-style unless told otherwise
    assert KEY_ID not in repr(config) and SECRET not in repr(config)
    assert config.delta_storage_options == {  # type: ignore[attr-defined]
        "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_ALLOW_HTTP": "true",
        "AWS_REGION": "eu-west-1",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    assert _parse("").storage == StorageConfig()  # type: ignore[attr-defined]
    chain = _parse("storage: {region: us-east-2}\n").storage  # type: ignore[attr-defined]
    assert not chain.uses_path_style and "AWS_ACCESS_KEY_ID" not in chain.delta_rs_options()


def test_spark_gets_s3a_settings_and_jars_for_a_warehouse_on_s3(tmp_path: Path) -> None:
    """With the warehouse on S3, the classic session starts with Hadoop's s3a settings from the same
    section (``s3://`` read by s3a too) and the hadoop-aws jar of pyspark's own Hadoop; its
    credentials stay out of the configuration's ``repr``. A local warehouse gets neither."""
    config = _parse(
        "storage:\n  endpoint: http://minio:9000\n  access_key_id: ${KEY}\n  secret_access_key: ${SECRET}\n",
        {"KEY": KEY_ID, "SECRET": SECRET},
    )
    spark = config.spark  # type: ignore[attr-defined]
    assert spark.storage == config.storage  # type: ignore[attr-defined]
    assert KEY_ID not in repr(spark) and SECRET not in repr(spark)
    settings = session_settings(replace(spark, conf={"spark.jars.ivy": str(tmp_path)}))  # nothing resolved yet
    assert {k: v for k, v in settings.items() if k.startswith("spark.hadoop.")} == {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.endpoint": "http://minio:9000",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false",
        "spark.hadoop.fs.s3a.endpoint.region": "us-east-1",
        "spark.hadoop.fs.s3a.access.key": KEY_ID,
        "spark.hadoop.fs.s3a.secret.key": SECRET,
        "spark.hadoop.fs.s3a.aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
    }
    assert f"org.apache.hadoop:hadoop-aws:{hadoop_version()}" in settings["spark.jars.packages"].split(",")
    assert hadoop_version().startswith("3.")
    chosen = replace(spark, conf={"spark.jars.packages": "my:jars:1"})  # the user's packages replace ours
    assert session_settings(chosen)["spark.jars.packages"] == "my:jars:1"
    token = StorageConfig(region="eu-west-1", access_key_id="k", secret_access_key="s", session_token="t")
    assert token.hadoop_settings()["fs.s3a.aws.credentials.provider"].endswith("TemporaryAWSCredentialsProvider")
    assert "fs.s3a.endpoint" not in StorageConfig(region="eu-west-1").hadoop_settings()  # AWS itself
    assert "fs.s3a.access.key" not in StorageConfig().hadoop_settings()  # the default credential chain
    local = parse_config(BASE.replace("s3://lake/warehouse", "/data/warehouse"), origin=Path("/c.yaml"), environ={})
    assert local.spark.storage is None
    assert not any(k.startswith("spark.hadoop.") for k in session_settings(local.spark))
    local_jars = session_settings(local.spark)
    assert "hadoop-aws" not in local_jars.get("spark.jars.packages", "") + local_jars.get("spark.jars", "")
    one_target = parse_config(
        BASE.replace("s3://lake/warehouse", "/w").replace("{public.t: {}}", "{public.t: {target: s3://lake/t}}"),
        origin=Path("/c.yaml"),
        environ={},
    )
    assert one_target.spark.storage == StorageConfig()  # one table on S3 is enough


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ("storage: {access_key_id: AKIA-do-not-show}\n", "storage.secret_access_key: set both"),
        ("storage: {secret_access_key: s3cr3t-do-not-show}\n", "storage.access_key_id: set both"),
        ("storage: {endpoint: 'minio:9000'}\n", "storage.endpoint: expected http(s)://host[:port], got 'minio:9000'"),
        ("storage: {path_style: 'yes'}\n", "storage.path_style: expected true or false"),
        ("storage: {secret_access_key: [s3cr3t-do-not-show], access_key_id: x}\n", "expected a string, got a value"),
        ("storage: {bucket: lake}\n", "storage.bucket: unknown setting"),
    ],
)
def test_a_bad_storage_section_is_refused_without_showing_a_secret(storage: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _parse(storage)
    assert message in str(refused.value) and str(refused.value).startswith("/etc/cdc/cdc.yaml: ")
    assert "do-not-show" not in str(refused.value)


def test_the_change_log_store_and_delta_rs_reach_the_bucket(bucket: Bucket, tmp_path: Path) -> None:
    """Through the ``storage`` settings: the change log's files (written, replaced as one PUT,
    listed, read, deleted) and a Delta table read by delta-rs as ``s3://`` and ``s3a://``."""
    text = (
        f"source: {{dsn: x}}\nchangelog: {{path: '{bucket.uri}/changelog/'}}\n"
        f"warehouse: {{path: '{bucket.uri}/warehouse'}}\ntables: {{public.t: {{}}}}\n"
        f"storage:\n  endpoint: {bucket.storage.endpoint}\n  region: {bucket.storage.region}\n"
        "  access_key_id: ${KEY}\n  secret_access_key: ${SECRET}\n"
    )
    environ = {"KEY": bucket.storage.access_key_id or "", "SECRET": bucket.storage.secret_access_key or ""}
    config = parse_config(text, origin=tmp_path / "cdc.yaml", environ=environ)
    store = changelog_store(config)
    assert not store.local and store.root == f"{bucket.uri}/changelog"
    write_checkpoint(store, Checkpoint("cdc_slot", 0x10))
    write_checkpoint(store, Checkpoint("cdc_slot", 0x20))
    checkpoint = read_checkpoint(store)
    assert checkpoint is not None and checkpoint.lsn == 0x20
    with store.create("tables/public.t/0000000000000010-0000.parquet") as stream:
        stream.write(b"segment")
    assert store.list("") == ["_checkpoint.json"] and store.folders("tables") == ["tables/public.t"]
    assert store.sub("tables/public.t").read_bytes("0000000000000010-0000.parquet") == b"segment"
    store.delete_folder("tables/public.t")
    assert store.folders("tables") == [] and store.read_bytes("missing") is None

    target = config.target_path(config.tables[0])
    assert target == f"{bucket.uri}/warehouse/public/t"
    writable = config.delta_storage_options | {"AWS_S3_ALLOW_UNSAFE_RENAME": "true"}  # one writer, the test
    write_deltalake(target, pa.table({"id": [1, 2, 3]}), storage_options=writable)
    assert table_files(target, config.delta_storage_options).files == 1
    assert table_files(target.replace("s3://", "s3a://"), config.delta_storage_options).files == 1
    assert applied_lsn(target, "cdc_assets:cdc_slot:public.t", config.delta_storage_options) is None


def test_an_unreachable_bucket_is_a_clear_error_that_shows_no_credential(bucket: Bucket, tmp_path: Path) -> None:
    """A Delta table in a bucket that does not exist, and a change log the server refuses: the
    command line says what and where (the location, the server's error code) in one line, no
    traceback, and neither key appears in it."""
    config = write_config(
        tmp_path,
        ["public.t"],
        source={"dsn": "${DSN}"},
        changelog={"path": f"{bucket.uri}/changelog"},
        warehouse={"path": "s3://no-such-bucket/warehouse"},
        storage=bucket.section(),
    )
    environ = {**os.environ, **bucket.environ(), "DSN": "host=127.0.0.1 port=1 dbname=none"}
    write_checkpoint(changelog_store(parse_config(config.read_text(), origin=config, environ=environ)), CHECKPOINT)
    done = subprocess.run(
        [sys.executable, "-m", "cdc_assets", "status", "-c", str(config)],
        capture_output=True, text=True, env=environ, timeout=120, check=False,
    )  # fmt: skip
    shown = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in shown, shown
    assert "cdc-assets: cannot read the Delta table at s3://no-such-bucket/warehouse/public/t" in shown, shown
    assert "NoSuchBucket" in shown, shown
    for secret in bucket.storage.secrets:
        assert secret not in shown

    nobody = replace(bucket.storage, endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    refused = LogStore(f"{bucket.uri}/changelog", nobody)
    with pytest.raises(StorageError, match=f"cannot read the change log at {bucket.uri}/changelog") as error:
        refused.read_bytes("_checkpoint.json")
    assert not any(secret in str(error.value) for secret in bucket.storage.secrets)


def test_a_change_log_in_a_missing_bucket_is_named_as_such_not_as_a_log_never_set_up(
    bucket: Bucket, tmp_path: Path
) -> None:
    """``cdc-assets apply`` with ``changelog.path`` in a bucket that does not exist says so (not
    "run setup"), before starting Spark; an existing bucket without a checkpoint is "run setup"."""
    sections = {
        "source": {"dsn": "${DSN}"},
        "warehouse": {"path": f"{bucket.uri}/warehouse"},
        "storage": bucket.section(),
    }
    config = write_config(tmp_path, ["public.t"], changelog={"path": "s3://no-such-bucket/changelog"}, **sections)
    environ = {**os.environ, **bucket.environ(), "DSN": "host=127.0.0.1 port=1 dbname=none"}

    def apply() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "cdc_assets", "apply", "-c", str(config)],
            capture_output=True, text=True, env=environ, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "starting Spark" not in done.stderr, done.stderr  # refused before any Spark start
        return done.stderr.strip()

    assert apply() == (
        "cdc-assets: the change log at s3://no-such-bucket/changelog: bucket no-such-bucket does not exist"
        " (check changelog.path)"
    )
    write_config(tmp_path, ["public.t"], changelog={"path": f"{bucket.uri}/changelog"}, **sections)
    assert apply().endswith("has no checkpoint: run `cdc-assets setup` first")
