"""``--log_to mlflow``: MLflow. The server is MLFLOW_TRACKING_URI (with its MLFLOW_TRACKING_*
credentials); without it, MLflow's local store (SQLite) in the run's log folder, offline. The
experiment is MLFLOW_EXPERIMENT_NAME (default: MLflow's own)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from imgtrainer.errors import UserError, first_line
from imgtrainer.reports.trackers import TrackerContext, import_package, numeric
from imgtrainer.reports.trackers.base import TrackerHook

LOCAL_STORE = "mlflow.db"  # in the log folder: `mlflow ui --backend-store-uri sqlite:///...`

# MLflow retries a request to a server it cannot reach for about 4 minutes (7 retries, backoff
# factor 2, 120 s timeout): the run's start, or the step where the server went away, would wait
# that long for its one line. Shorter unless the user set them.
HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def tracking_uri(log_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, or a SQLite store in the log folder: MLflow's own default is
    ./mlflow.db in the working folder, outside the run's folders."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = (log_dir / LOCAL_STORE).resolve()
    try:
        import sqlalchemy  # noqa: F401  (MLflow's SQL store; mlflow-skinny leaves it out)
    except ImportError:
        raise UserError(
            f"--log_to mlflow keeps its runs in {path} (MLflow's local store), which needs "
            "SQLAlchemy: pip install mlflow (or sqlalchemy alembic beside mlflow-skinny), or "
            "set MLFLOW_TRACKING_URI to a tracking server"
        ) from None
    return f"sqlite:///{path}"


class Tracker(TrackerHook):
    name = "mlflow"

    def __init__(self, context: TrackerContext):
        uri = tracking_uri(context.log_dir)
        self.mlflow = mlflow = import_package("mlflow", "pip install mlflow")
        self.context = context
        for variable, value in HTTP_RETRIES.items():
            os.environ.setdefault(variable, value)
        mlflow.set_tracking_uri(uri)
        run_id = context.saved_run_id(self.name)
        try:
            run = mlflow.start_run(run_id=run_id)
            if run_id is None:  # parameters are written once: a resume may not change them
                mlflow.log_params({k: str(v) for k, v in context.cfg.to_dict().items()})
        except Exception as err:  # an unreachable server, a refused login
            raise UserError(
                f"--log_to mlflow could not start a run at {uri} ({first_line(err)}): check "
                "MLFLOW_TRACKING_URI and its credentials (MLFLOW_TRACKING_USERNAME/PASSWORD or "
                "MLFLOW_TRACKING_TOKEN), or unset it to use the local store"
            ) from None
        context.save_run_id(self.name, run.info.run_id)
        self.where = f"MLflow run {run.info.run_id} at {uri}"

    def on_log_step(self, global_step: int, metrics: dict[str, float]) -> None:
        values = {f"train/{k}": v for k, v in metrics.items()}
        self.safely(self.mlflow.log_metrics, values, step=global_step)

    def on_epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        values = {f"epoch/{k}": v for k, v in numeric(record).items()}
        self.safely(self.mlflow.log_metrics, values, step=epoch * self.context.steps_per_epoch)

    def close(self) -> None:
        self.safely(self.mlflow.end_run)
