"""Every reader of outside input fed generated input (hypothesis, a fixed seed): the outcome is a
result or one user-facing error (``UserError``, or the ``ValueError`` a reader documents),
never another exception.

The quick suite runs ``QUICK`` examples per reader; ``HYPOTHESIS_PROFILE=large python -m pytest
tests/test_fuzz.py`` runs ``LARGE``. Both are derandomized: a failure is the same on every run.
"""

from __future__ import annotations

import io
import json
import os
import string
import tarfile
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install -r requirements-dev.txt")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from imgtrainer.checkpoints.files import CheckpointError  # noqa: E402
from imgtrainer.errors import UserError  # noqa: E402

QUICK, LARGE = 40, 1000
EXAMPLES = LARGE if os.environ.get("HYPOTHESIS_PROFILE") == "large" else QUICK
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# JSON values, and text with the characters that break formats: separators, newlines, quotes,
# TeX and formula marks, surrogate escapes of bytes that are not UTF-8.
ODD = "\t\n\r,;\"'$\\={}[]/.#% \x00\udce9é"
names = st.text(alphabet=st.sampled_from(string.ascii_letters + string.digits + ODD), max_size=12)
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | names
utf8_names = names.map(lambda text: text.replace("\udce9", "?"))  # Parquet's strings are UTF-8
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4)
)


def temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="fuzz-"))


# ----------------------------------------------------------------------------- histories

RECORD_KEYS = ["epoch", "train_loss", "train_acc", "lr", "val_loss", "val_acc", "val_top5"]
numbers = st.integers(-3, 5) | st.floats(allow_nan=True)
records = st.dictionaries(st.sampled_from(RECORD_KEYS), numbers | json_values, max_size=7)
HEAD_KEYS = ["best", "config", "class_names", "events", "world_size", "command", "environment"]
histories = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"epochs": st.lists(records, max_size=4)},
        optional={key: json_values for key in HEAD_KEYS},
    ),
)


@FUZZ
@given(histories)
def test_any_history_gives_a_page_or_one_line(history):
    from imgtrainer.reports.page.curves import load_history
    from imgtrainer.reports.page.run_report import build_run_report

    logs = temp_dir()
    path = logs / "training_history.json"
    path.write_text(json.dumps(history))
    assert "<html" in build_run_report(logs)
    try:
        load_history(path)
    except UserError:
        pass


@FUZZ
@given(st.dictionaries(names, json_values | numbers, max_size=6), json_values)
def test_any_checkpoint_history_gives_curves_or_none(fields, history):
    from imgtrainer.tools.inference import checkpoint_history

    state = {**fields, "history": history}
    result = checkpoint_history(state)
    assert result is None or isinstance(result["epochs"], list)


# ----------------------------------------------------------------------------- run files


FLAG_NAMES = ["epochs", "batch_size", "model", "learning_rate", "storage_options", "max_time",
              "num_gpus", "train_data", "hang_timeout", "class_names", "log_to", "resume"]  # fmt: skip
run_files = st.one_of(
    st.text(max_size=60),
    st.dictionaries(st.sampled_from(FLAG_NAMES) | names, json_values, max_size=4).map(
        lambda data: json.dumps(data)  # JSON is YAML
    ),
)


@FUZZ
@given(run_files)
def test_any_run_file_gives_a_config_or_one_line(text):
    from imgtrainer.config import parse_config

    path = temp_dir() / "run.yaml"
    path.write_text(text, errors="surrogateescape")
    try:
        parse_config(["--config", str(path)])
    except UserError:
        pass


@FUZZ
@given(json_values.map(json.dumps) | names)
def test_any_storage_options_give_a_config_or_one_line(text):
    from imgtrainer.config import parse_config

    try:
        parse_config([f"--storage_options={text}"])
    except UserError:
        pass


# ----------------------------------------------------------------------------- lists, names


@FUZZ
@given(st.lists(st.lists(names, max_size=4), max_size=5), st.sampled_from([".csv", ".tsv"]))
def test_any_list_file_gives_a_table_or_one_line(rows, suffix):
    from imgtrainer.data.layouts.files import list_table

    sep = "\t" if suffix == ".tsv" else ","
    path = temp_dir() / f"list{suffix}"
    path.write_bytes("\n".join(sep.join(row) for row in rows).encode(errors="surrogateescape"))
    try:
        table = list_table(str(path), None)
        [table.location(i) for i in range(len(table))]
    except UserError:
        pass


@FUZZ
@given(st.text(max_size=80))
def test_any_class_names_file_gives_names_or_one_line(text):
    from imgtrainer.data.layouts.names import read_class_names

    path = temp_dir() / "classes.txt"
    path.write_bytes(text.encode(errors="surrogateescape"))
    try:
        assert read_class_names(path)
    except UserError:
        pass


@FUZZ
@given(st.lists(names.filter(lambda n: n.strip(". ") and "/" not in n and "\x00" not in n),
                min_size=1, max_size=4, unique=True))  # fmt: skip
def test_any_folder_and_file_names_give_a_table_or_one_line(folders):
    from imgtrainer.data.layouts.files import folder_table

    root = temp_dir()
    for n, name in enumerate(folders):
        try:
            (root / name).mkdir()
            (root / name / f"{name}{n}.png").write_bytes(b"not decoded here")
        except (OSError, UnicodeEncodeError):
            continue  # a name this file system refuses
    try:
        table = folder_table(root, "training", None)
        [(table.location(i), table.label(i)) for i in range(len(table))]
    except UserError:
        pass


# ----------------------------------------------------------------------------- tar shards


@FUZZ
@given(st.lists(st.tuples(names, st.binary(max_size=40)), max_size=4), st.binary(max_size=300))
def test_any_tar_or_bytes_gives_rows_or_one_line(members, tail):
    from imgtrainer.data.layouts.shards import scan_shard

    path = temp_dir() / "s.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name or "x")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    path.write_bytes(raw[: len(raw) // 2] + tail if tail else raw)
    try:
        scan_shard(str(path))
    except UserError:
        pass


@FUZZ
@given(st.lists(st.lists(names | st.integers().map(str), max_size=5), max_size=4))
def test_any_shard_index_is_read_or_built_again(lines):
    import imgtrainer.data.layouts.shards as shards
    from imgtrainer.storage import LOCAL

    place = temp_dir() / f"s.tar{shards.INDEX_SUFFIX}"
    text = "stamp\n" + "\n".join("\t".join(line) for line in lines)
    place.write_bytes(text.encode(errors="surrogateescape"))
    rows = shards._read_index(str(place), "stamp", LOCAL)
    assert rows is None or all(len(row) == 4 for row in rows)


# ----------------------------------------------------------------------------- checkpoints

CHECKPOINT_KEYS = ["epoch", "step", "epoch_position", "class_names", "config", "best_metric",
                   "best_epoch", "best_weights", "world_size", "effective_batch_size", "layout",
                   "image_size", "model_name", "history", "model_ema_state_dict", "mean", "std",
                   "schema_version", "rank_states", "micro_batch"]  # fmt: skip
checkpoints = st.dictionaries(st.sampled_from(CHECKPOINT_KEYS), json_values | numbers, max_size=8)


@FUZZ
@given(checkpoints)
def test_any_checkpoint_dict_resumes_or_gives_one_line(fields):
    from imgtrainer.checkpoints.files import check_checkpoint_shape
    from imgtrainer.checkpoints.resume import (
        check_best_metric,
        check_resume_fits,
        check_resume_settings,
        requested_global_batch,
    )
    from imgtrainer.config import TrainConfig

    state = {"model_state_dict": {}, "optimizer_state_dict": {}, "epoch": 0, **fields}
    config = TrainConfig().to_dict()
    path = Path("fuzz.pth")
    try:
        check_checkpoint_shape(state, path)
        check_resume_fits(state, path, ["a", "b"], "resnet18", "adamw")
        check_resume_settings(state, path, config, 2, override=False)
        requested_global_batch(state, config, 2)
        check_best_metric(state, path, "val_acc", override=True)
    except CheckpointError:
        pass


@FUZZ
@given(checkpoints, st.sampled_from(["auto", "raw", "ema"]))
def test_any_checkpoint_dict_loads_for_inference_or_gives_one_line(fields, weights):
    from imgtrainer.checkpoints.files import check_checkpoint_shape
    from imgtrainer.tools.inference import check_inference_checkpoint, choose_weights

    state = {"model_state_dict": {}, **fields}
    path = Path("fuzz.pth")
    try:
        check_checkpoint_shape(state, path)
        check_inference_checkpoint(state, path)
        choose_weights(state, path, weights)
    except CheckpointError:
        pass


# ----------------------------------------------------------------------------- Parquet


@FUZZ
@given(
    st.lists(st.sampled_from(["image", "label", "path", "labels", "img", "x"]), max_size=3,
             unique=True),
    st.lists(st.one_of(st.binary(max_size=8), utf8_names, st.integers(-2, 3), st.none()),
             max_size=3),
)  # fmt: skip
def test_any_parquet_schema_and_rows_give_a_table_or_one_line(columns, values):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from imgtrainer.data.layouts.parquet import parquet_table

    path = temp_dir() / "d.parquet"
    table = {}
    for n, column in enumerate(columns):
        cells = [v for v in values if type(v) is type(values[0])] if values else []
        table[column] = pa.array(cells if n else [c for c in cells][: len(cells)])
    try:
        pq.write_table(pa.table(table) if table else pa.table({"x": pa.array([])}), path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
        return
    try:
        rows = parquet_table(str(path), None, None)
        [rows.location(i) for i in range(len(rows))]
    except UserError:
        pass
