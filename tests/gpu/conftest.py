"""The data sets the CUDA checks share, each written once per session when a check needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.harness import write_split_folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """3 classes of 32 training and 8 validation images of 40 px: 6 steps of 16 per epoch."""
    return write_split_folder(tmp_path_factory.mktemp("tiny"), 3, 32, 8, 40)


@pytest.fixture(scope="session")
def mid_data(tmp_path_factory) -> Path:
    """3 classes of 160 training and 16 validation images of 128 px: 30 steps of 16."""
    return write_split_folder(tmp_path_factory.mktemp("mid"), 3, 160, 16, 128)


@pytest.fixture(scope="session")
def photo_data(tmp_path_factory) -> Path:
    """2 classes of 96 training and 8 validation photo-like JPEGs of mixed aspect, short side
    500 px or more, one 4:1 panorama: 3 steps of 64 at 224 px."""
    return write_split_folder(tmp_path_factory.mktemp("photos"), 2, 96, 8, 500, photos=True)
