"""Credentials never leave memory (security review 2026-11c, F1 and F11): a real run given
canary secrets writes none of them anywhere, and the redaction itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import TINY_FLAGS, tiny_dataset  # noqa: F401 - the fixture
from imgtrainer import redact
from imgtrainer.config import TrainConfig, parse_config
from imgtrainer.storage.remote import parse_options
from support.harness import launcher_command

CANARIES = {"key": "CANARYKEY4815162342", "secret": "CANARYSECRET-s3cr3t/+=", "token": "CANARYTOK"}


def test_options_and_urls_are_redacted_wherever_a_value_is_written():
    options = {
        "key": "AKIA123",
        "client_kwargs": {"aws_secret_access_key": "nested"},
        "anon": False,
    }
    text = json.dumps(options | {"endpoint_url": "http://u:pw@h:9", "account_key": "adls"})
    written = json.loads(redact.options_text(text))
    assert written["key"] == written["account_key"] == redact.MARK
    assert written["client_kwargs"]["aws_secret_access_key"] == redact.MARK
    assert written["anon"] is False and written["endpoint_url"] == f"http://{redact.MARK}@h:9"
    assert redact.text("at https://me:pw@example.com/x and s3://b/k") == (
        f"at https://{redact.MARK}@example.com/x and s3://b/k"
    )
    cfg = TrainConfig(storage_options=text, checkpoint_dir="s3://ak:sk@bucket/run")
    assert "AKIA123" not in json.dumps(cfg.to_dict()) and "sk@" not in json.dumps(cfg.to_dict())
    assert cfg.storage_options == text  # the client's own copy stays whole
    # Read back from a run file the run wrote: the marks are left out (the environment's
    # credentials, or the flag given again, take their place).
    assert parse_options(json.dumps(written)) == {
        "client_kwargs": {},
        "anon": False,
        "endpoint_url": f"http://{redact.MARK}@h:9",
    }


def test_storage_options_are_checked_even_without_a_url_and_remembered():
    """F15: --storage_options that are not a JSON object were accepted while no URL used them."""
    from imgtrainer.errors import UserError

    for bad in ("not json", "[1]"):
        with pytest.raises(UserError, match="--storage_options"):
            parse_config(["--storage_options", bad])
    parse_config(["--storage_options", json.dumps({"secret": "REMEMBERED-1234"})])
    assert redact.text("the value REMEMBERED-1234 here") == f"the value {redact.MARK} here"


def every_byte(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()]


@pytest.mark.slow
def test_a_real_run_writes_no_canary_secret_anywhere(tiny_dataset, tmp_path):  # noqa: F811
    """One launcher run with canary credentials in --storage_options (used: moto takes any key
    pair), checkpoints in a moto bucket, TensorBoard, W&B and MLflow offline: no byte of any file
    it leaves (logs, checkpoints, trackers' stores, per-user caches), of its console, or of any
    object in the bucket holds a canary; the redacted mark stands where they were."""
    pytest.importorskip("s3fs", reason="pip install -r requirements-remote.txt")
    pytest.importorskip("moto.server", reason="pip install -r requirements-dev.txt")
    from support.s3_server import S3Server
    from test_trackers import MISSING, offline_env

    if MISSING:
        pytest.skip(f"not installed: {MISSING}")
    server = S3Server.start()
    try:
        url = server.make_bucket("canary") + "/run"
        train, val = tiny_dataset
        home, work = tmp_path / "home", tmp_path / "work"
        work.mkdir()
        env = offline_env(home) | {"AWS_ENDPOINT_URL": server.endpoint}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.pop(name, None)  # the canary pair is the one the store gets
        options = json.dumps({"key": CANARIES["key"], "secret": CANARIES["secret"]})
        flags = ["--device", "cpu", "--nproc", "1", "--train_dir", train, "--val_dir", val]
        flags += [*TINY_FLAGS, "--epochs", "1", "--checkpoint_dir", url, "--storage_options"]
        flags += [options, "--log_to", "wandb,mlflow"]
        result = subprocess.run(
            launcher_command(*flags), cwd=work, env=env, capture_output=True, timeout=300
        )
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        keys = server.keys(url)
        assert "run/checkpoint_latest.pth" in keys  # the canary pair reached the store
        client = server.client()
        objects = [client.get_object(Bucket="canary", Key=k)["Body"].read() for k in keys]
    finally:
        server.stop()
    written = every_byte(tmp_path) + [(Path("console"), result.stdout + result.stderr)]
    written += [(Path(f"s3://canary/{k}"), data) for k, data in zip(keys, objects, strict=True)]
    found = [
        (str(path), name)
        for path, data in written
        for name, canary in CANARIES.items()
        if canary.encode() in data
    ]
    assert found == []
    config = (work / "logs" / "config.yaml").read_text()
    assert f'"key": "{redact.MARK}"' in config and f'"secret": "{redact.MARK}"' in config
    history = json.loads((work / "logs" / "training_history.json").read_text())
    assert redact.MARK in json.dumps(history["command"])
    assert len(written) > 20 and any(str(p).endswith(".wandb") for p, _ in written)
