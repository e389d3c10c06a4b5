"""Storage in, an ``ImageTable`` out: the layout a data flag names and the run's two tables.

Which layout a ``--train_data`` / ``--val_data`` value names (a folder, a list file, Parquet,
tar shards; a list, Parquet or shards also as URLs of an object store), its reader, and the
training and validation tables with the same classes; any problem is one ``UserError`` line.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from imgtrainer.data.layouts.files import folder_table, list_table
from imgtrainer.data.layouts.folder_checks import check_data_folders, class_difference, find_classes
from imgtrainer.data.layouts.names import PLAIN, Reading, read_class_names, url_folder
from imgtrainer.data.layouts.parquet import parquet_table
from imgtrainer.data.layouts.shards import shard_table
from imgtrainer.data.layouts.table import ImageTable
from imgtrainer.errors import UserError
from imgtrainer.process import return_free_memory
from imgtrainer.storage import LOCAL, Store, is_url

# The layouts a data flag can name. A folder and a list file both give tables of files.
FOLDER, LIST, PARQUET, SHARDS = "folder", "list", "Parquet", "tar shards"


def layout_of(spec: str, store: Store = LOCAL) -> str:
    """Which layout ``spec`` (a --train_data / --val_data value) names, from its form (a
    folder: from what it holds; in an object store, one listing)."""
    name = spec.lower()
    if name.endswith((".csv", ".tsv")):
        return LIST
    if name.endswith(".parquet"):
        return PARQUET
    if name.endswith(".tar"):
        return SHARDS
    if is_url(spec):
        return url_folder_layout(spec, store)
    path = Path(spec)
    if path.is_dir() and not any(p.is_dir() for p in path.iterdir()):
        if any(path.glob("*.parquet")):
            return PARQUET
        if any(path.glob("*.tar")):
            return SHARDS
    return FOLDER


def url_folder_layout(spec: str, store: Store) -> str:
    """Parquet or shards, by what an object store holds under ``spec`` (``url_folder``): a
    folder of class folders is read from a disk only."""
    found = url_folder(spec, store)
    if any(url.endswith(".parquet") for url in found):
        return PARQUET
    if any(url.endswith(".tar") for url in found):
        return SHARDS
    raise UserError(
        f"{spec} holds no .parquet or .tar files: from object storage, train on Parquet, "
        "tar shards or a list file of image URLs (class folders are read from a disk)"
    )


def open_table(
    spec: str,
    role: str,
    names: list[str] | None = None,
    fallback: list[str] | None = None,
    reading: Reading = PLAIN,
) -> ImageTable:
    """The table of ``spec`` in its layout (``layout_of``), labelled by ``names`` when given,
    else by the names the layout holds (a shard set's classes.txt, a Parquet file's ClassLabel),
    else by ``fallback`` (the training classes, for the validation data); ``reading``: the
    store, the columns chosen, the index folder and the threads."""
    layout = layout_of(spec, reading.store)
    if layout == FOLDER:
        return folder_table(Path(spec), role, names or fallback, reading.threads)
    if layout == LIST:
        if not reading.store.is_file(spec):
            raise UserError(f"{role} list file {spec} does not exist")
        return list_table(spec, names or fallback, reading)
    if layout == PARQUET:
        return parquet_table(spec, names, fallback, reading)
    return shard_table(spec, names, fallback, reading)


def table_facts(table: ImageTable) -> dict[str, str | int]:
    """What was read, from where (an event's fields)."""
    layout, files = layout_of(table.source, table.store), len(table.containers)
    return {"layout": layout, "images": len(table), "classes": len(table.classes), "files": files}


def describe(table: ImageTable, facts: dict) -> str:
    """One line for the log: what was read (``table_facts``), from where."""
    layout, files = facts["layout"], facts["files"]
    named = {FOLDER: "a folder", LIST: "a list file"}.get(layout, layout)
    many = f" ({files} file{'s' * (files != 1)})" if layout in (PARQUET, SHARDS) else ""
    return f"{len(table)} images in {len(table.classes)} classes from {named} {table.source}{many}"


def open_datasets(
    train: str,
    val: str,
    class_names_file: str = "",
    index_dir: Path | None = None,
    threads: int = 4,
    reading: Reading = PLAIN,
) -> tuple[ImageTable, ImageTable]:
    """The training and validation tables, with the same classes (both folders: the same class
    folders, as always); the validation labels follow the training classes. ``reading``: the
    store (for URLs) and the columns chosen."""
    given = read_class_names(class_names_file) if class_names_file else None
    store = reading.store
    reading = replace(reading, index_dir=index_dir, threads=threads)
    if layout_of(train, store) == FOLDER and layout_of(val, store) == FOLDER:
        names = check_data_folders(Path(train), Path(val))
        tables = (
            folder_table(Path(train), "training", names, threads),
            folder_table(Path(val), "validation", names, threads),
        )
        return_free_memory()
        return tables
    if layout_of(train) == FOLDER and not Path(train).is_dir():
        raise UserError(f"training data {train} does not exist (a folder, list, Parquet or shards)")
    early = None  # one store, probed first: the validation data's round trips beside these
    if is_url(train) and is_url(val) and train.partition("://")[0] == val.partition("://")[0]:
        store.connect(train)
        early = ThreadPoolExecutor(1).submit(open_table, val, "validation", given, None, reading)
    train_table = open_table(train, "training", given, reading=reading)
    if layout_of(val, store) == FOLDER:
        theirs = find_classes(Path(val), "validation")
        if theirs != train_table.classes:
            raise UserError(
                f"the classes of {train} and the class folders of {val} differ: "
                + class_difference(train_table.classes, theirs, ("training", "validation"))
            )
    if early is not None and early.exception() is None:  # labelled by class names of its own
        val_table = early.result()
    else:  # else by the training classes, or the one line of what is wrong
        val_table = open_table(val, "validation", given, train_table.classes, reading)
    if val_table.classes != train_table.classes:
        raise UserError(
            f"the classes of {train} and {val} differ: "
            + class_difference(train_table.classes, val_table.classes, ("training", "validation"))
        )
    return_free_memory()
    return train_table, val_table
