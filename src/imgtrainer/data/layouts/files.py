"""Images as files of their own: a folder of class folders (ImageFolder's layout) and a
``.csv``/``.tsv`` list of paths or URLs and labels, as ``FILES`` rows."""

from __future__ import annotations

import csv
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import numpy as np

from imgtrainer.data.layouts.folder_checks import find_classes
from imgtrainer.data.layouts.image_files import is_image_file, walk_once
from imgtrainer.data.layouts.names import PLAIN, Reading, labels_of
from imgtrainer.data.layouts.table import ImageTable, RowKind, Strings
from imgtrainer.errors import UserError
from imgtrainer.storage import is_url, join, parent, row_may_name


class FileRows(RowKind):
    """A row is a file (or an object): ``container`` joined with ``member``."""

    name = "files"

    def location(self, table: ImageTable, i: int) -> str:
        return join(table.containers[int(table.container[i])], table.members[i])

    def file_of(self, table: ImageTable, i: int) -> str:
        return self.location(table, i)

    def read(self, table: ImageTable, i: int) -> bytes:
        return table.store.read(self.location(table, i))

    def image_file(self, table: ImageTable, i: int) -> str | IO[bytes]:
        where = self.location(table, i)
        return io.BytesIO(table.store.read(where)) if is_url(where) else where


FILES = FileRows()


def folder_table(root: Path, role: str, names: list[str] | None, threads: int = 4) -> ImageTable:
    """ImageFolder's listing (``names`` fixes the labels, as a checkpoint's classes), each
    class folder walked in its own thread."""
    names = names or find_classes(root, role)

    def walk(name: str) -> list[tuple[str, Strings]]:
        # Each folder's names become compact arrays at once: a million names never live as
        # Python strings together (their memory would stay with the process).
        return [
            (where, Strings.of([f for f in sorted(files) if is_image_file(f)]))
            for where, _, files in sorted(walk_once(root / name))
        ]

    wanted = sorted(range(len(names)), key=lambda i: names[i])
    with ThreadPoolExecutor(max(1, threads)) as pool:
        walked = list(pool.map(walk, [names[i] for i in wanted]))
    folders = [
        (label, where, files)
        for label, found in zip(wanted, walked, strict=True)
        for where, files in found
    ]
    counts = [len(files) for _, _, files in folders]
    rows = {
        "containers": [where for _, where, _ in folders],
        "container": np.repeat(np.arange(len(folders), dtype=np.int32), counts),
        "members": Strings.joined([files for _, _, files in folders]),
        "labels": np.repeat(np.array([label for label, _, _ in folders], dtype=np.int64), counts),
    }
    present = {i for i, name in enumerate(names) if (root / name).is_dir()}
    return ImageTable.build(FILES, str(root), names, rows, present=present)


def list_table(path: str, names: list[str] | None, reading: Reading = PLAIN) -> ImageTable:
    """A ``.csv``/``.tsv`` (a file or an object) with a header holding ``path`` and ``label``
    (or the columns chosen); relative paths are relative to the list file's folder."""
    where, label = reading.image_column or "path", reading.label_column or "label"
    try:
        text = reading.store.read(path).decode()
        delimiter = "\t" if path.lower().endswith(".tsv") else ","
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
        header = reader.fieldnames or []
        missing = [c for c in (where, label) if c not in header]
        if missing:
            raise UserError(
                f"list file {path}: no {' or '.join(repr(c) for c in missing)} column in "
                f"its header (found: {', '.join(header) or 'nothing'}); expected a header "
                "line with path and label, or choose them with --image_column / --label_column"
            )
        entries = [(row[where], row[label]) for row in reader]
        short = next((n for n, e in enumerate(entries, start=2) if None in e), None)
        if short is not None:
            raise UserError(
                f"list file {path}, line {short}: no {where} or {label} value (each line needs "
                "both, as its header names them)"
            )
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"list file {path}: cannot be read ({err})") from None
    names, labels = labels_of([value for _, value in entries], names, f"list file {path}")
    folder = parent(path)
    rows: dict[str, list] = {"containers": [], "container": [], "members": [], "labels": labels}
    seen: dict[str, int] = {}
    for row, (name, _) in enumerate(entries, start=2):
        image = join(folder, name)
        if not row_may_name(path, image):
            raise UserError(
                f"list file {path}, line {row}: {name!r} is not read: rows may name files and "
                "objects in object storage (in a bucket's list, of its own bucket), not other "
                "addresses"
            )
        container, member = (parent(image), image.rsplit("/", 1)[-1]) if is_url(image) else (
            os.path.split(image)
        )  # fmt: skip
        rows["container"].append(seen.setdefault(container, len(seen)))
        rows["members"].append(member)
    rows["containers"] = list(seen)
    return ImageTable.build(FILES, str(path), names, rows, store=reading.store)
