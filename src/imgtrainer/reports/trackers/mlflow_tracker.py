"""``--log_to mlflow``: MLflow. The server is MLFLOW_TRACKING_URI (with its MLFLOW_TRACKING_*
credentials); without it, MLflow's local store in the working folder (offline). The experiment
is MLFLOW_EXPERIMENT_NAME (default: MLflow's own)."""

from __future__ import annotations

from typing import Any

from imgtrainer.errors import UserError, first_line
from imgtrainer.reports.trackers import TrackerContext, import_package, numeric
from imgtrainer.reports.trackers.base import TrackerHook


class Tracker(TrackerHook):
    name = "mlflow"

    def __init__(self, context: TrackerContext):
        self.mlflow = mlflow = import_package("mlflow", "pip install mlflow")
        self.context = context
        run_id = context.saved_run_id(self.name)
        try:
            run = mlflow.start_run(run_id=run_id)
            if run_id is None:  # parameters are written once: a resume may not change them
                mlflow.log_params({k: str(v) for k, v in context.cfg.to_dict().items()})
        except Exception as err:  # an unreachable server, a refused login
            raise UserError(
                f"--log_to mlflow could not start a run at {mlflow.get_tracking_uri()} "
                f"({first_line(err)}): check MLFLOW_TRACKING_URI and its credentials "
                "(MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN), or unset it "
                "to use the local store"
            ) from None
        context.save_run_id(self.name, run.info.run_id)
        self.where = f"MLflow run {run.info.run_id} at {mlflow.get_tracking_uri()}"

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        values = {f"train/{k}": v for k, v in metrics.items()}
        self.safely(self.mlflow.log_metrics, values, step=global_step)

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        values = {f"epoch/{k}": v for k, v in numeric(record).items()}
        self.safely(self.mlflow.log_metrics, values, step=epoch * self.context.steps_per_epoch)

    def close(self) -> None:
        self.safely(self.mlflow.end_run)
