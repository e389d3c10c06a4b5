"""Small pictures of the images a report names, read from their data and inlined as JPEGs.

An image is found by its location: a file's path is opened directly; a tar member or a Parquet
row through its data's table (any layout of --val_data). One that cannot be read shows as a
grey tile with its location: the report never fails for a picture.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from imgtrainer.data import open_rgb, open_table
from imgtrainer.errors import UserError, first_line
from imgtrainer.reports.page.html import data_uri

log = logging.getLogger(__name__)

# Longest side of a picture in the page (it is shown at up to 122 CSS pixels).
THUMBNAIL_SIDE = 128
# A picture smaller than this is enlarged (without smoothing) so its pixels stay visible.
SMALLEST_SIDE = 64

ImageReader = Callable[[str], Image.Image | None]


class DataImages:
    """``ImageReader`` of the images of ``spec`` (a --val_data value): files by their path,
    other layouts through their table, opened on the first image that is not a file."""

    def __init__(
        self, spec: str | None, class_names: list[str] | None = None, table=None, reading=None
    ):
        self.spec, self.class_names, self.reading = spec, class_names, reading
        self._index: dict[str, int] | None = None
        self._table = table  # the data's table, when it is open already

    def __call__(self, location: str) -> Image.Image | None:
        try:
            if Path(location).is_file():
                return open_rgb(location, draft=2 * THUMBNAIL_SIDE)
            table, index = self.table()
            if location not in index:
                return None
            return table.open_rgb(index[location], draft=2 * THUMBNAIL_SIDE)
        except Exception as err:  # a damaged or vanished image: a tile without a picture
            log.debug(f"report: cannot read {location}: {first_line(err)}")
            return None

    def table(self):
        if self._index is None:
            self._index = {}
            if self.spec or self._table is not None:
                try:
                    if self._table is None:
                        chosen = {"reading": self.reading} if self.reading else {}
                        self._table = open_table(
                            self.spec, "validation", self.class_names, **chosen
                        )
                    locate = self._table.location
                    self._index = {locate(i): i for i in range(len(self._table))}
                except (UserError, OSError) as err:
                    log.info(f"report: the images of {self.spec} cannot be read ({err})")
        return self._table, self._index


def thumbnail_uri(image: Image.Image) -> str:
    """The image shrunk to ``THUMBNAIL_SIDE`` (a tiny one enlarged), as a JPEG data URI."""
    image = image.convert("RGB")
    side = max(image.size)
    if side < SMALLEST_SIDE:
        factor = -(-SMALLEST_SIDE // side)
        image = image.resize((image.width * factor, image.height * factor), Image.NEAREST)
    else:
        image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return data_uri(buffer.getvalue(), "image/jpeg")
