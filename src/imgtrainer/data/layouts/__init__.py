"""Storage in, an ``ImageTable`` out: the layout a data flag names and the run's two tables.

Which layout a ``--train_data`` / ``--val_data`` value names (a folder, a list file, Parquet,
tar shards), its reader, and the training and validation tables with the same classes; any
problem is one ``UserError`` line.
"""

from __future__ import annotations

from pathlib import Path

from imgtrainer.data.layouts.files import folder_table, list_table
from imgtrainer.data.layouts.folder_checks import check_data_folders, class_difference, find_classes
from imgtrainer.data.layouts.names import read_class_names
from imgtrainer.data.layouts.parquet import parquet_table
from imgtrainer.data.layouts.shards import shard_table
from imgtrainer.data.layouts.table import ImageTable
from imgtrainer.errors import UserError
from imgtrainer.process import return_free_memory

# The layouts a data flag can name. A folder and a list file both give tables of files.
FOLDER, LIST, PARQUET, SHARDS = "folder", "list", "Parquet", "tar shards"


def layout_of(spec: str) -> str:
    """Which layout ``spec`` (a --train_data / --val_data value) names, from its form alone."""
    name = spec.lower()
    if name.endswith((".csv", ".tsv")):
        return LIST
    if name.endswith(".parquet"):
        return PARQUET
    if name.endswith(".tar"):
        return SHARDS
    path = Path(spec)
    if path.is_dir() and not any(p.is_dir() for p in path.iterdir()):
        if any(path.glob("*.parquet")):
            return PARQUET
        if any(path.glob("*.tar")):
            return SHARDS
    return FOLDER


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
    layout = layout_of(spec)
    if layout == FOLDER:
        return folder_table(Path(spec), role, names or fallback, threads)
    if layout == LIST:
        if not Path(spec).is_file():
            raise UserError(f"{role} list file {spec} does not exist")
        return list_table(Path(spec), names or fallback)
    if layout == PARQUET:
        return parquet_table(spec, names, fallback)
    return shard_table(spec, names, fallback, index_dir, threads)


def describe(table: ImageTable) -> str:
    """One line for the log: what was read, from where."""
    layout = layout_of(table.source)
    named = {FOLDER: "a folder", LIST: "a list file"}.get(layout, layout)
    files = len(table.containers)
    many = f" ({files} file{'s' * (files != 1)})" if layout in (PARQUET, SHARDS) else ""
    return f"{len(table)} images in {len(table.classes)} classes from {named} {table.source}{many}"


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
