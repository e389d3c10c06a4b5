"""Parquet files in the Hugging Face Hub's layout as a table of ``PARQUET`` rows.

An image column of bytes, ``{bytes, path}`` (a path alone is read from its file, relative to the
Parquet file's folder) or paths, and a label column (``image``/``img`` and ``label``/``labels``
unless --image_column / --label_column say); each image is read from its row group on demand.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from imgtrainer.data.layouts.names import PLAIN, Reading, expand_pattern, labels_of
from imgtrainer.data.layouts.table import ImageTable, RowKind
from imgtrainer.errors import UserError
from imgtrainer.storage import LOCAL, Store, is_url, join, parent, row_may_name

# The columns a Parquet file's image and label are looked for in, in order, when not chosen.
IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "labels")


class ParquetRows(RowKind):
    """A row is row ``offsets[i]`` of a Parquet file, in its row group ``sizes[i]``, its image
    in the table's ``column``."""

    name = "parquet"

    def location(self, table: ImageTable, i: int) -> str:
        return f"{table.containers[int(table.container[i])]}[row {int(table.offsets[i])}]"

    def read(self, table: ImageTable, i: int) -> bytes:
        path, row = table.containers[int(table.container[i])], int(table.offsets[i])
        value = _ROW_GROUPS.cell(table.store, path, table.column, row, int(table.sizes[i]))
        return image_bytes(value, f"{path}[row {row}]", parent(path), table.store)

    def groups(self, table: ImageTable) -> np.ndarray:
        return (table.container.astype(np.int64) << 32) | table.sizes

    def pieces(self, table: ImageTable, rows: np.ndarray) -> list[tuple[str, int, int]]:
        """The bytes of the image column in the row group of ``rows``, as pyarrow reads them."""
        path = table.containers[int(table.container[rows[0]])]
        group = _ROW_GROUPS.metadata(table.store, path)[0].row_group(int(table.sizes[rows[0]]))
        chunks = [group.column(c) for c in range(group.num_columns)]
        spans = [
            (c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset, c)
            for c in chunks
            if c.path_in_schema.split(".")[0] == table.column
        ]
        start, end = min(s for s, _ in spans), max(s + c.total_compressed_size for s, c in spans)
        return [(path, start, end - start)]


PARQUET = ParquetRows()


class ParquetRowGroups:
    """Parquet images read a row group at a time, on demand, the last few groups kept per
    process (each loader worker has its own): never the whole file per worker. Threads (the
    decode check, the image cache, the read-ahead) share it; each reads its group with a file
    of its own, outside the lock, so reads from an object store overlap."""

    KEPT_GROUPS = 4

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # a new one in a forked worker: never one held at the fork
        self.files: dict[str, tuple[Any, np.ndarray]] = {}  # path -> (metadata, group starts)
        self.groups: dict[tuple[str, str, int], Any] = {}

    def metadata(self, store: Store, path: str) -> tuple[Any, np.ndarray]:
        """The file's metadata, and the first row of each row group."""
        import pyarrow.parquet as pq

        if self.pid != os.getpid():  # a forked worker: its own files and groups
            self.__init__()
        with self.lock:
            known = self.files.get(path)
        if known is None:
            with opened(store, path) as source:
                meta = pq.ParquetFile(source).metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            known = (meta, np.cumsum([0, *sizes]))
            with self.lock:
                self.files[path] = known
        return known

    def cell(self, store: Store, path: str, column: str, row: int, group: int) -> Any:
        """``column`` of ``row``, in row group ``group``, of the Parquet file at ``path``."""
        import pyarrow.parquet as pq

        meta, starts = self.metadata(store, path)
        key = (path, column, group)
        with self.lock:
            values = self.groups.get(key)
        if values is None:
            with opened(store, path) as source:
                values = pq.ParquetFile(source, metadata=meta).read_row_group(
                    group, columns=[column]
                )
            values = values.column(0)
            with self.lock:
                if len(self.groups) >= self.KEPT_GROUPS:
                    self.groups.pop(next(iter(self.groups)))
                self.groups[key] = values
        return values[row - int(starts[group])].as_py()


def image_bytes(value: Any, where: str, folder: str = "", store: Store = LOCAL) -> bytes:
    """The encoded image of a Parquet cell: plain bytes, the Hub's ``{bytes, path}`` (a path
    alone read from its file, relative to ``folder``, the Parquet file's), or a path."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str) and value:
        location = join(folder, value)
        if not row_may_name(folder or ".", location):  # never a request a hostile row names
            raise OSError(f"{where} names {value!r}: not read (not a file nor this store's)")
        return store.read(location)
    if not isinstance(value, bytes | bytearray) or not value:
        raise OSError(f"{where} holds no image bytes")
    return bytes(value)


_ROW_GROUPS = ParquetRowGroups()


def hub_class_names(schema: Any, column: str) -> list[str] | None:
    """The names of a Hugging Face ``datasets`` ClassLabel column, from the schema's metadata."""
    try:
        info = json.loads((schema.metadata or {})[b"huggingface"])
        feature = info["info"]["features"][column]
        return list(feature["names"]) if feature.get("_type") == "ClassLabel" else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def choose_columns(path: str, schema: Any, reading: Reading) -> tuple[str, str]:
    """(image column, label column): those chosen, else the first of the usual names there."""
    names = schema.names
    image = reading.image_column or next((c for c in IMAGE_COLUMNS if c in names), "")
    label = reading.label_column or next((c for c in LABEL_COLUMNS if c in names), "")
    missing = [
        f"{what} column {' or '.join(repr(c) for c in ([chosen] if chosen else usual))}"
        for what, chosen, usual in (
            ("image", image, IMAGE_COLUMNS),
            ("label", label, LABEL_COLUMNS),
        )
        if chosen not in names
    ]
    if missing:
        raise UserError(
            f"Parquet file {path}: no {' and no '.join(missing)} (columns: {', '.join(names)}); "
            "choose them with --image_column / --label_column"
        )
    return image, label


def check_parquet_schema(path: str, schema: Any, image: str, label: str) -> None:
    """An image column of bytes, ``{bytes, path}`` structs or paths, a label column of names
    or indices."""
    import pyarrow as pa

    kind = schema.field(image).type
    fields = {kind.field(k).name: kind.field(k).type for k in range(kind.num_fields)} if (
        pa.types.is_struct(kind)
    ) else {"": kind}  # fmt: skip
    readable = any(
        pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
        for name, t in fields.items()
        if name in ("", "bytes", "path")
    )
    if not readable:
        raise UserError(
            f"Parquet file {path}: its image column {image!r} is {kind}, not image bytes, a "
            "{bytes, path} struct or a path; choose another with --image_column"
        )
    kind = schema.field(label).type
    if not (pa.types.is_integer(kind) or pa.types.is_string(kind)):
        raise UserError(
            f"Parquet file {path}: its label column {label!r} is {kind}, not a name or index; "
            "choose another with --label_column"
        )


def check_first_image(path: str, file: Any, image: str, store: Store) -> None:
    """The first row's image is bytes, or a path that exists: where a Parquet file names its
    images by path, a wrong folder is one line at start, not every image unreadable."""
    import pyarrow as pa

    if file.metadata.num_rows == 0:
        return
    kind = file.schema_arrow.field(image).type
    if pa.types.is_struct(kind):
        if kind.get_field_index("path") < 0:
            return
        if kind.get_field_index("bytes") >= 0 and holds_bytes(file.metadata, f"{image}.bytes"):
            return
        first = file.read_row_group(0, columns=[f"{image}.path"]).column(0)[0].as_py()
        first = (first or {}).get("path")
    elif pa.types.is_string(kind):
        first = file.read_row_group(0, columns=[image]).column(0)[0].as_py()
    else:
        return
    if not first:
        raise UserError(f"Parquet file {path}: row 0's {image!r} holds neither bytes nor a path")
    where = join(parent(path), first)
    if not store.exists(where):
        raise UserError(
            f"Parquet file {path}: row 0's image {where} does not exist (the {image!r} column "
            "holds paths; a relative one is read from the Parquet file's folder)"
        )


def holds_bytes(meta: Any, column: str) -> bool:
    """Whether the first row group's ``column`` holds any bytes, from its statistics (no
    image read); True when they do not say."""
    group = meta.row_group(0)
    for c in range(group.num_columns):
        chunk = group.column(c)
        if chunk.path_in_schema == column:
            stats = chunk.statistics
            return stats is None or not stats.has_null_count or stats.null_count < group.num_rows
    return True


@contextlib.contextmanager
def opened(store: Store, path: str) -> Iterator[Any]:
    """What pyarrow opens: a local path as it is, an object as a ranged, cached file."""
    if not is_url(path):
        yield path
        return
    with store.ranged(path) as file:
        yield file


def parquet_table(
    spec: str, names: list[str] | None, fallback: list[str] | None, reading: Reading = PLAIN
) -> ImageTable:
    """Parquet files (one, a folder of them, a pattern); only the label column is read here."""
    import pyarrow.parquet as pq

    store = reading.store
    files = expand_pattern(spec, ".parquet", store)
    if not files:
        raise UserError(f"{spec}: no Parquet file found")
    labels: list = []
    rows: dict[str, list] = {"containers": files, "container": [], "offsets": [], "sizes": []}
    image = ""
    for n, file in enumerate(files):
        try:
            with opened(store, file) as source:
                parquet = pq.ParquetFile(source)
                schema = parquet.schema_arrow
                image, label = choose_columns(file, schema, reading)
                check_parquet_schema(file, schema, image, label)
                if n == 0:
                    check_first_image(file, parquet, image, store)
                values = parquet.read(columns=[label]).column(0).to_pylist()
        except UserError:
            raise
        except Exception as err:  # pyarrow's errors for a damaged or foreign file
            raise UserError(f"Parquet file {file}: cannot be read ({err})") from None
        names = names or hub_class_names(schema, label)
        labels += values
        rows["container"] += [n] * len(values)
        rows["offsets"] += range(len(values))
        meta = parquet.metadata
        rows["sizes"] += [
            g for g in range(meta.num_row_groups) for _ in range(meta.row_group(g).num_rows)
        ]
    names, rows["labels"] = labels_of(labels, names or fallback, spec)
    return ImageTable.build(PARQUET, spec, names, rows, column=image, store=store)
