"""Images in, augmented batches out: the entrance to ``data``; other rooms import from here.

The floors, in the order the bytes travel: ``layouts`` (storage to a table of where each image
is), ``host`` (one sample in a loader worker), ``device`` (a collated batch to an augmented
batch on the training device); the top builds the loaders from the config (``loaders``) and
decides once where the images live (``image_plan``). A name is imported on first use, so the
launcher and the data tools, which use only torch-free floors, start without torch; the same
imports under ``TYPE_CHECKING`` show static readers where each name lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each name other rooms use, and the module of this package that holds it (``tools`` may also
# import the inner modules themselves).
_EXPORTS = {
    "layouts": ("FOLDER", "layout_of", "open_datasets", "open_table"),
    "layouts.folder_checks": (
        "check_data_folders",
        "class_difference",
        "count_images",
    ),
    "layouts.image_files": ("open_rgb",),
    "host.samples": ("Source", "own_cpu_rng_state"),
    "host.transforms": ("IMAGENET_MEAN", "IMAGENET_STD"),
    "device.memory": (
        "augment_bytes_per_image",
        "augment_chunk",
        "canvas_side_bound",
        "staged_bytes",
    ),
    "device.audit": ("audit_summary",),
    "loaders": ("Loaders", "open_data"),
    "checks": ("check_batch_fits", "check_device_options"),
    "reading": ("data_reading",),
    "balance": ("balanced_class_weights",),
    "demo": ("prepare_demo_data",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)

if TYPE_CHECKING:  # the same names, imported where static readers can follow them
    from imgtrainer.data.balance import balanced_class_weights
    from imgtrainer.data.checks import check_batch_fits, check_device_options
    from imgtrainer.data.demo import prepare_demo_data
    from imgtrainer.data.device.audit import audit_summary
    from imgtrainer.data.device.memory import (
        augment_bytes_per_image,
        augment_chunk,
        canvas_side_bound,
        staged_bytes,
    )
    from imgtrainer.data.host.samples import Source, own_cpu_rng_state
    from imgtrainer.data.host.transforms import IMAGENET_MEAN, IMAGENET_STD
    from imgtrainer.data.layouts import FOLDER, layout_of, open_datasets, open_table
    from imgtrainer.data.layouts.folder_checks import (
        check_data_folders,
        class_difference,
        count_images,
    )
    from imgtrainer.data.layouts.image_files import open_rgb
    from imgtrainer.data.loaders import Loaders, open_data
    from imgtrainer.data.reading import data_reading


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return __all__
