"""Mixup and CutMix on whole training batches on the training device, seeded per step.

Each batch runs torchvision's ``v2.MixUp``/``v2.CutMix`` with the global CPU generator seeded
from (seed, epoch, step, position of its first sample in the epoch's order), then restored: the
same mixing after a resume and with any number of workers. A batch pairs its own images, so
another number of processes mixes other pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from imgtrainer.data.host.samples import sample_seed, seeded_cpu_generator


def step_seed(seed: int, epoch: int, step: int, position: int) -> int:
    """The mixing seed of one process's batch of an optimizer step: a function of (seed, epoch,
    step, the position of its first sample in the epoch's global order) only. Offset from the
    per-sample seeds (``sample_seed``) so the two never share a stream."""
    return (sample_seed(seed, epoch, step) * 1_000_003 + position + 1) % (2**63)


@dataclass(frozen=True)
class Mixing:
    """What the mixing of a run is: the Beta alphas of mixup and cutmix (0: off), the chance
    a batch takes cutmix when both are on (timm's switch probability), the epochs that mix
    (0 .. ``mixed_epochs`` - 1), the run's seed and its global batch (step s starts at
    position s x global batch of the epoch's order)."""

    mixup: float
    cutmix: float
    switch_prob: float = 0.5
    mixed_epochs: int = 1
    seed: int = 0
    global_batch: int = 1

    @property
    def enabled(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


class BatchMixer:
    """A run's mixup/cutmix; ``for_epoch`` gives the callable that the training loop applies to
    each loaded batch of an epoch, or None in the epochs without mixing."""

    def __init__(
        self,
        mixing: Mixing,
        num_classes: int,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ):
        if not mixing.enabled:
            raise ValueError("BatchMixer needs --mixup or --cutmix above 0")
        mixers = []
        if mixing.mixup > 0:
            mixers.append(v2.MixUp(alpha=mixing.mixup, num_classes=num_classes))
        if mixing.cutmix > 0:
            mixers.append(v2.CutMix(alpha=mixing.cutmix, num_classes=num_classes))
        switch = mixing.switch_prob
        self.transform = (
            v2.RandomChoice(mixers, p=[1 - switch, switch]) if len(mixers) == 2 else mixers[0]
        )
        self.mixing, self.rank = mixing, rank
        self.device = torch.device(device)

    def for_epoch(self, epoch: int) -> EpochMixer | None:
        """The mixing of ``epoch`` (counted from 0), or None once the mixed epochs are over."""
        return EpochMixer(self, epoch) if epoch < self.mixing.mixed_epochs else None

    def mix(
        self, images: torch.Tensor, targets: torch.Tensor, epoch: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and their soft targets (batch, classes), on the device. ``step``: the
        batch's index in its epoch (the same after a resume)."""
        # On the device first: the blend runs there, and a pinned batch is copied as it is.
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        position = step * self.mixing.global_batch + self.rank
        with seeded_cpu_generator(step_seed(self.mixing.seed, epoch, step, position)):
            return self.transform(images, targets)


@dataclass(frozen=True)
class EpochMixer:
    """``BatchMixer.mix`` for one epoch: what ``training.loop.train_one_epoch`` calls per
    batch."""

    mixer: BatchMixer
    epoch: int

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mixer.mix(images, targets, self.epoch, step)
