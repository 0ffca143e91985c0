"""``log_to=``: the user's objects as trackers, and the ``gradtap watch --log-to`` specs.

Each tracker's package is only looked at when the object comes from it (an object of a
package means the package is imported already); nothing is imported to find out.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from typing import Any

from gradtap._monitor.trackers.base import Tracker
from gradtap._monitor.trackers.function import FunctionTracker
from gradtap._monitor.trackers.lightning_logger import LightningTracker
from gradtap._monitor.trackers.mlflow_run import MlflowTracker, active_run_id, new_run
from gradtap._monitor.trackers.tensorboard import TensorBoardTracker
from gradtap._monitor.trackers.wandb_run import WandbTracker
from gradtap.errors import missing_extra

__all__ = ["EXPECTED", "from_spec", "resolve"]

EXPECTED = ("a torch.utils.tensorboard.SummaryWriter, a wandb run or the wandb module (its "
            "active run), the mlflow module (its active run) or an MLflow run, a Lightning "
            "Logger, or a callable f(metrics: dict[str, float], step: int)")


def resolve(log_to: Any) -> list[Tracker]:
    """The trackers of ``log_to``: one object or a list or tuple of them.

    Raises:
        TypeError: an object is none of :data:`EXPECTED`.
        ValueError: the wandb or mlflow module has no active run.
    """
    items = list(log_to) if isinstance(log_to, (list, tuple)) else [log_to]
    if not items:
        raise ValueError(f"log_to is empty; give {EXPECTED}")
    return [_one(obj) for obj in items]


_ADAPTERS = (TensorBoardTracker, WandbTracker, MlflowTracker, LightningTracker, FunctionTracker)


def _one(obj: Any) -> Tracker:
    if isinstance(obj, _ADAPTERS):  # made already (``--log-to``)
        return obj
    if isinstance(obj, types.ModuleType):
        if obj.__name__ == "wandb":
            if obj.run is None:
                raise ValueError("log_to=wandb: wandb has no active run; call wandb.init() "
                                 "before making the Monitor (or pass the run)")
            return WandbTracker(obj.run)
        if obj.__name__ == "mlflow":
            return MlflowTracker(active_run_id(obj), obj.get_tracking_uri())
        raise TypeError(f"log_to: cannot log to the module {obj.__name__!r}; expected "
                        f"{EXPECTED}")
    package = type(obj).__module__.split(".")[0]
    if package == "wandb" and hasattr(obj, "log") and hasattr(obj, "define_metric"):
        return WandbTracker(obj)
    if package == "mlflow" and hasattr(getattr(obj, "info", None), "run_id"):
        mlflow = sys.modules["mlflow"]
        return MlflowTracker(str(obj.info.run_id), mlflow.get_tracking_uri())
    if _is_lightning_logger(obj):
        return LightningTracker(obj)
    if hasattr(obj, "add_scalar") and hasattr(obj, "add_text") and hasattr(obj, "flush"):
        return TensorBoardTracker(obj)
    if callable(obj):
        return FunctionTracker(obj)
    raise TypeError(f"log_to: cannot log to {obj!r} (a {type(obj).__module__}."
                    f"{type(obj).__qualname__}); expected {EXPECTED}")


def _is_lightning_logger(obj: Any) -> bool:
    for name in ("lightning.pytorch.loggers", "pytorch_lightning.loggers"):
        module = sys.modules.get(name)
        if module is not None and isinstance(obj, module.Logger):
            return True
    return False


def from_spec(spec: str, index: int = 0) -> Callable[[], Tracker]:
    """A ``--log-to`` value as a function making its tracker (called where the Monitor of the
    script's ``index``-th optimizer is made):

    * ``tensorboard:DIR``: a ``SummaryWriter`` in ``DIR`` (``DIR/optimizer-<index>`` for the
      second optimizer on), closed at the end;
    * ``wandb``: the script's active wandb run, else a run of gradtap's own
      (``wandb.init()``, project ``$WANDB_PROJECT``), finished at the end;
    * ``mlflow``: the script's active MLflow run, else a run of gradtap's own in the
      experiment ``$MLFLOW_EXPERIMENT_NAME`` (default ``gradtap-watch``), ended at the end.

    Raises:
        ValueError: an unknown spec (checked at once).
    """
    kind, sep, where = spec.partition(":")
    if kind == "tensorboard" and sep and where:
        folder = where if index == 0 else os.path.join(where, f"optimizer-{index}")

        def tensorboard() -> Tracker:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise missing_extra("--log-to tensorboard", "tensorboard", "tensorboard") from err
            return TensorBoardTracker(SummaryWriter(log_dir=folder), owned=True)

        return tensorboard
    if kind == "wandb" and not sep:
        def wandb() -> Tracker:
            module = _import("wandb")
            if module.run is not None:
                return WandbTracker(module.run)
            return WandbTracker(module.init(), owned=True)

        return wandb
    if kind == "mlflow" and not sep:
        def mlflow() -> Tracker:
            module = _import("mlflow")
            run = module.active_run()
            if run is not None:
                return MlflowTracker(str(run.info.run_id), module.get_tracking_uri())
            return new_run(module, os.environ.get("MLFLOW_EXPERIMENT_NAME", "gradtap-watch"))

        return mlflow
    raise ValueError(f"--log-to {spec!r}: expected tensorboard:DIR, wandb or mlflow")


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as err:
        raise missing_extra(f"--log-to {name}", name, name) from err
