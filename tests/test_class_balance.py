"""Imbalanced classes: --class_weights balanced (scikit-learn's weights, right with label
smoothing, mixup/cutmix and micro-batches), --sampler balanced (every class equally often, a
function of (seed, epoch)), the note at the start of a run, and the resume check."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ONE_CPU_PROCESS, data_config, write_image_folder
from imgtrainer.checkpoints.resume import changed_settings
from imgtrainer.config import TrainConfig, parse_config
from imgtrainer.data.balance import balanced_class_weights, class_counts, imbalance_note
from imgtrainer.data.device.mixing import BatchMixer
from imgtrainer.data.host.samplers import BalancedClassSampler, EpochSampler
from imgtrainer.data.loaders import mixing_of
from imgtrainer.training.loss import ClassWeightedCrossEntropy, build_criterion

TARGETS = [0] * 30 + [1] * 6 + [2] * 4  # 40 images, the largest class 7.5x the smallest


def test_balanced_weights_are_scikit_learns_formula():
    counts = class_counts(TARGETS, 3)
    assert counts == [30, 6, 4]
    weights = balanced_class_weights(counts)  # n_samples / (n_classes * count)
    assert weights == pytest.approx([40 / 90, 40 / 18, 40 / 12])
    # The mean weight per image is 1: the loss keeps its scale.
    assert sum(w * c for w, c in zip(weights, counts, strict=True)) / 40 == pytest.approx(1.0)


def manual_loss(logits, soft, weight, smoothing):
    """sum_c w_c y'_c (-log p_c), y' = (1 - eps) y + eps / K, averaged over the samples."""
    smoothed = soft * (1 - smoothing) + smoothing / soft.size(1)
    return -(weight * smoothed * logits.log_softmax(1)).sum(1).mean()


def test_weighted_loss_with_label_smoothing_and_mixed_targets():
    torch.manual_seed(0)
    weight = torch.tensor(balanced_class_weights([30, 6, 4]))
    criterion = ClassWeightedCrossEntropy(weight, label_smoothing=0.1)
    logits, labels = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 0, 1])
    one_hot = nn.functional.one_hot(labels, 3).float()
    # Class indices and one-hot targets: the same loss, the formula's.
    expected = manual_loss(logits, one_hot, weight.float(), 0.1)
    torch.testing.assert_close(criterion(logits, labels), expected)
    torch.testing.assert_close(criterion(logits, one_hot), expected)
    # A mixed pair's loss is the mix of the two labels' weighted losses.
    lam, partner = 0.3, labels.roll(1)
    mixed = lam * one_hot + (1 - lam) * nn.functional.one_hot(partner, 3).float()
    per_sample = ClassWeightedCrossEntropy(weight, 0.1)
    separate = [
        lam * per_sample(logits[i : i + 1], labels[i : i + 1])
        + (1 - lam) * per_sample(logits[i : i + 1], partner[i : i + 1])
        for i in range(6)
    ]
    torch.testing.assert_close(criterion(logits, mixed), torch.stack(separate).mean())
    # Micro-batches weighted by their share of the batch (training.step) add up to the batch.
    halves = criterion(logits[:2], mixed[:2]) * 2 / 6 + criterion(logits[2:], mixed[2:]) * 4 / 6
    torch.testing.assert_close(halves, criterion(logits, mixed))
    # Equal weights: PyTorch's own cross-entropy, for labels and soft targets alike.
    plain = nn.CrossEntropyLoss(label_smoothing=0.1)
    equal = ClassWeightedCrossEntropy(torch.ones(3), 0.1)
    torch.testing.assert_close(equal(logits, labels), plain(logits, labels))
    torch.testing.assert_close(equal(logits, mixed), plain(logits, mixed))


def test_weighted_loss_on_batches_from_the_mixer():
    cfg = TrainConfig(mixup=0.4, cutmix=1.0, class_weights="balanced", label_smoothing=0.1)
    criterion = build_criterion(cfg, [30, 6, 4])
    assert isinstance(criterion, ClassWeightedCrossEntropy)
    images, labels = torch.rand(8, 3, 8, 8), torch.tensor([0, 1, 2, 0, 0, 0, 1, 2])
    _, soft = BatchMixer(mixing_of(cfg, world_size=1), 3).mix(images, labels, epoch=0, step=0)
    assert soft.shape == (8, 3) and (soft.max(1).values < 1).any()  # mixed pairs
    logits = torch.randn(8, 3)
    expected = manual_loss(logits, soft, criterion.weight, 0.1)
    torch.testing.assert_close(criterion(logits, soft), expected)
    assert isinstance(build_criterion(TrainConfig(), None), nn.CrossEntropyLoss)


def test_balanced_sampler_draws_every_class_equally_from_seed_and_epoch():
    sampler = BalancedClassSampler(TARGETS, rank=0, world_size=1, seed=3)
    sampler.set_epoch(2)
    order = sampler.epoch_order()
    assert len(order) == len(TARGETS) == len(sampler)  # the epoch keeps its length
    per_class = Counter(TARGETS[i] for i in order)
    assert sorted(per_class.values()) == [13, 13, 14]  # 40 = 3 x 13 + 1
    # The smallest class's 4 images each come 3 or 4 times; the largest's at most once.
    assert set(Counter(i for i in order if TARGETS[i] == 2).values()) <= {3, 4}
    assert max(Counter(i for i in order if TARGETS[i] == 0).values()) == 1
    # Another process, or a resumed run, builds the same order; another epoch another one.
    again = BalancedClassSampler(TARGETS, rank=0, world_size=1, seed=3)
    again.set_epoch(2)
    assert again.epoch_order() == order
    again.set_epoch(3)
    assert again.epoch_order() != order
    # Ranks split that order as they split the shuffled one: whole global batches of 3 (39 of
    # the 40), every world_size-th index, from the position a resume continues at.
    ranks = [BalancedClassSampler(TARGETS, r, 3, seed=3, global_batch=3) for r in range(3)]
    for r in ranks:
        r.set_epoch(2, position=3)
    assert [r.indices() for r in ranks] == [order[3 + r : 39 : 3] for r in range(3)]
    assert [index for index, _ in ranks[1]] == ranks[1].indices() and len(ranks[1]) == 12


def test_the_shuffled_order_is_unchanged():
    """Runs (and checkpoints) from before --sampler keep their order: seed + epoch's randperm."""
    sampler = EpochSampler(10, rank=1, world_size=2, seed=5)
    sampler.set_epoch(4)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(9)).tolist()
    assert sampler.epoch_order() == expected and sampler.indices() == expected[1::2]


def test_imbalance_note_names_the_classes_and_the_flags():
    names = ["a", "b", "c"]
    assert imbalance_note([25, 6, 5], names, handled=False) is None  # exactly 5x: not noted
    note = imbalance_note([30, 6, 4], names, handled=False)
    assert "7.5x" in note and "c 4, b 6, a 30" in note
    assert "--class_weights balanced" in note and "--sampler balanced" in note
    assert "--class_weights" not in imbalance_note([30, 6, 4], names, handled=True)
    many = imbalance_note(list(range(1, 13)), [f"k{i}" for i in range(12)], handled=True)
    assert "smallest classes: k0 1, k1 2, k2 3, k3 4, k4 5; largest: k11 12, k10 11" in many


def test_a_run_logs_the_counts_and_builds_its_sampler_and_loss(tmp_path: Path, caplog):
    from imgtrainer.data.loaders import open_data
    from imgtrainer.training.build import build_run_parts

    train = write_image_folder(tmp_path / "train", ["big", "small"], 1)
    write_image_folder(train, ["big"], 12)  # 12 against 1 image: more than 5x
    val = write_image_folder(tmp_path / "val", ["big", "small"], 1, seed=2)
    cfg = data_config(train, val, image_size=16, batch_size=4, num_workers=0)
    with caplog.at_level(logging.WARNING):
        open_data(cfg, ONE_CPU_PROCESS).loaders()
    assert "12.0x the images of the smallest (images per class: small 1, big 12)" in caplog.text
    assert "--sampler balanced" in caplog.text

    caplog.clear()
    cfg = data_config(
        train, val, image_size=16, batch_size=4, sampler="balanced", class_weights="balanced"
    )
    with caplog.at_level(logging.WARNING):
        built = open_data(cfg, ONE_CPU_PROCESS).loaders()
    loader, sampler, names = built.train, built.sampler, built.class_names
    assert isinstance(sampler, BalancedClassSampler) and "may help" not in caplog.text
    assert "corrects the imbalance twice" in caplog.text
    sampler.set_epoch(0)
    assert sorted(
        Counter(loader.dataset.images.targets[i] for i in sampler.epoch_order()).values()
    ) == [6, 7]
    counts = class_counts(loader.dataset.images.targets, len(names))
    assert counts == built.class_counts
    parts = build_run_parts(cfg, ONE_CPU_PROCESS, len(names), len(loader), counts)
    assert parts.criterion.weight.tolist() == pytest.approx([13 / 24, 13 / 2])


def test_flags_parse_and_a_resume_refuses_their_change():
    cfg = parse_config(["--class_weights", "balanced", "--sampler", "balanced"])
    assert (cfg.class_weights, cfg.sampler) == ("balanced", "balanced")
    with pytest.raises(SystemExit):
        parse_config(["--sampler", "weighted"])
    before = TrainConfig().to_dict()
    state = {"config": before}
    changes = changed_settings(state, cfg.to_dict(), world_size=1)
    assert changes == ["--class_weights none -> balanced", "--sampler random -> balanced"]
    # A checkpoint from before the flags ran with neither.
    older = {"config": {k: v for k, v in before.items() if k not in ("class_weights", "sampler")}}
    assert changed_settings(older, before, world_size=1) == []
    assert len(changed_settings(older, cfg.to_dict(), world_size=1)) == 2
