"""prepare_data's other formats: a split written as Parquet files or WebDataset tar shards.

Written in the order the trainer reads the same images from a folder, so a run on either is the
same run. Parquet follows the Hugging Face Hub: ``image`` a ``{bytes, path}`` struct, ``label``
the class index, the class names as a ``datasets`` ClassLabel in the schema's metadata. Shards
hold ``KEY.<ext>`` + ``KEY.cls`` per image, ``classes.txt`` beside them.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from imgtrainer.data.layouts.image_files import find_unreadable
from imgtrainer.data.layouts.shards import keep_index

# Rows per Parquet row group: the trainer reads a whole group for one image, so keep them small
# (the Hub's image datasets use 100).
ROW_GROUP_ROWS = 100
FORMATS = ("folder", "parquet", "shards")


def readable_images(
    entries: Sequence[tuple[Path, int]], workers: int
) -> tuple[list[tuple[Path, int]], dict[str, str]]:
    """The entries whose file decodes, and ``{path: reason}`` for the others (checked in
    parallel, as the trainer's start-up check)."""
    unreadable = find_unreadable([str(path) for path, _ in entries], workers=workers)
    return [e for e in entries if str(e[0]) not in unreadable], unreadable


def _chunks(entries: Sequence, size: int) -> Iterator[tuple[int, Sequence]]:
    for n, start in enumerate(range(0, len(entries), size)):
        yield n, entries[start : start + size]


def _read_all(paths: Sequence[Path], workers: int) -> list[bytes]:
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(Path.read_bytes, paths))


def hub_metadata(class_names: Sequence[str]) -> dict[bytes, bytes]:
    """The schema metadata ``datasets`` writes: the image feature and the label's ClassLabel."""
    features = {
        "image": {"_type": "Image"},
        "label": {"names": list(class_names), "_type": "ClassLabel"},
    }
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_parquet(
    entries: Sequence[tuple[Path, int]],
    class_names: Sequence[str],
    folder: Path,
    shard_size: int,
    workers: int,
) -> str:
    """``folder/part-NNNNNN.parquet``, ``shard_size`` images a file; returns what to train on,
    relative to ``folder`` ("": the folder itself)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())], hub_metadata(class_names))
    for n, chunk in _chunks(entries, shard_size):
        data = _read_all([path for path, _ in chunk], workers)
        images = [
            {"bytes": raw, "path": path.name} for raw, (path, _) in zip(data, chunk, strict=True)
        ]
        table = pa.table(
            {"image": pa.array(images, image_type), "label": [label for _, label in chunk]},
            schema=schema,
        )
        pq.write_table(table, folder / f"part-{n:06d}.parquet", row_group_size=ROW_GROUP_ROWS)
    return ""


def write_shards(
    entries: Sequence[tuple[Path, int]],
    class_names: Sequence[str],
    folder: Path,
    shard_size: int,
    workers: int,
) -> str:
    """``folder/shard-NNNNNN.tar`` of ``shard_size`` images each, with the index of each
    beside it (training never scans them), and ``folder/classes.txt``; returns the shard
    pattern to train on, relative to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classes.txt").write_text("".join(f"{name}\n" for name in class_names))
    count = 0
    for n, chunk in _chunks(entries, shard_size):
        data = _read_all([path for path, _ in chunk], workers)
        shard, index = folder / f"shard-{n:06d}.tar", []
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
            for k, (raw, (path, label)) in enumerate(zip(data, chunk, strict=True)):
                key = f"{n * shard_size + k:09d}"
                name = f"{key}{path.suffix.lower()}"
                index.append((_add(tar, name, raw), len(raw), label, name))
                _add(tar, f"{key}.cls", str(label).encode())
        keep_index(str(shard), index)
        count = n + 1
    return f"shard-{{000000..{count - 1:06d}}}.tar"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add a member; where its data starts in the file."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # after its header


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))
