"""Parquet files in the Hugging Face Hub's layout as a table of ``PARQUET`` rows.

An ``image`` column of bytes or ``{bytes, path}``, a ``label`` column; each image is read from
its row group on demand.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np

from imgtrainer.data.layouts.names import expand_pattern, labels_of
from imgtrainer.data.layouts.table import ImageTable, RowKind
from imgtrainer.errors import UserError


class ParquetRows(RowKind):
    """A row is row ``offsets[i]`` of a Parquet file, its image in the table's ``column``."""

    name = "parquet"

    def location(self, table: ImageTable, i: int) -> str:
        return f"{table.containers[int(table.container[i])]}[row {int(table.offsets[i])}]"

    def read(self, table: ImageTable, i: int) -> bytes:
        path = table.containers[int(table.container[i])]
        return _ROW_GROUPS.read(path, table.column, int(table.offsets[i]))


PARQUET = ParquetRows()


class ParquetRowGroups:
    """Parquet images read a row group at a time, on demand, the last few groups kept per
    process (each loader worker has its own): never the whole file per worker. Threads (the
    decode check, the image cache) share it under a lock; they decode outside it."""

    KEPT_GROUPS = 4

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # a new one in a forked worker: never one held at the fork
        self.files: dict[str, Any] = {}
        self.starts: dict[str, np.ndarray] = {}
        self.groups: dict[tuple[str, str, int], Any] = {}

    def read(self, path: str, column: str, row: int) -> bytes:
        if self.pid != os.getpid():  # a forked worker: its own files and groups
            self.__init__()
        with self.lock:
            value = self._cell(path, column, row)
        return image_bytes(value, f"{path}[row {row}]")

    def _cell(self, path: str, column: str, row: int) -> Any:
        if path not in self.files:
            import pyarrow.parquet as pq

            file = pq.ParquetFile(path)
            meta = file.metadata
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self.files[path] = file
            self.starts[path] = np.cumsum([0, *sizes])
        starts = self.starts[path]
        group = int(np.searchsorted(starts, row, side="right")) - 1
        key = (path, column, group)
        if key not in self.groups:
            if len(self.groups) >= self.KEPT_GROUPS:
                self.groups.pop(next(iter(self.groups)))
            self.groups[key] = self.files[path].read_row_group(group, columns=[column]).column(0)
        return self.groups[key][row - int(starts[group])].as_py()


def image_bytes(value: Any, where: str) -> bytes:
    """The encoded image of a Parquet cell: plain bytes, or the Hub's ``{bytes, path}``."""
    if isinstance(value, dict):
        value = value.get("bytes")
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

    files = expand_pattern(spec, ".parquet")
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
