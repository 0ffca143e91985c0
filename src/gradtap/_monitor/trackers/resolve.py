"""``log_to=``: the user's objects as trackers, and the ``gradtap watch --log-to`` specs.

Each tracker's package is only looked at when the object comes from it (an object of a
package means the package is imported already); nothing is imported to find out.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from gradtap._monitor.trackers.base import Tracker
from gradtap._monitor.trackers.function import FunctionTracker
from gradtap._monitor.trackers.lightning_logger import LightningTracker
from gradtap._monitor.trackers.mlflow_run import MlflowTracker, active_run_id
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


def _one(obj: Any) -> Tracker:
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


def from_spec(spec: str) -> Callable[[], Tracker]:
    """A ``--log-to`` value (``tensorboard:DIR``, ``wandb``, ``mlflow``) as a function making
    its tracker (called where the Monitor is made).

    Raises:
        ValueError: an unknown spec (checked at once).
    """
    kind, sep, where = spec.partition(":")
    if kind == "tensorboard" and sep and where:
        def tensorboard() -> Tracker:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise missing_extra("--log-to tensorboard", "tensorboard", "tensorboard") from err
            return TensorBoardTracker(SummaryWriter(log_dir=where), owned=True)

        return tensorboard
    if kind in ("wandb", "mlflow") and not sep:
        def module() -> Tracker:
            try:
                imported = __import__(kind)
            except ImportError as err:
                raise missing_extra(f"--log-to {kind}", kind, kind) from err
            return _one(imported)

        return module
    raise ValueError(f"--log-to {spec!r}: expected tensorboard:DIR, wandb or mlflow")
