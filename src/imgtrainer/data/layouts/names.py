"""Names in a layout: file patterns with braces and globs (on a disk or in a bucket),
class-name files, labels as names or indices, the columns chosen."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imgtrainer.errors import UserError
from imgtrainer.storage import LOCAL, Store, is_url


@dataclass(frozen=True)
class Reading:
    """How a data flag's files are read beyond their names: the ``store`` that reaches them,
    the columns holding the image and the label (--image_column / --label_column; "": the
    layout's own names), where shard indices are kept when not beside their shards
    (``index_dir``), and the ``threads`` (or processes) that read a folder or scan shards."""

    store: Store = LOCAL
    image_column: str = ""
    label_column: str = ""
    index_dir: Path | None = None
    threads: int = 4


PLAIN = Reading()


def expand_pattern(spec: str, suffix: str, store: Store = LOCAL) -> list[str]:
    """The files a shard or Parquet pattern names: braces first (``{000000..000099}`` with its
    zero padding, ``{a,b}``), then glob characters; a folder stands for its files ending in
    ``suffix``. A URL is listed in the store (one listing per folder)."""
    if is_url(spec):
        return expand_url(spec, suffix, store)
    if Path(spec).is_dir():
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


_LISTED: dict[str, list[str]] = {}  # a URL folder's objects, listed once per process


def url_folder(spec: str, store: Store) -> list[str]:
    """The objects under a URL folder (``spec``), listed once per process: its layout and its
    files come from the same listing."""
    if spec not in _LISTED:
        _LISTED[spec] = store.listing(spec, recursive=True)
    return _LISTED[spec]


def expand_url(spec: str, suffix: str, store: Store) -> list[str]:
    names = expand_braces(spec)
    if len(names) == 1 and not glob.has_magic(spec) and not spec.endswith(suffix):
        return [url for url in url_folder(spec, store) if url.endswith(suffix)]
    found, named = [], []
    for name in names:
        if glob.has_magic(name):
            found += store.glob(name)
        else:
            named.append(name)
            found.append(name)
    store.files_named(named)
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


def read_class_names(path: str | Path, text: str | None = None) -> list[str]:
    """Class names one a line, in index order (--class_names, a shard set's classes.txt);
    ``text``: the file's, already read (from an object store)."""
    try:
        text = Path(path).read_text() if text is None else text
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"class names file {path}: cannot be read ({err})") from None
    names = [line.strip() for line in text.splitlines() if line.strip()]
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
