"""How the data flags are read: the store that reaches their URLs (--storage_options, the byte
cache of --remote_cache_gb) and the columns chosen. No torch here: the launcher's checks use it."""

from __future__ import annotations

from pathlib import Path

from imgtrainer.config import TrainConfig
from imgtrainer.data.layouts.names import Reading
from imgtrainer.storage import Store

CACHE_FOLDER = "remote_cache"  # in --log_dir: the bytes read from object storage


def data_reading(cfg: TrainConfig) -> Reading:
    """How --train_data / --val_data are read: the store of their URLs (--storage_options, the
    byte cache of --remote_cache_gb in <log_dir>/remote_cache) and the columns chosen."""
    store = Store(
        options=cfg.storage_options,
        cache_dir=str(Path(cfg.log_dir).absolute() / CACHE_FOLDER),
        cache_bytes=int(cfg.remote_cache_gb * 2**30),
    )
    return Reading(store, cfg.image_column, cfg.label_column)
