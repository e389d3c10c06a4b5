"""TensorBoardLogger on its own: what it writes, read back with TensorBoard's own event reader.

The last test runs the trainer: a 2-process run writes the events once (a run restarted after a
crash continues the curves without duplicate steps: test_resume's SIGKILL test).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams import metadata as hparams_metadata  # noqa: E402

from imgtrainer.reports.tensorboard import SUBDIR, TensorBoardLogger, image_grid  # noqa: E402

STEP_METRICS = ("loss", "lr", "images_per_sec", "data_wait_share")


def read_events(log_dir: Path, purge: bool = True) -> EventAccumulator:
    """Everything in <log_dir>/tensorboard as TensorBoard's Python loader loads it; with
    ``purge=False`` ignoring restart markers, like TensorBoard's Rust data server (the default
    loader of ``tensorboard --logdir``): what the files themselves hold."""
    acc = EventAccumulator(
        str(log_dir / SUBDIR),
        purge_orphaned_data=purge,
        size_guidance={"scalars": 0, "images": 0, "tensors": 0},
    )
    acc.Reload()
    return acc


def steps_and_values(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def log_steps(logger: TensorBoardLogger, steps: range, offset: float = 0.0) -> None:
    for step in steps:
        logger.add_step_metrics(
            step,
            {"loss": offset + step, "lr": 0.1, "images_per_sec": 300.0, "data_wait_share": 0.05},
        )


def test_step_and_epoch_scalars_are_written(tmp_path: Path):
    logger = TensorBoardLogger(tmp_path, enabled=True, purge_step=0)
    log_steps(logger, range(1, 5))
    record = {
        "epoch": 1,
        "train_loss": 0.9,
        "val_acc": 0.5,
        "val_acc_ema": 0.55,
        "micro_batch": 8,
        "note": "not a number",
        "missing": None,
    }
    logger.add_epoch_record(4, record)
    logger.close()

    acc = read_events(tmp_path)
    for name in STEP_METRICS:
        assert [s for s, _ in steps_and_values(acc, f"train/{name}")] == [1, 2, 3, 4]
    assert steps_and_values(acc, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    # Every numeric field, future ones (EMA) included, at the global step of the epoch's end.
    assert steps_and_values(acc, "epoch/val_acc_ema") == [(4, 0.55)]
    assert steps_and_values(acc, "epoch/epoch") == [(4, 1.0)]
    assert steps_and_values(acc, "epoch/micro_batch") == [(4, 8.0)]
    epoch_tags = {t for t in acc.Tags()["scalars"] if t.startswith("epoch/")}
    assert epoch_tags == {
        "epoch/epoch",
        "epoch/train_loss",
        "epoch/val_acc",
        "epoch/val_acc_ema",
        "epoch/micro_batch",
    }


def test_epoch_end_flushes_without_close(tmp_path: Path):
    """A run killed after an epoch still has that epoch's curves on disk."""
    logger = TensorBoardLogger(tmp_path, enabled=True)
    log_steps(logger, range(1, 3))
    logger.add_epoch_record(2, {"epoch": 1, "val_acc": 0.25})
    try:
        acc = read_events(tmp_path)  # read while the writer is still open
        assert steps_and_values(acc, "epoch/val_acc") == [(2, 0.25)]
        assert [s for s, _ in steps_and_values(acc, "train/loss")] == [1, 2]
    finally:
        logger.close()


def test_disabled_logger_writes_nothing(tmp_path: Path):
    logger = TensorBoardLogger(tmp_path, enabled=False, purge_step=0)
    log_steps(logger, range(1, 3))
    logger.add_epoch_record(2, {"epoch": 1, "val_acc": 0.5})
    logger.add_image_grid(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    logger.add_run_end(2, {"lr": 0.1}, {"val_acc": 0.5})
    logger.flush()
    logger.close()
    assert not logger.enabled
    assert list(tmp_path.iterdir()) == []


def test_tensor_metrics_are_refused(tmp_path: Path):
    """Reading a (CUDA) tensor in the logger would sync the GPU; values must come as numbers."""
    with TensorBoardLogger(tmp_path, enabled=True) as logger:
        with pytest.raises(TypeError, match="train_loss.*Python number"):
            logger.add_step_metrics(1, {"train_loss": torch.tensor(0.5)})
        logger.add_step_metrics(1, {"loss": np.float32(0.5), "count": 3})  # numpy/int are fine


def test_resume_purges_steps_after_the_checkpoint(tmp_path: Path):
    """Crashed run wrote steps 1..10 (its checkpoint is at 6); the resumed run writes 6..8."""
    crashed = TensorBoardLogger(tmp_path, enabled=True, purge_step=0)
    log_steps(crashed, range(1, 11), offset=100.0)
    crashed.add_epoch_record(5, {"epoch": 1, "val_acc": 0.1})
    crashed.add_epoch_record(10, {"epoch": 2, "val_acc": 0.2})  # after the checkpoint: stale
    crashed.flush()
    del crashed  # no close(): the process died
    # Event files sort by their creation second; a real restart is seconds later.
    time.sleep(1.1)

    resumed = TensorBoardLogger(tmp_path, enabled=True, purge_step=6)
    log_steps(resumed, range(6, 9), offset=200.0)
    resumed.close()

    # With the restart marker applied, and without it: the stale events are gone from the files.
    for purge in (True, False):
        acc = read_events(tmp_path, purge)
        assert steps_and_values(acc, "train/loss") == [
            (1, 101.0),
            (2, 102.0),
            (3, 103.0),
            (4, 104.0),
            (5, 105.0),
            (6, 206.0),
            (7, 207.0),
            (8, 208.0),
        ]
        for name in STEP_METRICS:
            assert [s for s, _ in steps_and_values(acc, f"train/{name}")] == [
                1,
                2,
                3,
                4,
                5,
                6,
                7,
                8,
            ]
        # The per-epoch series share the step axis, so the same purge removes the stale epoch.
        assert steps_and_values(acc, "epoch/val_acc") == [(5, 0.1)]
    assert len(list((tmp_path / SUBDIR).glob("events.out.tfevents.*"))) == 2
    assert [p.name for p in (tmp_path / SUBDIR).iterdir() if "tfevents" not in p.name] == []


def test_fresh_run_removes_an_older_run_in_the_same_folder(tmp_path: Path):
    old = TensorBoardLogger(tmp_path, enabled=True, purge_step=0)
    log_steps(old, range(1, 6), offset=100.0)
    old.close()
    time.sleep(1.1)
    new = TensorBoardLogger(tmp_path, enabled=True, purge_step=0)
    log_steps(new, range(1, 3), offset=200.0)
    new.close()
    assert steps_and_values(read_events(tmp_path, purge=False), "train/loss") == [
        (1, 201.0),
        (2, 202.0),
    ]
    assert len(list((tmp_path / SUBDIR).glob("events.out.tfevents.*"))) == 1


def test_no_purge_step_leaves_the_folder_alone(tmp_path: Path):
    with TensorBoardLogger(tmp_path, enabled=True, purge_step=0) as old:
        log_steps(old, range(1, 4))
    time.sleep(1.1)
    with TensorBoardLogger(tmp_path, enabled=True, purge_step=None) as new:
        log_steps(new, range(4, 6))
    assert [s for s, _ in steps_and_values(read_events(tmp_path), "train/loss")] == [1, 2, 3, 4, 5]


def test_hparams_in_the_run_folder(tmp_path: Path):
    config = {
        "learning_rate": 0.003,
        "batch_size": 64,
        "use_amp": True,
        "model": "resnet18",
        "resume": None,
        "mean": [0.5, 0.5],
    }
    with TensorBoardLogger(tmp_path, enabled=True, purge_step=0) as logger:
        log_steps(logger, range(1, 3))
        logger.add_run_end(2, config, {"best_val_acc": 0.75, "val_loss": 0.5})

    # One run: torch's add_hparams would have added a time-named sub-folder.
    assert [p for p in (tmp_path / SUBDIR).iterdir() if p.is_dir()] == []
    acc = read_events(tmp_path)
    content = acc.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    session = hparams_metadata.parse_session_start_info_plugin_data(
        content[hparams_metadata.SESSION_START_INFO_TAG]
    )
    values = {name: value.WhichOneof("kind") for name, value in session.hparams.items()}
    assert values == {
        "learning_rate": "number_value",
        "batch_size": "number_value",
        "use_amp": "bool_value",
        "model": "string_value",
        "resume": "string_value",
        "mean": "string_value",
    }
    assert session.hparams["learning_rate"].number_value == pytest.approx(0.003)
    assert session.hparams["use_amp"].bool_value is True
    assert session.hparams["resume"].string_value == "None"
    assert session.hparams["mean"].string_value == "[0.5, 0.5]"
    experiment = hparams_metadata.parse_experiment_plugin_data(
        content[hparams_metadata.EXPERIMENT_TAG]
    )
    assert sorted(m.name.tag for m in experiment.metric_infos) == [
        "final/best_val_acc",
        "final/val_loss",
    ]
    assert steps_and_values(acc, "final/best_val_acc") == [(2, 0.75)]


def test_image_grid_undoes_normalisation(tmp_path: Path):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pixels = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    normalised = (pixels.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std
    ).view(1, 3, 1, 1)
    with TensorBoardLogger(tmp_path, enabled=True, purge_step=0) as logger:
        logger.add_image_grid(normalised, mean=mean, std=std)
        logger.add_image_grid(pixels, tag="train/raw")

    acc = read_events(tmp_path)
    assert set(acc.Tags()["images"]) == {"train/augmented_images", "train/raw"}
    for tag in ("train/augmented_images", "train/raw"):
        (event,) = acc.Images(tag)
        grid = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        assert grid.shape == (8 + 4, 3 * (8 + 2) + 2, 3)  # 3 images in a row, 2 px padding
        first = torch.from_numpy(grid[2:10, 2:10].copy()).permute(2, 0, 1).int()
        assert (first - pixels[0].int()).abs().max() <= 1  # the original pixels, back


def test_image_grid_limits_and_grey_images():
    grid = image_grid(torch.rand(40, 1, 4, 4), max_images=16)
    assert grid.shape == (3, 2 * (4 + 2) + 2, 8 * (4 + 2) + 2)  # 16 images: 2 rows of 8
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        image_grid(torch.rand(3, 4, 4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logging_never_syncs_the_gpu(tmp_path: Path):
    """With CUDA work in flight, logging numbers (and refusing a CUDA tensor) waits for nothing."""
    x = torch.randn(2048, 2048, device="cuda")
    with TensorBoardLogger(tmp_path, enabled=True, purge_step=0) as logger:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                x = x @ x / 2048  # queued kernels the logger must not wait for
            log_steps(logger, range(1, 4))
            logger.add_epoch_record(3, {"epoch": 1, "val_acc": 0.5})
            with pytest.raises(TypeError, match="Python number"):
                logger.add_step_metrics(4, {"loss": x.sum()})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [s for s, _ in steps_and_values(read_events(tmp_path), "train/loss")] == [1, 2, 3]


# ----------------------------------------------------------------------------- in the trainer


def trainer_flags(train: Path, val: Path) -> list:
    """A tiny run on timm's small ResNet (0.4 M parameters): what is logged does not depend on
    the model, and its steps and checkpoints cost a fraction of resnet18's."""
    from conftest import TINY_FLAGS

    flags = ["--device", "cpu", "--train_dir", train, "--val_dir", val, *TINY_FLAGS]
    return [*flags, "--model", "test_resnet"]


@pytest.mark.slow
def test_a_two_process_run_writes_the_events_once(tiny_dataset, tmp_path: Path):
    from conftest import ROOT, run_cli

    train, val = tiny_dataset
    result = run_cli(
        [ROOT / "launch_ddp.py", "--nproc", "2", *trainer_flags(train, val), "--epochs", "2"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    files = list((tmp_path / "logs" / SUBDIR).glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 alone writes
    acc = read_events(tmp_path / "logs")
    tags = acc.Tags()
    steps_per_epoch = 48 // (8 * 2)  # 48 images, batch 8 on each of 2 ranks
    for name in STEP_METRICS:
        steps = [step for step, _ in steps_and_values(acc, f"train/{name}")]
        assert steps == list(range(1, 2 * steps_per_epoch + 1)), (name, steps)  # log_interval 1
    assert [step for step, _ in steps_and_values(acc, "epoch/val_acc")] == [
        steps_per_epoch,
        2 * steps_per_epoch,
    ]
    assert {"epoch/train_loss", "epoch/val_top5", "epoch/lr"} <= set(tags["scalars"])
    assert all(0.0 <= value <= 1.0 for _, value in steps_and_values(acc, "train/data_wait_share"))
    assert all(value > 0 for _, value in steps_and_values(acc, "train/images_per_sec"))
    assert "train/augmented_images" in tags["images"]
    assert any(tag.endswith("_hparams_/session_start_info") for tag in tags["tensors"]), tags
