"""Augmentation: --auto_augment, --random_erasing (per sample, seeded by (seed, epoch, index)),
--mixup / --cutmix (per batch, seeded by (seed, epoch, step, rank)), their soft-target loss,
--mix_off_epochs, and exact resume with all of them on."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.data.mixup import one_hot as timm_one_hot
from timm.loss import SoftTargetCrossEntropy
from torch import nn
from torchvision.transforms import v2

import imgtrainer.run.train as train_ddp
from conftest import (
    ONE_CPU_PROCESS,
    cpu_run_parts,
    data_config,
    folder_images,
    user_error_line,
)
from imgtrainer.config import HELP_GROUPS, TrainConfig, parse_config
from imgtrainer.data.device.augment import BatchAugment
from imgtrainer.data.device.batches import DeviceBatches
from imgtrainer.data.device.mixing import BatchMixer, step_seed
from imgtrainer.data.host.collate import collate_samples
from imgtrainer.data.host.image_cache import DecodedImageCache
from imgtrainer.data.host.samplers import EpochSampler
from imgtrainer.data.host.samples import Source, TrainingSamples
from imgtrainer.data.loaders import (
    LoaderSpec,
    batch_mixer,
    build_datasets,
    make_loader,
    mixing_of,
    train_augmentation,
)
from imgtrainer.precision import Precision
from imgtrainer.training.loop import EpochPlan, train_one_epoch
from imgtrainer.training.memory import MemoryPlan
from imgtrainer.training.step import RunParts, train_step
from test_resume import assert_same_tensors

HAS_CUDA = torch.cuda.is_available()
AUGMENT = {"auto_augment": "trivialaugment", "random_erasing": 0.5}


def scramble_global_rngs(seed: int) -> None:
    """What another worker, an earlier sample or the model's dropout may have drawn before."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# ----------------------------------------------------------------------------- per-sample draws


def augmentation(image_size: int, crop_scale_min: float, hflip: float, **flags):
    """The (host draws, device augment) of a config with these augmentation settings."""
    return train_augmentation(
        TrainConfig(image_size=image_size, crop_scale_min=crop_scale_min, hflip=hflip, **flags),
        torch.device("cpu"),
    )


def augment_keys(dataset: TrainingSamples, augment: BatchAugment, keys) -> torch.Tensor:
    """The augmented batch of these (index, epoch) keys, as the training loader makes it."""
    pixels, params, _ = collate_samples([dataset[key] for key in keys])
    pixels = pixels.canvas()  # packed as the loader sends it
    return augment(pixels, params)


def first_batches(train: Path, val: Path, workers: int, epoch: int = 0, **augment) -> list:
    cfg = data_config(train, val, image_size=16, seed=7, crop_scale_min=0.3, hflip=0.5, **augment)
    train_set, *_ = build_datasets(cfg, ONE_CPU_PROCESS)
    sampler = EpochSampler(len(train_set), 0, 1, seed=7)
    sampler.set_epoch(epoch)
    loader = DeviceBatches(
        make_loader(train_set, sampler, LoaderSpec(8, train=True, num_workers=workers)),
        train_augmentation(cfg, torch.device("cpu"))[1],
        torch.device("cpu"),
    )
    batches = []
    for images, labels in loader:
        batches.append((images, labels))
        if len(batches) == 3:
            break
    return batches


def test_same_augmented_batches_with_0_1_and_2_loader_workers(tiny_dataset):
    train, val = tiny_dataset
    scramble_global_rngs(1)
    alone = first_batches(train, val, workers=0, **AUGMENT)
    for workers in (1, 2):
        scramble_global_rngs(1 + workers)
        assert_same_tensors(alone, first_batches(train, val, workers, **AUGMENT), "batches")
    # The policies did change the images, and the next epoch draws other augmentations.
    plain = first_batches(train, val, workers=0)
    assert not torch.equal(alone[0][0], plain[0][0])
    assert torch.equal(alone[0][1], plain[0][1])  # same samples, same order
    next_epoch = first_batches(train, val, workers=0, epoch=1, **AUGMENT)
    assert not torch.equal(alone[0][0], next_epoch[0][0])


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment"])
def test_cached_image_augmentation_is_a_function_of_the_sample_key(tiny_dataset, policy):
    """The --cache_images ram/gpu path (tensors in memory, augmented in the training process):
    a sample's augmentation depends on (seed, epoch, index) only, and leaves the process's
    random stream where it was."""
    train, _ = tiny_dataset
    cache = DecodedImageCache(folder_images(train).table, 16, device="cpu")
    draws, augment = augmentation(16, 0.3, 0.5, auto_augment=policy, random_erasing=1.0)
    assert (
        type(augment.policy.transform)
        is {
            "trivialaugment": v2.TrivialAugmentWide,
            "randaugment": v2.RandAugment,
        }[policy]
    )
    dataset = TrainingSamples(cache, draws, seed=3)
    scramble_global_rngs(5)
    state = torch.get_rng_state()
    first = augment_keys(dataset, augment, [(i, 2) for i in range(6)])
    assert torch.equal(torch.get_rng_state(), state)
    scramble_global_rngs(6)
    again = augment_keys(dataset, augment, [(i, 2) for i in reversed(range(6))]).flip(0)
    assert_same_tensors(list(first), list(again), "images")
    # Alone or in another batch, a sample is augmented the same.
    assert torch.allclose(augment_keys(dataset, augment, [(2, 2)])[0], first[2], atol=1e-5)
    assert not torch.equal(first[0], augment_keys(dataset, augment, [(0, 3)])[0])  # other epoch


def test_random_erasing_sets_a_rectangle_to_the_mean_colour_per_sample(tiny_dataset):
    train, _ = tiny_dataset
    cache = DecodedImageCache(folder_images(train).table, 32, device="cpu")
    erase_draws, augment = augmentation(32, 1.0, 0.0, random_erasing=0.5)
    plain_draws, _ = augmentation(32, 1.0, 0.0)
    keys = [(i % len(cache), i // len(cache)) for i in range(40)]
    erased = augment_keys(TrainingSamples(cache, erase_draws, 0), augment, keys)
    unerased = augment_keys(TrainingSamples(cache, plain_draws, 0), augment, keys)
    changed = (erased != unerased).any(1)  # (N, H, W)
    per_sample = changed.flatten(1).any(1)
    assert 8 < int(per_sample.sum()) < 32  # p=0.5: some samples erased, others not
    for n in per_sample.nonzero().flatten().tolist():
        rows, cols = changed[n].any(1).nonzero(), changed[n].any(0).nonzero()
        box = changed[n][rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert box.float().mean() > 0.9  # one rectangle (a pixel may equal the mean already)
        # 0 after normalization: the mean colour, as in torchvision's recipe.
        assert erased[n].permute(1, 2, 0)[changed[n]].abs().max() == 0


# ----------------------------------------------------------------------------- batch mixing


def batch(n: int = 8, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, classes, (n,), generator=g)


def make_mixer(
    num_classes: int, mixup: float, cutmix: float, rank: int = 0, device: str = "cpu", **flags
) -> BatchMixer:
    """A BatchMixer with these mixing flags, over 1 epoch from seed 0 unless told."""
    cfg = TrainConfig(**{"epochs": 1, "seed": 0, "mixup": mixup, "cutmix": cutmix, **flags})
    return BatchMixer(mixing_of(cfg, world_size=1), num_classes, rank, device)


def test_mixing_is_a_function_of_seed_epoch_step_and_rank():
    images, labels = batch()
    mixer = make_mixer(3, mixup=0.4, cutmix=1.0, epochs=3, seed=11)
    scramble_global_rngs(1)
    state = torch.get_rng_state()
    a = [mixer.for_epoch(1)(images, labels, step) for step in range(6)]
    assert torch.equal(torch.get_rng_state(), state)  # the process's stream is untouched
    scramble_global_rngs(2)
    b = [mixer.for_epoch(1)(images, labels, step) for step in reversed(range(6))][::-1]
    assert_same_tensors(a, b, "mixed")
    for _, soft in a:
        assert soft.shape == (8, 3) and torch.allclose(soft.sum(1), torch.ones(8))
    # Each step, epoch and rank draws its own.
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[1][0], a[2][0])
    other_epoch = mixer.for_epoch(2)(images, labels, 0)
    other_rank = make_mixer(3, 0.4, 1.0, epochs=3, seed=11, rank=1).for_epoch(1)(images, labels, 0)
    assert not torch.equal(other_epoch[1], a[0][1]) and not torch.equal(other_rank[1], a[0][1])
    assert len({step_seed(11, 1, s, r) for s in range(50) for r in range(4)}) == 200


def test_switch_probability_picks_cutmix_or_mixup():
    images, labels = batch()
    paired = images.roll(1, 0)  # torchvision pairs each image with its neighbour
    for step in range(8):
        cut, soft = make_mixer(3, 0.4, 1.0, mix_switch_prob=1.0).for_epoch(0)(images, labels, step)
        # cutmix: every pixel is the image's own or its partner's
        assert ((cut == images) | (cut == paired)).all()
        blend, _ = make_mixer(3, 0.4, 1.0, mix_switch_prob=0.0).for_epoch(0)(images, labels, step)
        lam = ((blend - paired) / (images - paired))[images != paired].median()
        assert torch.allclose(blend, lam * images + (1 - lam) * paired, atol=1e-5)
    # Only one of them on: that one, whatever the switch probability.
    only_cut, _ = make_mixer(3, 0.0, 1.0, mix_switch_prob=0.0).for_epoch(0)(images, labels, 0)
    assert ((only_cut == images) | (only_cut == paired)).all()


def test_mix_off_epochs_turns_mixing_off_for_the_last_epochs():
    mixer = make_mixer(3, 0.2, 0.0, mix_off_epochs=2, epochs=5)
    assert [mixer.for_epoch(e) is not None for e in range(5)] == [True, True, True, False, False]
    cfg = parse_config(["--epochs", "4", "--cutmix", "1.0", "--mix_off_epochs", "1"])
    built = batch_mixer(cfg, 3, ONE_CPU_PROCESS)
    assert [built.for_epoch(e) is not None for e in range(4)] == [True, True, True, False]
    assert batch_mixer(parse_config([]), 3, ONE_CPU_PROCESS) is None

    # Without a mixer the loop trains on the hard labels: the loss is plain cross entropy.
    images, labels = batch()
    model = linear_model()
    state = run_parts(model, label_smoothing=0.0)
    plain = train_one_epoch(state, [(images, labels)])
    with torch.no_grad():
        expected = nn.functional.cross_entropy(linear_model()(images), labels)
    assert plain["train_loss"] == pytest.approx(float(expected), rel=1e-6)


# ----------------------------------------------------------------------------- the loss


def linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))  # no BatchNorm


def run_parts(
    model: nn.Module, label_smoothing: float = 0.1, micro_batch: int | None = None
) -> RunParts:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return cpu_run_parts(
        model,
        optimizer,
        MemoryPlan(micro_batch=micro_batch),
        nn.CrossEntropyLoss(label_smoothing=label_smoothing),
    )


def test_soft_target_loss_is_timms_with_label_smoothing_folded_in():
    """CrossEntropyLoss(label_smoothing) on the mixed targets equals timm's recipe: both
    labels smoothed, mixed by lambda, soft-target cross entropy; and lambda-weighted cross
    entropy of the two labels without smoothing."""
    images, labels = batch(n=8, classes=5)
    mixed, soft = make_mixer(5, mixup=0.4, cutmix=0.0).for_epoch(0)(images, labels, 3)
    partner = labels.roll(1, 0)
    i = int((labels != partner).nonzero()[0])
    lam = float(soft[i, labels[i]])  # the share of the image's own label
    logits = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    off = 0.1 / 5
    timm_targets = lam * timm_one_hot(labels, 5, 1 - 0.1 + off, off) + (1 - lam) * timm_one_hot(
        partner, 5, 1 - 0.1 + off, off
    )
    ours = nn.CrossEntropyLoss(label_smoothing=0.1)(logits, soft)
    assert float(ours) == pytest.approx(float(SoftTargetCrossEntropy()(logits, timm_targets)))
    unsmoothed = nn.CrossEntropyLoss()(logits, soft)
    two_labels = lam * nn.functional.cross_entropy(logits, labels) + (
        1 - lam
    ) * nn.functional.cross_entropy(logits, partner)
    assert float(unsmoothed) == pytest.approx(float(two_labels), rel=1e-6)


def test_mixed_step_in_micro_batches_has_the_whole_batchs_gradient_and_metrics():
    images, labels = batch(n=8, classes=3)
    mixed, soft = make_mixer(3, 0.4, 1.0).for_epoch(0)(images, labels, 0)
    results = []
    for micro_batch in (None, 2):
        model = linear_model()
        state = run_parts(model, micro_batch=micro_batch)
        state.optimizer.zero_grad()
        sums, _ = train_step(state, mixed, soft)
        results.append((sums, [p.detach().clone() for p in model.parameters()]))
    (whole_sums, whole), (micro_sums, micro) = results
    for a, b in zip(whole, micro, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(whole_sums, micro_sums)
    # The recorded loss is the soft-target loss; accuracy counts the dominant label.
    with torch.no_grad():
        logits = linear_model()(mixed)
    expected_loss = nn.CrossEntropyLoss(label_smoothing=0.1)(logits, soft)
    assert float(whole_sums[0] / whole_sums[2]) == pytest.approx(float(expected_loss), rel=1e-5)
    dominant = soft.argmax(1)
    assert int(whole_sums[1]) == int((logits.argmax(1) == dominant).sum())


def test_soft_targets_under_bfloat16_autocast():
    images, labels = batch()
    state = run_parts(linear_model())
    state.precision = Precision(True, torch.bfloat16)
    metrics = train_one_epoch(
        state, [(images, labels)], epoch=EpochPlan(mixer=make_mixer(3, 0.4, 0).for_epoch(0))
    )
    assert metrics["train_samples"] == 8 and np.isfinite(metrics["train_loss"])


def test_the_loop_mixes_each_batch_with_its_step_index():
    """The loop hands the mixer the batch's index in the epoch: a resumed epoch (start_step)
    mixes its remaining batches exactly as the uninterrupted one did."""
    batches = [batch(seed=s) for s in range(4)]
    seen = []

    def recording_mixer(images, targets, step):
        seen.append(step)
        return make_mixer(3, 0.4, 1.0).for_epoch(0)(images, targets, step)

    train_one_epoch(
        run_parts(linear_model()),
        batches[2:],
        epoch=EpochPlan(start_step=2, mixer=recording_mixer),
    )
    assert seen == [2, 3]


# ----------------------------------------------------------------------------- flags


def test_augmentation_flags_have_their_own_help_group():
    groups = list(HELP_GROUPS)
    assert groups[groups.index("data") + 1] == "augmentation"
    assert set(HELP_GROUPS["augmentation"]) >= {
        *("crop_scale_min", "hflip", "auto_augment", "random_erasing"),
        *("mixup", "cutmix", "mix_switch_prob", "mix_off_epochs"),
    }
    assert all(
        TrainConfig.__dataclass_fields__[name].metadata["group"] == "augmentation"
        for name in HELP_GROUPS["augmentation"]
    )


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--random_erasing", "1.5"], "--random_erasing is a probability"),
        (["--mix_switch_prob", "-0.1"], "--mix_switch_prob is a probability"),
        (["--mixup", "-1"], "--mixup is a Beta alpha"),
        (["--mix_off_epochs", "-1"], "--mix_off_epochs must be 0 or more"),
    ],
)
def test_bad_augmentation_flags_are_one_error_line(flags, phrase, capsys):
    assert phrase in user_error_line(train_ddp.main, ["--device", "cpu", *flags], capsys)


def test_resume_with_other_mixing_is_refused(trained_run, tmp_path, capsys):
    workdir = trained_run.copy_to(tmp_path)
    line = user_error_line(
        train_ddp.main,
        ["--device", "cpu", *trained_run.flags, "--epochs", "3", "--mixup", "0.2", "--resume"]
        + ["auto"],
        capsys,
        cwd=workdir,
    )
    assert "--mixup 0.0 -> 0.2" in line and "--resume_override" in line


# ----------------------------------------------------------------------------- end to end


# Exact resume with every augmentation and mixing on (mixing ending mid-run, 0 then 2 loader
# workers): tests/test_resume.py::test_mid_epoch_resume_with_the_recipe_and_other_num_workers_is_exact.


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_cache_augments_and_mixes_on_the_device_with_the_cpu_draws(tiny_dataset):
    """--cache_images gpu: the images stay on the GPU through every augmentation and the
    mixing, with the same random draws as on the CPU (the generator seeded is the CPU one)."""
    train, _ = tiny_dataset
    draws, augment = augmentation(16, 0.3, 0.5, auto_augment="trivialaugment", random_erasing=1.0)
    cache = DecodedImageCache(folder_images(train).table, 16, "cuda")
    on_gpu = TrainingSamples(cache, draws, 3, Source.GPU)
    assert on_gpu.canvas is cache.canvas and on_gpu.canvas.is_cuda
    keys = [(i, 0) for i in range(8)]
    indices, params, _ = collate_samples([on_gpu[key] for key in keys])
    first = augment(on_gpu.images.canvas.index_select(0, indices.cuda()), params)
    assert first.is_cuda
    assert torch.equal(first, augment(on_gpu.images.canvas.index_select(0, indices.cuda()), params))
    on_cpu = TrainingSamples(DecodedImageCache(folder_images(train).table, 16, "cpu"), draws, 3)
    cpu_batch = augment_keys(on_cpu, augment, keys)
    # The same draws; the policies' ops may round differently on the device.
    assert (first.cpu() - cpu_batch).abs().mean() < 0.05
    images, labels = batch()
    cpu = make_mixer(3, 0.4, 1.0).for_epoch(0)(images, labels, 5)
    gpu = make_mixer(3, 0.4, 1.0, device="cuda").for_epoch(0)(images.cuda(), labels.cuda(), 5)
    assert gpu[0].is_cuda and torch.equal(gpu[1].cpu(), cpu[1])
    assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-5)
