"""Images in, augmented batches out: the entrance to ``data``; other rooms import from here.

The floors, in the order the bytes travel: ``layouts`` (storage to a table of where each image
is), ``host`` (one sample in a loader worker), ``device`` (a collated batch to an augmented
batch on the training device); the top builds the loaders from the config (``loaders``) and
decides once where the images live (``image_plan``). A name is imported on first use, so the
launcher and the data tools, which use only torch-free floors, start without torch.
"""

from __future__ import annotations

import importlib

# Each name other rooms use, and the module of this package that holds it.
_EXPORTS = {
    "layouts": ("FOLDER", "layout_of", "open_datasets", "open_table"),
    "layouts.folder_checks": (
        "check_data_folders",
        "check_no_empty_class_folder",
        "class_difference",
        "count_images",
        "find_classes",
    ),
    "layouts.image_files": (
        "IMAGE_EXTENSIONS",
        "class_folders",
        "find_unreadable",
        "is_hidden_folder_name",
        "is_image_file",
        "open_rgb",
        "write_unreadable_list",
    ),
    "layouts.shards": ("keep_index",),
    "layouts.table": ("TableImages",),
    "layouts.decode_check": ("leave_out_unreadable",),
    "host.samples": ("SeededImageDataset", "Source", "own_cpu_rng_state"),
    "host.samplers": ("ShardSampler",),
    "host.transforms": (
        "EVAL_RESIZE_RATIO",
        "IMAGENET_MEAN",
        "IMAGENET_STD",
        "eval_resize_side",
        "eval_transforms",
        "normalize_batch",
    ),
    "device.memory": (
        "augment_bytes_per_image",
        "augment_chunk",
        "canvas_side_bound",
        "staged_bytes",
    ),
    "device.audit": ("audit_summary",),
    "loaders": (
        "LoaderSpec",
        "Loaders",
        "build_loaders",
        "loader_workers",
        "make_loader",
    ),
    "checks": ("check_batch_fits", "check_device_options"),
    "reading": ("data_reading",),
    "balance": ("balanced_class_weights",),
    "demo": ("prepare_demo_data",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return __all__
