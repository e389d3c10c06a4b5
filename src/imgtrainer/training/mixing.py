"""Mixup and CutMix on whole training batches (``--mixup``, ``--cutmix``), seeded per step.

torchvision's ``v2.MixUp`` and ``v2.CutMix`` do the work: each image is paired with its
neighbour in the (shuffled) batch, and the targets become class probabilities, mixed by the
same weight as the images. They draw their random numbers (lambda from Beta(alpha, alpha),
cutmix's box, the choice between the two) from torch's global CPU generator and accept no
generator of their own (nor does timm's ``Mixup``, which draws from numpy's global one). So,
like the per-sample augmentation in data.py, each batch runs them with the CPU generator seeded
from (seed, epoch, step, rank) and restored afterwards: a batch's mixing does not depend on what
ran before it, so it is the same after a resume and with any number of loader workers, and the
process's own random stream is untouched. The rank is part of the seed so that ranks draw
different lambdas, as each rank's batch is a different one.

The mixing applies to the whole optimizer batch, on the device, before the engine splits it
into micro-batches: each micro-batch's loss uses its slice of the soft targets. Label smoothing
needs nothing here: ``nn.CrossEntropyLoss(label_smoothing=e)`` smooths probability targets too
(p * (1 - e) + e / classes), which is what timm's ``Mixup`` folds into its targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from imgtrainer.data.sources import sample_seed, seeded_cpu_generator
from imgtrainer.run.config import TrainConfig


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The mixing seed of one optimizer batch: a function of (seed, epoch, step, rank) only.
    Offset from the per-sample seeds (data.sample_seed) so the two never share a stream."""
    return (sample_seed(seed, epoch, step) * 1_000_003 + rank + 1) % (2**63)


class BatchMixer:
    """The run's mixup/cutmix; ``for_epoch`` gives the callable that the engine applies to each
    loaded batch of an epoch, or None in the epochs without mixing (the last
    ``--mix_off_epochs``)."""

    def __init__(
        self,
        num_classes: int,
        mixup: float,
        cutmix: float,
        switch_prob: float = 0.5,
        off_epochs: int = 0,
        epochs: int = 1,
        seed: int = 0,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ):
        if mixup <= 0 and cutmix <= 0:
            raise ValueError("BatchMixer needs --mixup or --cutmix above 0")
        mixers = []
        if mixup > 0:
            mixers.append(v2.MixUp(alpha=mixup, num_classes=num_classes))
        if cutmix > 0:
            mixers.append(v2.CutMix(alpha=cutmix, num_classes=num_classes))
        # timm's switch probability: with both on, each batch takes cutmix with this chance.
        self.transform = (
            v2.RandomChoice(mixers, p=[1 - switch_prob, switch_prob])
            if len(mixers) == 2
            else mixers[0]
        )
        self.last_mixed_epoch = epochs - off_epochs  # epochs count from 0: 0 .. this - 1 mix
        self.seed, self.rank = seed, rank
        self.device = torch.device(device)

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, num_classes: int, rank: int, device: torch.device
    ) -> BatchMixer | None:
        """The run's mixer, or None when neither --mixup nor --cutmix is on."""
        if cfg.mixup <= 0 and cfg.cutmix <= 0:
            return None
        return cls(
            num_classes,
            cfg.mixup,
            cfg.cutmix,
            cfg.mix_switch_prob,
            cfg.mix_off_epochs,
            cfg.epochs,
            cfg.seed,
            rank,
            device,
        )

    def for_epoch(self, epoch: int) -> EpochMixer | None:
        """The mixing of ``epoch`` (counted from 0), or None in the last ``off_epochs``."""
        return EpochMixer(self, epoch) if epoch < self.last_mixed_epoch else None

    def mix(
        self, images: torch.Tensor, targets: torch.Tensor, epoch: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and their soft targets (batch, classes), on the device. ``step``: the
        batch's index in its epoch (the same after a resume)."""
        # On the device first: the blend runs there, and a pinned batch is copied as it is.
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with seeded_cpu_generator(step_seed(self.seed, epoch, step, self.rank)):
            return self.transform(images, targets)


@dataclass(frozen=True)
class EpochMixer:
    """``BatchMixer.mix`` for one epoch: what ``engine.train_one_epoch`` calls per batch."""

    mixer: BatchMixer
    epoch: int

    def __call__(
        self, images: torch.Tensor, targets: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mixer.mix(images, targets, self.epoch, step)
