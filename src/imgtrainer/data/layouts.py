"""The readers of each data layout, each making an ``ImageTable``: a folder of class folders, a
``.csv``/``.tsv`` list of paths and labels, Parquet files (the Hugging Face Hub's layout), and
WebDataset tar shards (``data.shards``). ``open_datasets`` reads the training and validation
data of a run and checks that their classes agree; any problem is one ``UserError`` line.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from imgtrainer.data.checks import class_difference, find_classes
from imgtrainer.data.image_files import is_image_file
from imgtrainer.data.table import FILES, PARQUET, TAR, ImageTable, Strings
from imgtrainer.errors import UserError
from imgtrainer.process import return_free_memory

FOLDER, LIST, PARQUET_LAYOUT, SHARDS = "folder", "list", "Parquet", "tar shards"


def layout_of(spec: str) -> str:
    """Which layout ``spec`` (a --train_data / --val_data value) names, from its form alone."""
    name = spec.lower()
    if name.endswith((".csv", ".tsv")):
        return LIST
    if name.endswith(".parquet"):
        return PARQUET_LAYOUT
    if name.endswith(".tar"):
        return SHARDS
    path = Path(spec)
    if path.is_dir() and not any(p.is_dir() for p in path.iterdir()):
        if any(path.glob("*.parquet")):
            return PARQUET_LAYOUT
        if any(path.glob("*.tar")):
            return SHARDS
    return FOLDER


def expand_pattern(spec: str) -> list[str]:
    """The files a shard or Parquet pattern names: braces first (``{000000..000099}`` with its
    zero padding, ``{a,b}``), then glob characters; a folder stands for its files of the
    pattern's extension."""
    if Path(spec).is_dir():
        suffix = ".parquet" if layout_of(spec) == PARQUET_LAYOUT else ".tar"
        return sorted(str(p) for p in Path(spec).rglob(f"*{suffix}"))
    found = []
    for name in expand_braces(spec):
        if glob.has_magic(name):
            found += sorted(glob.glob(name))
        elif os.path.isfile(name):
            found.append(name)
        else:
            raise UserError(f"{spec}: {name} does not exist")
    return found


_BRACES = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    inside = match.group(1)
    if ".." in inside:
        first, last = inside.split("..", 1)
        if not (first.isdigit() and last.isdigit()):
            raise UserError(f"{pattern}: a brace range is {{FIRST..LAST}} of numbers")
        width = len(first) if first.startswith("0") else 0
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        choices = inside.split(",")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for choice in choices for name in expand_braces(head + choice + tail)]


def read_class_names(path: str | Path) -> list[str]:
    """Class names one a line, in index order (--class_names, a shard set's classes.txt)."""
    try:
        names = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"class names file {path}: cannot be read ({err})") from None
    if not names:
        raise UserError(f"class names file {path} is empty; expected one class name a line")
    if len(set(names)) != len(names):
        raise UserError(f"class names file {path} names a class twice")
    return names


def labels_of(values: list[Any], names: list[str] | None, source: str) -> tuple[list[str], list]:
    """(class names, label indices) of raw labels: with ``names``, each a name or an index into
    them; without, the classes are the sorted set of the names (as a folder's class folders)."""
    if names is None:
        if any(not isinstance(v, str) for v in values):
            raise UserError(
                f"{source}: the labels are class indices; give their names with --class_names "
                "FILE (one name a line, in index order)"
            )
        names = sorted(set(values))
    index = {name: i for i, name in enumerate(names)}
    labels = []
    for row, value in enumerate(values):
        label = index.get(value) if isinstance(value, str) else None
        if label is None and (isinstance(value, int) or str(value).strip().isdigit()):
            label = int(value) if 0 <= int(value) < len(names) else None
        if label is None:
            raise UserError(
                f"{source}: the label {value!r} of row {row} is not one of the "
                f"{len(names)} class names ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            )
        labels.append(label)
    return names, labels


# ----------------------------------------------------------------------------- a folder


def folder_table(root: Path, role: str, names: list[str] | None, threads: int = 4) -> ImageTable:
    """ImageFolder's listing (``names`` fixes the labels, as a checkpoint's classes), each
    class folder walked in its own thread."""
    names = names or find_classes(root, role)

    def walk(name: str) -> list[tuple[str, Strings]]:
        # Each folder's names become compact arrays at once: a million names never live as
        # Python strings together (their memory would stay with the process).
        return [
            (where, Strings.of([f for f in sorted(files) if is_image_file(f)]))
            for where, _, files in sorted(os.walk(root / name, followlinks=True))
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


# ----------------------------------------------------------------------------- a list file


def list_table(path: Path, names: list[str] | None) -> ImageTable:
    """A ``.csv``/``.tsv`` with a header holding ``path`` and ``label``; relative paths are
    relative to the list file's folder."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            header = reader.fieldnames or []
            missing = [c for c in ("path", "label") if c not in header]
            if missing:
                raise UserError(
                    f"list file {path}: no {' or '.join(repr(c) for c in missing)} column in "
                    f"its header (found: {', '.join(header) or 'nothing'}); expected a header "
                    "line with path and label"
                )
            entries = [(row["path"], row["label"]) for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"list file {path}: cannot be read ({err})") from None
    names, labels = labels_of([label for _, label in entries], names, f"list file {path}")
    folder = str(path.parent)
    rows: dict[str, list] = {"containers": [], "container": [], "members": [], "labels": labels}
    seen: dict[str, int] = {}
    for name, _ in entries:
        where, member = os.path.split(os.path.join(folder, name))
        rows["container"].append(seen.setdefault(where, len(seen)))
        rows["members"].append(member)
    rows["containers"] = list(seen)
    return ImageTable.build(FILES, str(path), names, rows)


# ----------------------------------------------------------------------------- Parquet


def hub_class_names(schema: Any, column: str) -> list[str] | None:
    """The names of a Hugging Face ``datasets`` ClassLabel column, from the schema's metadata."""
    try:
        info = json.loads((schema.metadata or {})[b"huggingface"])
        feature = info["info"]["features"][column]
        return list(feature["names"]) if feature.get("_type") == "ClassLabel" else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def check_parquet_schema(path: str, schema: Any) -> None:
    """An ``image`` column of bytes or ``{bytes, path}`` structs and a ``label`` column."""
    import pyarrow as pa

    columns = ", ".join(schema.names)
    if "image" not in schema.names or "label" not in schema.names:
        missing = [c for c in ("image", "label") if c not in schema.names]
        raise UserError(
            f"Parquet file {path}: no {' or '.join(repr(c) for c in missing)} column "
            f"(columns: {columns}); expected image (bytes or {{bytes, path}}) and label"
        )
    kind = schema.field("image").type
    if pa.types.is_struct(kind):
        kind = kind.field("bytes").type if kind.get_field_index("bytes") >= 0 else None
    if kind is None or not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise UserError(
            f"Parquet file {path}: its image column is {schema.field('image').type}, not image "
            "bytes or a {bytes, path} struct"
        )
    label = schema.field("label").type
    if not (pa.types.is_integer(label) or pa.types.is_string(label)):
        raise UserError(f"Parquet file {path}: its label column is {label}, not a name or index")


def parquet_table(spec: str, names: list[str] | None, fallback: list[str] | None) -> ImageTable:
    """Parquet files (one, a folder of them, a pattern); only the label column is read here."""
    import pyarrow.parquet as pq

    files = expand_pattern(spec)
    if not files:
        raise UserError(f"{spec}: no Parquet file found")
    labels: list = []
    rows: dict[str, list] = {"containers": files, "container": [], "offsets": []}
    for n, file in enumerate(files):
        try:
            schema = pq.read_schema(file)
            check_parquet_schema(file, schema)
            values = pq.read_table(file, columns=["label"]).column(0).to_pylist()
        except UserError:
            raise
        except Exception as err:  # pyarrow's errors for a damaged or foreign file
            raise UserError(f"Parquet file {file}: cannot be read ({err})") from None
        names = names or hub_class_names(schema, "label")
        labels += values
        rows["container"] += [n] * len(values)
        rows["offsets"] += range(len(values))
    names, rows["labels"] = labels_of(labels, names or fallback, spec)
    return ImageTable.build(PARQUET, spec, names, rows)


# ----------------------------------------------------------------------------- a run's data


def open_table(
    spec: str,
    role: str,
    names: list[str] | None = None,
    index_dir: Path | None = None,
    threads: int = 4,
    fallback: list[str] | None = None,
) -> ImageTable:
    """The table of ``spec`` in its layout (``layout_of``), labelled by ``names`` when given,
    else by the names the layout holds (a shard set's classes.txt, a Parquet file's ClassLabel),
    else by ``fallback`` (the training classes, for the validation data)."""
    from imgtrainer.data.shards import shard_table

    layout = layout_of(spec)
    if layout == FOLDER:
        return folder_table(Path(spec), role, names or fallback, threads)
    if layout == LIST:
        if not Path(spec).is_file():
            raise UserError(f"{role} list file {spec} does not exist")
        return list_table(Path(spec), names or fallback)
    if layout == PARQUET_LAYOUT:
        return parquet_table(spec, names, fallback)
    return shard_table(spec, names, fallback, index_dir, threads)


def describe(table: ImageTable) -> str:
    """One line for the log: what was read, from where."""
    layout = {FILES: "files", TAR: "tar shards", PARQUET: "Parquet"}[table.kind]
    if table.kind == FILES:
        layout = "a list file" if layout_of(table.source) == LIST else "a folder"
    files = len(table.containers)
    many = f" ({files} file{'s' * (files != 1)})" if table.kind != FILES else ""
    return f"{len(table)} images in {len(table.classes)} classes from {layout} {table.source}{many}"


def open_datasets(
    train: str,
    val: str,
    class_names_file: str = "",
    index_dir: Path | None = None,
    threads: int = 4,
) -> tuple[ImageTable, ImageTable]:
    """The training and validation tables, with the same classes (both folders: the same class
    folders, as always); the validation labels follow the training classes."""
    given = read_class_names(class_names_file) if class_names_file else None
    if layout_of(train) == FOLDER and layout_of(val) == FOLDER:
        from imgtrainer.data.checks import check_data_folders

        names = check_data_folders(Path(train), Path(val))
        tables = (
            folder_table(Path(train), "training", names, threads),
            folder_table(Path(val), "validation", names, threads),
        )
        return_free_memory()
        return tables
    if layout_of(train) == FOLDER and not Path(train).is_dir():
        raise UserError(f"training data {train} does not exist (a folder, list, Parquet or shards)")
    train_table = open_table(train, "training", given, index_dir, threads)
    if layout_of(val) == FOLDER:
        theirs = find_classes(Path(val), "validation")
        if theirs != train_table.classes:
            raise UserError(
                f"the classes of {train} and the class folders of {val} differ: "
                + class_difference(train_table.classes, theirs, ("training", "validation"))
            )
    val_table = open_table(val, "validation", given, index_dir, threads, train_table.classes)
    if val_table.classes != train_table.classes:
        raise UserError(
            f"the classes of {train} and {val} differ: "
            + class_difference(train_table.classes, val_table.classes, ("training", "validation"))
        )
    return_free_memory()
    return train_table, val_table
