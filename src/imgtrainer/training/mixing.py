"""Mixup and CutMix on whole training batches (``--mixup``, ``--cutmix``), seeded per step.

Each batch runs torchvision's ``v2.MixUp``/``v2.CutMix`` with the global CPU generator seeded
from (seed, epoch, step, position of its first sample in the epoch's order), then restored: the
same mixing after a resume and with any number of workers. A batch pairs its own images, so
another number of processes mixes other pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.transforms import v2

from imgtrainer.config import TrainConfig, optimizer_batch
from imgtrainer.data.sources import sample_seed, seeded_cpu_generator


def step_seed(seed: int, epoch: int, step: int, position: int) -> int:
    """The mixing seed of one process's batch of an optimizer step: a function of (seed, epoch,
    step, the position of its first sample in the epoch's global order) only. Offset from the
    per-sample seeds (data.sample_seed) so the two never share a stream."""
    return (sample_seed(seed, epoch, step) * 1_000_003 + position + 1) % (2**63)


class BatchMixer:
    """The run's mixup/cutmix; ``for_epoch`` gives the callable that the engine applies to each
    loaded batch of an epoch, or None in the epochs without mixing (the last
    ``--mix_off_epochs``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        num_classes: int,
        rank: int = 0,
        device: torch.device | str = "cpu",
        world_size: int = 1,
    ):
        if cfg.mixup <= 0 and cfg.cutmix <= 0:
            raise ValueError("BatchMixer needs --mixup or --cutmix above 0")
        mixers = []
        if cfg.mixup > 0:
            mixers.append(v2.MixUp(alpha=cfg.mixup, num_classes=num_classes))
        if cfg.cutmix > 0:
            mixers.append(v2.CutMix(alpha=cfg.cutmix, num_classes=num_classes))
        # timm's switch probability: with both on, each batch takes cutmix with this chance.
        switch = cfg.mix_switch_prob
        self.transform = (
            v2.RandomChoice(mixers, p=[1 - switch, switch]) if len(mixers) == 2 else mixers[0]
        )
        # Epochs count from 0: epochs 0 .. this - 1 mix.
        self.last_mixed_epoch = cfg.epochs - cfg.mix_off_epochs
        self.seed, self.rank = cfg.seed, rank
        # Step s of an epoch starts at position s x global batch; rank r's share at + r.
        self.global_batch = optimizer_batch(cfg) * world_size
        self.device = torch.device(device)

    @classmethod
    def from_config(
        cls,
        cfg: TrainConfig,
        num_classes: int,
        rank: int,
        device: torch.device,
        world_size: int = 1,
    ) -> BatchMixer | None:
        """The run's mixer, or None when neither --mixup nor --cutmix is on."""
        if cfg.mixup <= 0 and cfg.cutmix <= 0:
            return None
        return cls(cfg, num_classes, rank, device, world_size)

    def for_epoch(self, epoch: int) -> EpochMixer | None:
        """The mixing of ``epoch`` (counted from 0), or None in the last ``--mix_off_epochs``."""
        return EpochMixer(self, epoch) if epoch < self.last_mixed_epoch else None

    def mix(
        self, images: torch.Tensor, targets: torch.Tensor, epoch: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and their soft targets (batch, classes), on the device. ``step``: the
        batch's index in its epoch (the same after a resume)."""
        # On the device first: the blend runs there, and a pinned batch is copied as it is.
        images = images.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        position = step * self.global_batch + self.rank
        with seeded_cpu_generator(step_seed(self.seed, epoch, step, position)):
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
