"""``--log_to wandb``: Weights & Biases. Offline with WANDB_MODE=offline (``wandb sync`` later);
the project is WANDB_PROJECT (default imgtrainer); other WANDB_* variables apply as usual."""

from __future__ import annotations

import os
from typing import Any

from imgtrainer.errors import UserError, first_line
from imgtrainer.reports.trackers import TrackerContext, import_package, numeric
from imgtrainer.reports.trackers.base import TrackerHook


class Tracker(TrackerHook):
    name = "wandb"

    def __init__(self, context: TrackerContext):
        wandb = import_package("wandb", "pip install wandb")
        self.context = context
        run_id = context.saved_run_id(self.name)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "imgtrainer"),
                config=context.cfg.to_dict(),
                dir=str(context.log_dir),
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as err:  # wandb raises its own errors for a missing login
            raise UserError(
                f"--log_to wandb could not start a run ({first_line(err)}): log in with "
                "`wandb login` or set WANDB_API_KEY, or run offline with WANDB_MODE=offline"
            ) from None
        context.save_run_id(self.name, self.run.id)
        run = self.run
        self.where = f"W&B run {run.id}, " + (
            f"offline in {run.settings.sync_dir}" if run.offline else f"at {run.url}"
        )

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        self.safely(self.run.log, {f"train/{k}": v for k, v in metrics.items()}, step=global_step)

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        # At the global step where the epoch ended: one step axis for every series.
        values = {f"epoch/{k}": v for k, v in numeric(record).items()}
        self.safely(self.run.log, values, step=epoch * self.context.steps_per_epoch)

    def on_run_end(self, hparams: dict[str, Any], final_metrics: dict[str, Any]) -> None:
        self.safely(self.run.summary.update, numeric(final_metrics))

    def close(self) -> None:
        self.safely(self.run.finish)
