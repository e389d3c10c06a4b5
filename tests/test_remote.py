"""Data and checkpoints in object storage, against a real S3 server on 127.0.0.1 (moto's server
mode) through the real clients (s3fs, boto3); the Hub's other Parquet shapes (written by
``datasets``) and shards written by ``webdataset``'s ShardWriter.

The slow tests share their runs: one run on the disk is the reference; one run from the bucket
(checkpoints there too) must match it to the bit; one 2-process run from the bucket, whose
second checkpoint upload hangs half-way when it is killed, is resumed at 1 process on an empty
disk from what the bucket holds."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

import imgtrainer.run.launcher as launch_ddp
from conftest import (
    CLASSES,
    ONE_CPU_PROCESS,
    TINY_FLAGS,
    data_config,
    entries_of,
    pack_folder,
    run_train,
    start_launcher,
    user_error_line,
    write_image_folder,
)
from imgtrainer import redact
from imgtrainer.checkpoints.remote import DOWNLOADED, fetch_latest
from imgtrainer.config import parse_config
from imgtrainer.data.host.read_ahead import ReadAhead
from imgtrainer.data.host.samplers import WindowSampler
from imgtrainer.data.layouts import open_datasets
from imgtrainer.data.layouts.names import Reading
from imgtrainer.data.layouts.shards import SHARD_IMAGE_EXTENSIONS
from imgtrainer.data.loaders import build_datasets
from imgtrainer.errors import UserError
from imgtrainer.run.preflight import launcher_checks
from imgtrainer.storage import Store
from imgtrainer.storage import remote as storage_remote
from imgtrainer.storage.remote import is_transient, retried
from support.harness import descendants
from support.s3_server import S3Server, proxied

BUCKETS = count()


def need(module: str):
    """An optional package the test needs (requirements-dev.txt installs each): skipped, with
    the reason, where it is missing."""
    extra = "requirements-remote.txt" if module in ("s3fs", "fsspec") else "requirements-dev.txt"
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install -r {extra}")


@pytest.fixture(scope="module")
def s3_server():
    need("s3fs")
    need("moto.server")
    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch) -> S3Server:
    """The server, its endpoint and keys in this process's environment."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


def new_bucket(s3: S3Server) -> str:
    return s3.make_bucket(f"bucket-{os.getpid()}-{next(BUCKETS)}")


def write_data(root: Path) -> tuple[Path, Path]:
    return (
        write_image_folder(root / "data" / "train", CLASSES, 6, seed=1),
        write_image_folder(root / "data" / "val", CLASSES, 2, seed=2),
    )


def samples_of(train: str, val: str, log_dir: Path) -> tuple:
    """Every training sample of epoch 1 and validation image, as the trainer makes them."""
    cfg = data_config(train, val, image_size=16, seed=3, log_dir=str(log_dir))
    train_set, val_set, classes, check = build_datasets(cfg, ONE_CPU_PROCESS, threads=1)
    assert check.finish() == {}
    samples = [train_set[(i, 1)] for i in range(len(train_set))]
    return classes, samples, [val_set[i] for i in range(len(val_set))]


def assert_same_samples(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and len(a[1]) == len(b[1]) and len(a[2]) == len(b[2])
    for (pixels, row, label), (p2, r2, l2) in zip(a[1], b[1], strict=True):
        assert label == l2 and torch.equal(pixels, p2) and torch.equal(row, r2)
    for (image, label), (i2, l2) in zip(a[2], b[2], strict=True):
        assert label == l2 and torch.equal(image, i2)


# ----------------------------------------------------------------------------- reading


def test_shards_parquet_and_lists_in_a_bucket_give_the_disks_samples_to_the_bit(s3, tmp_path):
    """The same images as a class folder, tar shards, Parquet and a list in the bucket (its
    paths relative to the list, ``../``): every augmented training sample and validation
    image equal to the folder's, and the bytes read kept in the run's byte cache."""
    train, val = write_data(tmp_path)
    url = new_bucket(s3)
    pack_folder(train, tmp_path / "tar/train", "shards")
    pack_folder(val, tmp_path / "tar/val", "shards")
    pack_folder(train, tmp_path / "pq/train", "parquet")
    pack_folder(val, tmp_path / "pq/val", "parquet")
    s3.upload(tmp_path / "tar", f"{url}/tar")
    s3.upload(tmp_path / "pq", f"{url}/pq")
    s3.upload(tmp_path / "data", f"{url}/images")
    lines = ["path,label"] + [
        f"../images/{Path(p).relative_to(tmp_path / 'data').as_posix()},{CLASSES[label]}"
        for p, label in entries_of(train)[0]
    ]
    s3.client().put_object(Bucket=url[5:], Key="lists/train.csv", Body="\n".join(lines).encode())
    folder = samples_of(str(train), str(val), tmp_path / "logs_folder")
    remote = {
        "shards": (f"{url}/tar/train/shard-{{000000..000002}}.tar", f"{url}/tar/val/"),
        "parquet": (f"{url}/pq/train/*.parquet", f"{url}/pq/val"),
        "list": (f"{url}/lists/train.csv", str(val)),
    }
    for name, (train_url, val_url) in remote.items():
        logs = tmp_path / f"logs_{name}"
        assert_same_samples(folder, samples_of(train_url, val_url, logs))
        assert any((logs / "remote_cache").iterdir()), name  # the bytes read are kept


def test_one_request_per_sample_then_none_from_the_bounded_cache(s3, tmp_path, monkeypatch):
    """A sample of a shard in the bucket is one ranged request (counted by a proxy in front
    of the server); read again, it comes from the byte cache; a small cache stays in its
    bound."""
    train, _ = write_data(tmp_path)
    url = new_bucket(s3)
    pack_folder(train, tmp_path / "tar", "shards")
    s3.upload(tmp_path / "tar", f"{url}/tar")
    proxy, endpoint = proxied(s3, delay=0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = Store(cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 20)
    table, _ = open_datasets(f"{url}/tar/", f"{url}/tar/", reading=Reading(store))
    before = proxy.requests
    first = [table.read(i) for i in range(len(table))]
    assert proxy.requests - before == len(table) == 18  # one ranged request per sample
    assert [table.read(i) for i in range(len(table))] == first
    assert proxy.requests - before == len(table)  # the second epoch: all from the cache
    assert first == [Path(p).read_bytes() for p, _ in entries_of(train)[0]]
    small = Store(cache_dir=str(tmp_path / "small"), cache_bytes=16 << 10)  # < the shards
    for i in range(len(table)):
        where = table.containers[int(table.container[i])]
        assert small.read(where, int(table.offsets[i]), int(table.sizes[i])) == first[i]
    assert 0 < small._cache().size() <= 16 << 10 < store._cache().size()  # on disk, in blocks
    proxy.stop()


@dataclass(frozen=True)
class RawSamples:
    """A dataset of a table's encoded images, keyed as the training samples are."""

    table: Any

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, key: tuple[int, int]) -> bytes:
        return self.table.read(key[0])


def test_the_window_order_reads_whole_shards_ahead_and_names_one_gone_or_cut_short(
    s3, tmp_path, monkeypatch
):
    """In the window order a loader worker fetches the shards of its batch and of its next
    window whole (one request each, whatever their images), and reads the images there. A
    shard deleted or cut short after the listing is one line, not a traceback."""
    train, _ = write_data(tmp_path)
    url = new_bucket(s3)
    pack_folder(train, tmp_path / "tar", "shards", shard_size=3)  # 6 shards of 3 images
    s3.upload(tmp_path / "tar", f"{url}/tar")
    proxy, endpoint = proxied(s3, delay=0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = Store(cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30)
    table, _ = open_datasets(f"{url}/tar/", f"{url}/tar/", reading=Reading(store))
    order = WindowSampler(table.groups(), 0, 1, seed=0, global_batch=6, window=2)
    reads = ReadAhead(RawSamples(table), table, order)
    keys = [(i, 0) for i in order.indices()]
    before = proxy.requests
    assert reads.__getitems__(keys[:6]) == [table.read(i) for i, _ in keys[:6]]
    # 2 lanes of 3 shards: the batch reads a shard of each, the next batch the next two;
    # 4 whole shards fetched, no image read alone.
    assert proxy.requests - before == 4
    gone = table.containers[int(table.container[keys[-1][0]])]  # not fetched yet
    s3.client().delete_object(Bucket=url.removeprefix("s3://"), Key=gone.split("/", 3)[3])
    with pytest.raises(UserError, match="training data changed during the run: .* restore it"):
        for start in range(6, len(keys), 6):
            reads.__getitems__(keys[start : start + 6])
    proxy.stop()


@dataclass(frozen=True)
class ThreadedSamples(RawSamples):
    """``RawSamples`` that note the thread reading each sample."""

    threads: list = field(default_factory=list)

    def __getitem__(self, key: tuple[int, int]) -> bytes:
        self.threads.append(threading.get_ident())
        return super().__getitem__(key)


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0])
def test_a_window_held_in_the_cache_is_read_as_from_a_disk_else_many_requests_at_once(
    s3, tmp_path, monkeypatch, cache_bytes
):
    """Whole shards held in the cache: the worker reads a batch's images there itself, one
    after the other, as from a disk (threads would only add their cost). No cache to hold
    them (--remote_cache_gb 0): each image is a request, a batch's in threads at once."""
    train, _ = write_data(tmp_path)
    url = new_bucket(s3)
    pack_folder(train, tmp_path / "tar", "shards", shard_size=3)
    s3.upload(tmp_path / "tar", f"{url}/tar")
    proxy, endpoint = proxied(s3, delay=0.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = Store(cache_dir=str(tmp_path / "cache"), cache_bytes=cache_bytes)
    table, _ = open_datasets(f"{url}/tar/", f"{url}/tar/", reading=Reading(store))
    order = WindowSampler(table.groups(), 0, 1, seed=0, global_batch=6, window=2)
    samples = ThreadedSamples(table)
    keys = [(i, 0) for i in order.indices()][:6]
    before = proxy.requests
    assert ReadAhead(samples, table, order).__getitems__(keys) == [table.read(i) for i, _ in keys]
    readers = set(samples.threads[: len(keys)])
    if cache_bytes:
        assert readers == {threading.get_ident()}
        assert proxy.requests - before == 4  # the batch's 2 shards and the next 2, whole
    else:
        assert threading.get_ident() not in readers and len(readers) > 1
        assert proxy.requests - before == 2 * len(keys)  # each image, then read again above
    proxy.stop()


def test_a_forked_process_reads_with_the_api_models_its_parent_parsed(s3):
    """A loader worker (a forked process) makes its own S3 client, with no probe of its own,
    from the botocore data loader its parent's client filled (the parsed API models: 0.2 s
    of CPU per process otherwise); it reads the object."""
    url = f"{new_bucket(s3)}/object"
    Store().put_bytes(url, b"bytes")
    parent = storage_remote.filesystem(url, "")
    models = parent.session.get_component("data_loader")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and ends at once: no pytest teardown of its own
        try:
            child = storage_remote.filesystem(url, "")
            shared = child is not parent and child.session.get_component("data_loader") is models
            os.write(write, f"{shared} {child.cat_file(url).decode()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100).decode() == "True bytes"
    os.close(read)


def test_validation_shards_in_the_bucket_are_opened_beside_the_training_shards(s3, tmp_path):
    """Both in the bucket, the validation shards are opened while the training shards are
    (their round trips at once), and labelled as before: by their own classes.txt, else by
    the training classes; classes that differ are still one line."""
    train, val = write_data(tmp_path)
    url = new_bucket(s3)
    for name, folder in (("train", train), ("val", val)):
        pack_folder(folder, tmp_path / name, "shards")
        s3.upload(tmp_path / name, f"{url}/{name}")
    expected = [label for _, label in entries_of(val)[0]]
    bucket, client = url.removeprefix("s3://"), s3.client()
    for own_names in (True, False):
        if not own_names:
            client.delete_object(Bucket=bucket, Key="val/classes.txt")
        tables = open_datasets(f"{url}/train/", f"{url}/val/", reading=Reading(Store()))
        assert tables[1].classes == tables[0].classes == CLASSES
        assert tables[1].labels.tolist() == expected
    client.put_object(Bucket=bucket, Key="val/classes.txt", Body=b"x\ny\nz\n")
    with pytest.raises(UserError, match="the classes of .* differ"):
        open_datasets(f"{url}/train/", f"{url}/val/", reading=Reading(Store()))


def test_transient_failures_are_tried_again_with_backoff_and_the_others_raised_at_once(
    monkeypatch,
):
    calls, waits = [], []
    monkeypatch.setattr(storage_remote.time, "sleep", waits.append)

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert retried(flaky) == "ok" and len(calls) == 4
    assert len(waits) == 3 and waits[0] < waits[2]  # 0.25, 0.5, 1 s, each +-50%
    server_error = OSError("An error occurred (ServiceUnavailable): 503 Slow Down")
    assert is_transient(server_error) and is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("no such key"))
    with pytest.raises(FileNotFoundError):
        retried(lambda: (calls.append(1), open("/nonexistent/x"))[1])
    assert len(calls) == 5 and len(waits) == 3  # not tried again


def test_the_hubs_parquet_of_paths_and_webdatasets_shards_read_as_their_files(s3, tmp_path):
    """``datasets`` writes images given as paths as {bytes: None, path}: each read from its
    path, from a Parquet file on the disk and in the bucket; shards of ShardWriter with PNG and
    WEBP members and the label in a .json member's field (--label_column)."""
    datasets, webdataset = need("datasets"), need("webdataset")
    train, val = write_data(tmp_path)
    entries, classes = entries_of(train)
    features = datasets.Features(
        {"img": datasets.Image(), "labels": datasets.ClassLabel(names=classes)}
    )
    paths = {"img": [str(p) for p, _ in entries], "labels": [label for _, label in entries]}
    hub = tmp_path / "hub" / "train-00000-of-00001.parquet"
    datasets.Dataset.from_dict(paths, features=features).to_parquet(str(hub))
    (tmp_path / "wds").mkdir()
    from PIL import Image

    with webdataset.ShardWriter(
        str(tmp_path / "wds" / "train-%06d.tar"), maxcount=7, verbose=0
    ) as sink:
        for n, (path, label) in enumerate(entries):
            ext = "png" if n % 2 else "webp"
            encoded = io_bytes(Image.open(path), ext)
            sink.write({"__key__": f"s{n:04d}", ext: encoded, "json": {"labels": label}})
    (tmp_path / "wds" / "classes.txt").write_text("\n".join(classes) + "\n")
    url = new_bucket(s3)
    s3.upload(tmp_path / "hub", f"{url}/hub")
    reading = Reading(Store(), label_column="labels")
    for spec in (str(hub), f"{url}/hub/"):  # {bytes: None, path}: its own file, wherever it is
        table, _ = open_datasets(spec, str(val), reading=reading)
        assert table.classes == classes and table.labels.tolist() == paths["labels"]
        assert [table.read(i) for i in range(len(table))] == [p.read_bytes() for p, _ in entries]
    shards, _ = open_datasets(str(tmp_path / "wds" / "*.tar"), str(val), reading=reading)
    assert len(shards.containers) == 3 and shards.labels.tolist() == paths["labels"]
    for i in range(len(shards)):  # the members' own bytes, decoded as the same pixels
        decoded = Image.open(io.BytesIO(shards.read(i)))
        assert decoded.format == ("PNG" if i % 2 else "WEBP")
        assert decoded.tobytes() == Image.open(entries[i][0]).convert("RGB").tobytes()
    from webdataset.autodecode import IMAGE_EXTENSIONS

    # The image formats among the extensions webdataset decodes (PIL's: also eps, h5, mpg ...)
    assert {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tiff"} <= SHARD_IMAGE_EXTENSIONS
    assert SHARD_IMAGE_EXTENSIONS <= set(IMAGE_EXTENSIONS)


def io_bytes(image, ext: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG" if ext == "png" else "WEBP", lossless=True)
    return buffer.getvalue()


def relative_path_parquet(root: Path, train: Path, prefix: str, columns=("image", "label")) -> Path:
    """``train``'s images as {bytes: None, path} rows, each path ``prefix`` + the image's path
    relative to ``root``, in a Parquet file in ``root`` with the columns named ``columns``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entries, classes = entries_of(train)
    kind = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [
        {"bytes": None, "path": f"{prefix}{p.relative_to(root).as_posix()}"} for p, _ in entries
    ]
    table = pa.table(
        {columns[0]: pa.array(rows, kind), columns[1]: [classes[k] for _, k in entries]}
    )
    path = root / f"{prefix.strip('/') or 'relative'}-{columns[0]}.parquet"
    pq.write_table(table, path)
    return path


def test_relative_paths_and_chosen_columns_of_parquet_and_what_the_preflight_names(tmp_path):
    """A relative path is read from the Parquet file's folder; columns of other names are
    read with --image_column / --label_column; the launcher's pre-flight names a path that
    does not exist and columns it cannot find, in one line each."""
    train, val = write_data(tmp_path)
    first = entries_of(train)[0][0][0].read_bytes()
    good = relative_path_parquet(tmp_path, train, "")
    table, _ = open_datasets(str(good), str(val))
    assert table.read(0) == first
    other = relative_path_parquet(tmp_path, train, "", columns=("photo", "fine_label"))
    reading = Reading(image_column="photo", label_column="fine_label")
    table, _ = open_datasets(str(other), str(val), reading=reading)
    assert table.read(0) == first and table.classes == CLASSES
    bad = relative_path_parquet(tmp_path, train, "elsewhere/")
    flags = ["--val_data", str(val), "--checkpoint_dir", str(tmp_path / "ckpt"), *TINY_FLAGS]
    cases = {
        "path": ([str(bad)], r"row 0's image .*elsewhere/data/train/cat/img_000.jpg does not "
                 r"exist \(the 'image' column holds paths; a relative one is read from the "
                 r"Parquet file's folder\)"),
        "columns": ([str(other)], r"no image column 'image' or 'img' and no label column "
                    r"'label' or 'labels' \(columns: photo, fine_label\); choose them with "
                    r"--image_column / --label_column"),
    }  # fmt: skip
    for train_data, message in cases.values():
        cfg = parse_config(["--train_data", *train_data, *flags])
        with pytest.raises(UserError, match=message):
            launcher_checks(cfg, "cpu", 1)
    chosen = ["--image_column", "photo", "--label_column", "fine_label"]
    launcher_checks(parse_config(["--train_data", str(other), *flags, *chosen]), "cpu", 1)


# ----------------------------------------------------------------------------- bad input


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_remote_input_is_one_line_exit_2_within_seconds(s3, tmp_path, capsys, monkeypatch):
    """Each mistake, through the launcher's pre-flight (no torchrun started): one error line
    naming it, exit 2, within seconds. A store that does not answer is cut at the first
    request's deadline (1 s here; 5 s in a run) whether it refuses or swallows the request."""
    train, val = write_data(tmp_path)
    url = new_bucket(s3)
    pack_folder(train, tmp_path / "tar", "shards")
    s3.upload(tmp_path / "tar", f"{url}/tar")
    shards = f"{url}/tar/shard-{{000000..000002}}.tar"
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    monkeypatch.setattr(storage_remote, "PROBE_SECONDS", 1.0)
    registry = sys.modules["fsspec.registry"]._registry
    keys = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    cases = [  # (what, --train_data and more flags, environment, modules gone, the line says)
        ("unknown bucket", [f"s3://no-such-bucket-{os.getpid()}/t-{{0..1}}.tar"], {}, [],
         "no such bucket or object"),
        ("unknown key", [f"{url}/tar/shard-{{000000..000009}}.tar"], {}, [],
         f"{url}/tar/shard-000003.tar does not exist"),
        ("pattern matching nothing", [f"{url}/tar/none-*.tar"], {}, [], "matches no file"),
        ("no credentials", [shards], keys, [], "no credentials for the store"),
        ("endpoint refusing", [shards],
         {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}"}, [], "does not answer"),
        # Its user and password never in a line (F11): the user info is replaced.
        ("endpoint with credentials", [shards],
         {"AWS_ENDPOINT_URL": f"http://canary:CANARYPASS@127.0.0.1:{closed_port()}"}, [],
         f"the store at http://{redact.MARK}@127.0.0.1:"),
        ("endpoint silent", [shards],
         {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"}, [],
         "does not answer (nothing in 1 s)"),
        ("options not JSON", [shards, "--storage_options", "{endpoint"], {}, [], "not JSON"),
        ("unknown option", [shards, "--storage_options", '{"no_such_option": 1}'], {}, [],
         "--storage_options for s3://"),
        ("unknown bucket for checkpoints",
         [shards, "--checkpoint_dir", "s3://no-such-ckpt-bucket/run"], {}, [],
         "s3://no-such-ckpt-bucket/run: no such bucket or object"),
        ("s3fs missing", [shards], {}, ["s3fs"], "pip install -r requirements-remote.txt"),
        ("fsspec missing", [shards], {}, ["fsspec"],
         "reading object storage needs fsspec: pip install -r requirements-remote.txt"),
    ]  # fmt: skip
    for case, flags, env, gone, phrase in cases:
        argv = ["--device", "cpu", "--nproc", "1", "--train_data", *flags[:1]]
        argv += ["--val_data", str(val), *flags[1:], *TINY_FLAGS]
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.delenv(key) if value is None else patch.setenv(key, value)
            for module in gone:  # as if never installed: an import of it fails
                patch.setitem(sys.modules, module, None)
                if module == "s3fs":
                    patch.delitem(registry, "s3")
            patch.setattr(storage_remote, "_FILESYSTEMS", {})  # this process's clients: new
            started = time.perf_counter()
            line = user_error_line(launch_ddp.main, argv, capsys, cwd=tmp_path)
            assert phrase in line, (case, line)
            assert time.perf_counter() - started < 10, case
    silent.close()


# ----------------------------------------------------------------------------- checkpoints


def test_an_upload_does_not_hold_training_up_and_resume_downloads_it(s3, tmp_path, monkeypatch):
    """Saving a checkpoint to a folder in the bucket returns while its upload hangs (held by
    the proxy): training waits for the local write only; let go, the upload ends in the
    background, and ``fetch_latest`` gets it back."""
    from imgtrainer.checkpoints.remote import CheckpointMirror
    from imgtrainer.checkpoints.writer import CheckpointWriter

    url = new_bucket(s3) + "/run"
    proxy, endpoint = proxied(s3, delay=0.0)
    proxy.stall(f"PUT /{url[5:]}/checkpoint_latest.pth HTTP".encode())
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    local = tmp_path / "ckpt"
    mirror = CheckpointMirror(url, local, tmp_path, Store(), enabled=True)
    writer = CheckpointWriter(local, True, mirror=mirror)
    state = {"model_state_dict": {"w": torch.arange(100_000.0)}, "epoch": 1}
    history = type("History", (), {"save": lambda self: None})()
    writer.save_with_history(state, history, is_best=True, keep_epochs=None)
    assert proxy.stalling.wait(30)  # the save returned; its upload is under way, held
    assert s3.keys(url) == []
    proxy.release()
    writer.finish()
    proxy.stop()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert s3.keys(url) == ["run/checkpoint_best.pth", "run/checkpoint_latest.pth"]
    assert fetch_latest(url, Store(), tmp_path / "fresh") == f"{url}/checkpoint_latest.pth"
    loaded = torch.load(tmp_path / "fresh" / DOWNLOADED, weights_only=True)
    assert torch.equal(loaded["model_state_dict"]["w"], state["model_state_dict"]["w"])


def test_queued_uploads_are_bounded_and_a_replaced_best_is_still_uploaded(
    s3, tmp_path, monkeypatch
):
    """Four checkpoints saved while the first's upload hangs: the second (a best epoch) and the
    third wait, each replaced by the next: the store gets the first and the last as its latest,
    and the second as its best; no more than the held and the waiting snapshots stay on the disk
    (and the replaced best's), and none once the uploads end. Leftovers of a killed run go."""
    from imgtrainer.checkpoints.remote import CheckpointMirror
    from imgtrainer.checkpoints.writer import CheckpointWriter

    url = new_bucket(s3) + "/run"
    proxy, endpoint = proxied(s3, delay=0.0)
    proxy.stall(f"PUT /{url[5:]}/checkpoint_latest.pth HTTP".encode())
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    local = tmp_path / "ckpt"
    local.mkdir()
    for leftover in (".upload-1-1.pth", DOWNLOADED):
        (local / leftover).write_bytes(b"a killed run's")
    mirror = CheckpointMirror(url, local, tmp_path, Store(), enabled=True)
    assert sorted(p.name for p in local.iterdir()) == []
    writer = CheckpointWriter(local, True, mirror=mirror)
    history = type("History", (), {"save": lambda self: None})()
    for step in range(4):
        state = {"model_state_dict": {"w": torch.full((1000,), float(step))}, "step": step}
        writer.save_with_history(state, history, is_best=step in (0, 1), keep_epochs=None)
        if step == 0:
            assert proxy.stalling.wait(30)
        assert len(list(local.glob(".upload-*"))) <= 3
    proxy.release()
    writer.finish()
    proxy.stop()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert list(local.glob(".upload-*")) == []
    assert fetch_latest(url, Store(), tmp_path / "fresh")
    assert torch.load(tmp_path / "fresh" / DOWNLOADED, weights_only=True)["step"] == 3
    Store().get_file(f"{url}/checkpoint_best.pth", tmp_path / "best.pth")
    assert torch.load(tmp_path / "best.pth", weights_only=True)["step"] == 1


def test_a_resume_from_a_bucket_takes_the_newest_checkpoint_local_or_remote(s3, tmp_path, caplog):
    """A restart after an upload that did not finish: the store one checkpoint behind the disk.
    The local one is kept; had the store been ahead, its own would be taken."""
    from conftest import ONE_CPU_PROCESS
    from imgtrainer.config import TrainConfig
    from imgtrainer.training.run_state import take_newest_checkpoint

    url = new_bucket(s3) + "/run"
    cfg = TrainConfig(checkpoint_dir=url, log_dir=str(tmp_path / "logs"), resume="auto")
    local = tmp_path / "logs" / "checkpoints"
    local.mkdir(parents=True)

    def checkpoint(epoch: int, position: int) -> bytes:
        state = {"model_state_dict": {}, "optimizer_state_dict": {}, "epoch": epoch}
        torch.save({**state, "epoch_position": position}, tmp_path / "c.pth")
        return (tmp_path / "c.pth").read_bytes()

    latest = local / "checkpoint_latest.pth"
    for mine, theirs, taken in (((1, 32), (1, 16), "local"), ((1, 32), (2, 0), "store")):
        latest.write_bytes(checkpoint(*mine))
        Store().put_bytes(f"{url}/checkpoint_latest.pth", checkpoint(*theirs))
        with caplog.at_level(logging.INFO):
            take_newest_checkpoint(cfg, ONE_CPU_PROCESS)
        kept = torch.load(latest, weights_only=True)
        assert (kept["epoch"], kept["epoch_position"]) == (mine if taken == "local" else theirs)
        line = caplog.records[-1].getMessage()
        first = "the local" if taken == "local" else url
        assert line.startswith(f"Resume: {first}") and "is the newest checkpoint, not" in line
        assert not (local / DOWNLOADED).exists()


# ----------------------------------------------------------------------------- runs


def vit_flags(train: str, val: str, *extra: str) -> list[str]:
    """A tiny timm ViT (no BatchNorm: the weights do not depend on how a step is split), the
    label in the shards' .json member's ``labels`` field and the Parquet's ``labels`` column."""
    return [
        *("--train_data", train, "--val_data", val, *TINY_FLAGS, "--label_column", "labels"),
        *("--model", "test_vit", "--optimizer", "sgd", "--epochs", "2", "--save_every_steps", "1"),
        *extra,
    ]


@dataclass(frozen=True)
class HubData:
    """The same 32 training and 4 validation images on the disk (``root``) and in the bucket
    (``url``): shards of webdataset's ShardWriter (``wds/``), Parquet of image paths written by
    ``datasets`` (``train.parquet``, ``val.parquet``: paths relative to the files), and the
    reference run on the disk (``reference``: its checkpoints and logs)."""

    root: Path
    url: str
    reference: Path

    def shards(self, where: str) -> str:
        return f"{where}/wds/train-{{000000..000003}}.tar"


def write_hub_data(root: Path) -> None:
    datasets, webdataset = need("datasets"), need("webdataset")
    train = write_image_folder(root / "images" / "train", ["cat", "dog"], 16, seed=1)
    val = write_image_folder(root / "images" / "val", ["cat", "dog"], 2, seed=2)
    for folder, name in ((train, "train"), (val, "val")):
        entries, classes = entries_of(folder)
        features = datasets.Features(
            {"img": datasets.Image(), "labels": datasets.ClassLabel(names=classes)}
        )
        rows = {
            "img": [p.relative_to(root).as_posix() for p, _ in entries],
            "labels": [label for _, label in entries],
        }
        table = datasets.Dataset.from_dict(rows, features=features)
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)  # datasets opens the paths as given, from where it runs
            table.to_parquet(f"{name}.parquet")
    entries, classes = entries_of(train)
    (root / "wds").mkdir()
    (root / "wds" / "classes.txt").write_text("\n".join(classes) + "\n")
    with webdataset.ShardWriter(str(root / "wds" / "train-%06d.tar"), maxcount=8, verbose=0) as w:
        for n, (path, label) in enumerate(entries):
            w.write({"__key__": f"{n:05d}", "jpg": path.read_bytes(), "json": {"labels": label}})


@pytest.fixture(scope="module")
def hub_data(s3_server, tmp_path_factory) -> HubData:
    root = tmp_path_factory.mktemp("hub_data")
    write_hub_data(root / "data")
    url = s3_server.make_bucket(f"hub-{os.getpid()}")
    s3_server.upload(root / "data", url)
    reference = root / "reference"
    reference.mkdir()
    on_disk = vit_flags(HubData(root, url, reference).shards(str(root / "data")),
                        str(root / "data" / "val.parquet"), "--accum_steps", "2",
                        "--sampler", "window")  # fmt: skip
    assert run_train(on_disk, reference) == 0
    return HubData(root / "data", url, reference)


def epoch_figures(history: dict) -> list[dict]:
    """The per-epoch metrics of a history (not the clock's or the memory's figures)."""
    metrics = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_top5", "lr")
    return [{k: r[k] for k in metrics} for r in history["epochs"]]


def history_of(folder: Path) -> dict:
    return json.loads((folder / "logs" / "training_history.json").read_text())


def latest_weights(folder: Path) -> dict:
    path = folder / "checkpoints" / "checkpoint_latest.pth"
    return torch.load(path, weights_only=True)["model_state_dict"]


@pytest.mark.slow
def test_shards_and_parquet_in_a_bucket_train_as_on_the_disk_to_the_bit(
    hub_data, s3, tmp_path, monkeypatch
):
    """Training shards and validation Parquet (image paths relative to it, the images in the
    bucket) read from the bucket 20 ms away, checkpoints written there: the window order by
    default, whole shards read ahead (one request per shard, not per image); the reference
    run's (on the disk, --sampler window) per-epoch metrics and weights to the bit, and the
    bucket holds the checkpoints and the records."""
    flags = vit_flags(
        hub_data.shards(hub_data.url), f"{hub_data.url}/val.parquet", "--accum_steps", "2",
        "--checkpoint_dir", f"{hub_data.url}/to-the-bit",
    )  # fmt: skip
    proxy, endpoint = proxied(s3, delay=0.02)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert run_train(flags, tmp_path) == 0
    log = (tmp_path / "logs" / "train_rank_0.log").read_text()
    assert f"from tar shards {hub_data.shards(hub_data.url)} (4 files)" in log
    assert f"from Parquet {hub_data.url}/val.parquet (1 file)" in log
    assert "Training order: --sampler window, the images of 4 of 4 groups mixed" in log
    # 32 training images in 4 shards: each shard's index scan and its images read whole (by
    # the image check or the loader, whichever comes first; the TensorBoard preview reads the
    # first batch's images as the loader does); never one per image (4 + 32, as
    # --sampler random reads them). Two to spare for a request tried again.
    shard_reads = [r for r in proxy.request_lines if r.startswith("GET ") and ".tar HTTP" in r]
    assert len(shard_reads) <= 4 + 4 + 2, "\n".join(proxy.request_lines)
    # A small object read whole (a shard's index, classes.txt) is one GET, once, not a HEAD for
    # its size first; a copy in the bucket (latest to best) lists no folder.
    small = [r for r in proxy.request_lines if "index" in r or "classes.txt" in r]
    assert small and all(r.startswith("GET ") for r in small), "\n".join(small)
    assert len(small) == len(set(small)), "\n".join(small)
    copies = [r for r in proxy.request_lines if "prefix=to-the-bit%2Fcheckpoint" in r]
    assert all("max-keys=1" in r for r in copies), copies  # (the first: is latest there yet?)
    assert epoch_figures(history_of(tmp_path)) == epoch_figures(history_of(hub_data.reference))
    keys = s3.keys(f"{hub_data.url}/to-the-bit")
    assert {"checkpoint_latest.pth", "checkpoint_latest.prev.pth", "checkpoint_best.pth"} | {
        f"logs/{name}" for name in ("training_history.json", "metrics.csv", "config.yaml")
    } == {k.removeprefix("to-the-bit/") for k in keys}
    fetched = tmp_path / "fetched"
    assert fetch_latest(f"{hub_data.url}/to-the-bit", Store(), fetched)
    remote = torch.load(fetched / DOWNLOADED, weights_only=True)["model_state_dict"]
    reference = latest_weights(hub_data.reference)
    assert remote.keys() == reference.keys()
    assert all(torch.equal(remote[name], reference[name]) for name in reference)
    proxy.stop()


@pytest.mark.slow
def test_killed_at_two_processes_resumed_from_the_bucket_on_an_empty_disk_at_one(
    hub_data, s3, tmp_path, monkeypatch
):
    """Shards in the bucket (the window order, its default there), checkpoints there too,
    through a proxy that hangs the second upload of checkpoint_latest.pth half-way; the
    2-process job SIGKILLed then: the bucket holds the first checkpoint, whole. The machine's
    run folder deleted, resumed at 1 process from the bucket: every training index once per
    epoch and the weights of the reference run on the disk (--sampler window). Parquet
    training data in a bucket: its samples to the bit above."""
    from test_elastic import assert_each_index_once_per_epoch, recording_env, run_recorded

    url = f"{hub_data.url}/killed"
    flags = vit_flags(
        hub_data.shards(hub_data.url), f"{hub_data.url}/val.parquet",
        "--checkpoint_dir", url, "--resume", "auto",
    )  # fmt: skip
    proxy, endpoint = proxied(s3, delay=0.0)
    bucket = hub_data.url.removeprefix("s3://")
    proxy.stall(f"PUT /{bucket}/killed/checkpoint_latest.pth HTTP".encode(), after=1)
    env = {**recording_env(tmp_path), "AWS_ENDPOINT_URL": endpoint}
    with open(tmp_path / "killed.out", "w") as out:
        job = start_launcher(
            ["--device", "cpu", "--nproc", "2", *flags], tmp_path, env, stdout=out, stderr=out
        )
        # Training goes on while the upload hangs (and the job waits for it at its end).
        stalled = proxy.stalling.wait(240)
        for pid in [*descendants(job.pid), job.pid]:
            os.kill(pid, signal.SIGKILL)
        job.wait()
    proxy.stop()
    assert stalled, (tmp_path / "killed.out").read_text()[-3000:]
    log = (tmp_path / "logs" / "train_rank_0.log").read_text()
    assert (
        f"Training data: 32 images in 2 classes from tar shards {hub_data.shards(hub_data.url)}"
        in log
    )
    in_bucket = tmp_path / "in_bucket"
    assert fetch_latest(url, Store(), in_bucket)
    kept = torch.load(in_bucket / DOWNLOADED, weights_only=True)
    assert (kept["epoch"], kept["step"]) == (0, 1)  # the upload before the killed one, whole
    local = torch.load(tmp_path / "logs/checkpoints/checkpoint_latest.pth", weights_only=True)
    assert (local["epoch"], local["step"]) > (0, 1)  # newer, on this disk only

    shutil.rmtree(tmp_path / "logs")  # a new machine: nothing of the run on its disk
    assert run_recorded(flags, tmp_path, monkeypatch) == 0  # 1 process
    log = (tmp_path / "logs" / "train_rank_0.log").read_text()
    assert f"Resume: {url}/checkpoint_latest.pth (epoch 1, sample 16) is the newest" in log
    assert "Resumed from logs/checkpoints/checkpoint_latest.pth: epoch 1, step 1 of 2" in log
    assert "processes 2 -> 1, layout --batch_size 8 x --accum_steps 2 x 1 process(es)" in log
    assert_each_index_once_per_epoch(tmp_path, 2, 32)
    reference, resumed = latest_weights(hub_data.reference), latest_weights(tmp_path / "logs")
    for name, weight in reference.items():
        torch.testing.assert_close(resumed[name], weight, rtol=1e-4, atol=1e-5)
    history = s3.client().get_object(Bucket=bucket, Key="killed/logs/training_history.json")
    assert [r["epoch"] for r in json.loads(history["Body"].read())["epochs"]] == [1, 2]
