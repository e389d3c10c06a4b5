"""The data audit (data.device.audit): an image of the first batches and of every N-th made
again on the CPU reference path from its sample row and compared with what the device half made;
a clean run shows no difference, a corrupted block is named and, repeated, sends the source to
its reference form. And the prefetch's out-of-memory retry: the same batch, made again."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import ONE_CPU_PROCESS, data_config
from imgtrainer.data.device import audit as audit_module
from imgtrainer.data.device.audit import FIRST_BATCHES, Audited, DataAudit, audit_summary
from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.host.sample_row import ROW_WIDTH
from imgtrainer.data.host.samples import Source
from imgtrainer.data.loaders import open_data
from imgtrainer.training.trainer import epoch_audit


def open_data_of(tiny_dataset, **flags):
    train, val = tiny_dataset
    values = {"image_size": 16, "batch_size": 4, "seed": 3, "num_workers": 0, **flags}
    return open_data(data_config(train, val, **values), ONE_CPU_PROCESS)


def loaders_of(tiny_dataset, **flags):
    return open_data_of(tiny_dataset, **flags).loaders()


@pytest.mark.parametrize("cache", ["none", "ram"])
def test_a_clean_epoch_is_audited_with_no_difference(tiny_dataset, cache):
    """On the CPU both halves run the same arithmetic: every audited image (the first batches,
    then every N-th) is the reference's to the bit, with a policy and erasing too."""
    loaders = loaders_of(
        tiny_dataset,
        cache_images=cache,
        audit_data_every=2,
        auto_augment="trivialaugment",
        random_erasing=0.5,
    )
    loaders.train.sampler.set_epoch(0)
    batches = sum(1 for _ in loaders.train)
    results, switch = loaders.train.audit_results()
    due = [n for n in range(1, batches + 1) if n <= FIRST_BATCHES or n % 2 == 0]
    assert len(results) == len(due) and all(r.difference == 0 for r in results)
    summary = audit_summary([results])
    assert summary == {"audit_images": len(due), "audit_max_diff": 0.0}
    assert not switch and loaders.train.audit_results() == ([], False)  # each epoch afresh


def test_a_corrupted_block_is_named_and_a_high_rate_switches_at_the_epochs_end(
    tiny_dataset, monkeypatch, caplog
):
    """A test hook flips a block of every image the device half makes: each audited image is
    one warning naming its file and source; their rate switches the augmentation to the
    gathered taps (the RAM and file sources have no other device half) at the epoch's end,
    never inside it, said once."""
    loaders = loaders_of(tiny_dataset, audit_data_every=1)
    train = loaders.train
    real = type(train).augmented_in_chunks

    def corrupted(self, pixels, rows):  # the device half only: the reference is left alone
        images = real(self, pixels, rows)
        images[:, :, :4, :4] = -images[:, :, :4, :4] + 1.0  # a flipped 4 x 4 block
        return images

    monkeypatch.setattr(type(train), "augmented_in_chunks", corrupted)
    train.sampler.set_epoch(0)
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        for _ in train:
            pass
        assert train.augment.banded is not False  # not inside the epoch
        summary = epoch_audit(train)
    warnings = [r.getMessage() for r in caplog.records if "data audit" in r.getMessage()]
    named = [w for w in warnings if "differs from the CPU reference" in w]
    assert len(named) == summary["audit_images"] >= audit_module.SWITCH_AT
    table = train.dataset.images.table
    assert any(str(table.location(0))[:-6] in w for w in named) and "from files" in named[0]
    assert summary["audit_max_diff"] > 10
    switched = [w for w in warnings if "repeatedly differ" in w]
    assert len(switched) == 1 and "gathered taps" in switched[0] and train.augment.banded is False


def test_the_switch_is_decided_on_the_rate_of_the_recent_audits():
    """SWITCH_AT mismatches among the last RECENT_AUDITS switch; older ones are forgotten."""
    audit = DataAudit(None, BatchAugment(16), Source.FILES, 1, torch.device("cpu"))
    spread = [False] * (audit_module.RECENT_AUDITS - 1) + [True]
    audit.recent.extend(spread * 2)  # 2 in the run, 1 in the last RECENT_AUDITS
    assert not audit.switch_due()
    audit.recent.extend([True] * (audit_module.SWITCH_AT - 1))
    assert audit.switch_due() and not audit.switch_due()  # then a new count starts


def test_an_image_the_reference_cannot_make_is_one_warning_not_the_runs_error(caplog):
    """A remake that fails (a substitute for a file gone since) is a warning: no mismatch, no
    result, and the epoch's end does not raise."""

    class Gone:
        def __getitem__(self, index):
            raise OSError("file gone")

    audit = DataAudit(Gone(), BatchAugment(16), Source.FILES, 1, torch.device("cpu"))
    rows = torch.zeros(2, ROW_WIDTH)
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        audit.look(torch.zeros(2, 3, 16, 16), rows)
        assert audit.epoch_results() == []
    assert "could not be made again on the CPU (file gone)" in caplog.text
    assert not audit.switch_due()
    audit.close()


def test_the_audit_backlog_is_bounded():
    """Audits under way at most MAX_PENDING (on CUDA, in the audit's thread): a due batch while
    they wait is left unaudited."""
    started, release = threading.Event(), threading.Event()

    class Slow:
        def __getitem__(self, index):
            started.set()
            release.wait(30)
            raise OSError("slow")

    audit = DataAudit(Slow(), BatchAugment(16), Source.FILES, 1, torch.device("cpu"))
    audit._thread = ThreadPoolExecutor(1)  # as on CUDA: the audits run beside the training
    for _ in range(10):
        audit.look(torch.zeros(2, 3, 16, 16), torch.zeros(2, ROW_WIDTH))
    assert started.wait(30) and len(audit.pending) == audit_module.MAX_PENDING
    release.set()
    audit.epoch_results()
    audit.close()


def test_the_summary_counts_every_ranks_images_and_keeps_the_largest_difference():
    parts = [[Audited(1, 0.5), Audited(7, 2.25)], [], [Audited(3, 1.0)]]
    assert audit_summary(parts) == {"audit_images": 3, "audit_max_diff": 2.25}
    assert audit_summary([[], []]) == {"audit_images": 0, "audit_max_diff": 0.0}


def test_out_of_memory_preparing_a_batch_makes_the_same_batch_again_in_smaller_pieces(
    tiny_dataset, monkeypatch, caplog
):
    """A simulated out-of-memory error while a batch is copied to the device (the prefetch's
    part): with the retry on, the batch is made again here, halved, and is the same batch."""
    clean = loaders_of(tiny_dataset, audit_data_every=0).train
    clean.sampler.set_epoch(0)
    expected = [batch for batch in clean]
    train = open_data_of(tiny_dataset, audit_data_every=0).loaders(retry_on_oom=True).train
    real_moved, failures = type(train).moved, []

    def moved(self, pixels, rows, labels):
        if len(failures) < 2:  # the first two copies run out of memory
            failures.append(len(rows))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_moved(self, pixels, rows, labels)

    monkeypatch.setattr(type(train), "moved", moved)
    train.sampler.set_epoch(0)
    with caplog.at_level(logging.WARNING, logger="imgtrainer"):
        made = [batch for batch in train]
    assert len(made) == len(expected)
    for (images, labels), (clean_images, clean_labels) in zip(made, expected, strict=True):
        assert torch.equal(images, clean_images) and torch.equal(labels, clean_labels)
    assert failures == [4, 4] and train.chunk == 1
    assert "out of memory in preparing a batch on the device; 2 images" in caplog.text
    train.retry_on_oom, failures[:] = False, []  # without the retry: the error ends the run
    with pytest.raises(torch.OutOfMemoryError):
        next(iter(train))


@pytest.mark.slow  # two training runs, in this process
def test_a_run_audited_at_every_batch_trains_the_same_weights_as_one_without(tmp_path):
    """The audit reads; it draws nothing from the run's random streams (the sample row holds
    every draw): every batch audited or none, the weights come out bit for bit the same, and
    the audited run's history says how many images it checked."""
    from conftest import TINY_FLAGS, run_train, write_tiny_dataset

    train, val = write_tiny_dataset(tmp_path / "data")
    weights = {}
    for every in (1, 0):
        root = tmp_path / f"every{every}"
        flags = [*TINY_FLAGS, "--train_dir", train, "--val_dir", val, "--epochs", "2"]
        flags += ["--model", "test_resnet", "--auto_augment", "trivialaugment"]
        flags += ["--random_erasing", "0.25", "--audit_data_every", str(every)]
        flags += ["--checkpoint_dir", root / "checkpoints", "--log_dir", root / "logs"]
        assert run_train(flags, cwd=tmp_path) == 0
        state = torch.load(root / "checkpoints" / "checkpoint_latest.pth", weights_only=True)
        weights[every] = state["model_state_dict"]
        history = json.loads((root / "logs" / "training_history.json").read_text())["epochs"]
        if every:
            steps = [48 // 8] * 2  # 3 classes of 16 images: 6 steps of 8 an epoch
            assert [e["audit_images"] for e in history] == steps
            assert all(e["audit_max_diff"] == 0 for e in history)
        else:
            assert all("audit_images" not in e for e in history)
    assert weights[1].keys() == weights[0].keys()
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])
