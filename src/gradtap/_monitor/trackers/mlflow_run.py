"""An MLflow run (the ``mlflow`` module's active run, or a run given) as a tracker: each
logged step goes through ``MlflowClient.log_batch`` in batches of at most 1,000 metrics (the
limit of MLflow's tracking API), each metric at the Monitor's step and the step's wall time."""

from __future__ import annotations

from typing import Any

__all__ = ["BATCH", "MlflowTracker", "active_run_id", "new_run"]

#: Metrics per ``log_batch`` call, at most (MLflow's own limit).
BATCH = 1000


class MlflowTracker:
    """Log to the MLflow run ``run_id`` of the tracking server at ``tracking_uri``; ``owned``:
    gradtap created it, so :meth:`close` ends it."""

    thread_safe = True

    def __init__(self, run_id: str, tracking_uri: str, *, owned: bool = False) -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.owned = owned
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.name = f"MLflow run {run_id}"

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str],
            wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(key, value, ms, step) for key, value in numbers.items()]
        for at in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[at:at + BATCH])

    def close(self, status: str) -> None:
        if self.owned:  # else the run is the script's: it ends it
            self.client.set_terminated(self.run_id,
                                       "FINISHED" if status == "finished" else "FAILED")


def new_run(module: Any, experiment: str) -> MlflowTracker:
    """A run of its own in ``experiment`` (created if missing), made with the client, so the
    script's ``mlflow.start_run()`` is not affected."""
    from mlflow.tracking import MlflowClient

    uri = module.get_tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    return MlflowTracker(client.create_run(exp_id).info.run_id, uri, owned=True)


def active_run_id(module: Any) -> str:
    """The id of the ``mlflow`` module's active run (on the calling thread, as MLflow keeps
    it), or a ``ValueError`` saying to start one."""
    run = module.active_run()
    if run is None:
        raise ValueError("log_to=mlflow: MLflow has no active run; call mlflow.start_run() "
                         "before making the Monitor (or pass the run)")
    return str(run.info.run_id)
