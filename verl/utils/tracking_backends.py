"""The optional tracker backends under veRL's names: mlflow, swanlab, trackio and clearml.

Each imports its package when a run starts (never at import time), and fails then with the
install command when the package is missing. Unlike veRL's defaults, each stays on this machine
unless the user points it elsewhere (docs/training.md "Trackers"):

    mlflow    MLFLOW_TRACKING_URI, else a local file store `file:<log_dir>/mlruns`
    swanlab   SWANLAB_MODE (default offline) in SWANLAB_LOG_DIR (default <log_dir>/swanlog)
    trackio   its local SQLite store in TRACKIO_DIR (default <log_dir>/trackio)
    clearml   offline (a session folder under CLEARML_CACHE_DIR, default <log_dir>/clearml)
              unless a ClearML server is configured (CLEARML_API_HOST or a clearml.conf) and
              CLEARML_OFFLINE_MODE is not set: ClearML's own default server is a public one

Only finite numbers are sent (NaN, inf and text are dropped): these trackers take scalars.
"""

from __future__ import annotations

import importlib
import math
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

# backend -> (module imported, the pip command that installs it)
PACKAGES: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "pip install -e .[wandb]"),
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "mlflow": ("mlflow", "pip install -e .[mlflow]"),
    "swanlab": ("swanlab", "pip install -e .[swanlab]"),
    "trackio": ("trackio", "pip install -e .[trackio]"),
    "clearml": ("clearml", "pip install -e .[clearml]"),
}


def import_backend(name: str) -> ModuleType:
    """The package of backend `name`, or an ImportError that says how to install it."""
    module, install = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"trainer.logger contains {name!r} but the {module} package is not installed: "
                          f"`{install}`, or drop {name!r} from trainer.logger") from exc


def scalars(data: dict[str, Any]) -> dict[str, float]:
    """The entries of `data` that are finite numbers (tensors and numpy scalars included), as floats."""
    out = {}
    for key, value in data.items():
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (ValueError, RuntimeError):
                continue
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


def flat_config(config: Any, sep: str = "/") -> dict[str, str]:
    """A nested config dict as {"a/b/c": "value"} (lists by index), the form run parameters take."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{sep}{key}" if prefix else str(key))
        elif isinstance(node, list | tuple) and node and any(isinstance(v, dict | list | tuple) for v in node):
            for index, value in enumerate(node):
                walk(value, f"{prefix}{sep}{index}")
        else:
            out[prefix] = str(node)

    walk(config or {}, "")
    return out


# MLflow metric keys allow alphanumerics, underscores, periods, dashes, colons, spaces and slashes
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts, as veRL writes it: '@' -> '_at_', runs of '/' -> one, others -> '_'."""
    return _MLFLOW_BAD.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


class MlflowBackend:
    def __init__(self, project_name: str, experiment_name: str, config: Any, log_dir: Path) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (log_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses a file store unless told: it is the local store this backend promises
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = import_backend("mlflow")
        self.mlflow = mlflow
        self.tracking_uri = uri
        mlflow.set_tracking_uri(uri)
        run_id = os.environ.get("MLFLOW_RUN_ID")   # a platform's run to attach to, as veRL does
        if run_id:
            self.run = mlflow.start_run(run_id=run_id)
        else:
            experiment = mlflow.set_experiment(project_name)
            self.run = mlflow.start_run(experiment_id=experiment.experiment_id, run_name=experiment_name)
        params = {key: value[:6000] for key, value in flat_config(config).items()}   # MLflow's value limit
        if params:
            mlflow.log_params(params)

    def log(self, data: dict[str, Any], step: int) -> None:
        metrics = {mlflow_key(k): v for k, v in scalars(data).items()}
        if metrics:
            self.mlflow.log_metrics(metrics, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class SwanlabBackend:
    def __init__(self, project_name: str, experiment_name: str, config: Any, log_dir: Path) -> None:
        swanlab = import_backend("swanlab")
        self.swanlab = swanlab
        self.log_dir = Path(os.environ.get("SWANLAB_LOG_DIR") or log_dir / "swanlog")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run = swanlab.init(project=project_name, experiment_name=experiment_name,
                                config={"FRAMEWORK": "verl", **(config or {})}, logdir=str(self.log_dir),
                                mode=os.environ.get("SWANLAB_MODE") or "offline")

    def log(self, data: dict[str, Any], step: int) -> None:
        metrics = scalars(data)
        if metrics:
            self.swanlab.log(metrics, step=step)

    def finish(self) -> None:
        self.swanlab.finish()


class TrackioBackend:
    def __init__(self, project_name: str, experiment_name: str, config: Any, log_dir: Path) -> None:
        # trackio reads TRACKIO_DIR once, when it is first imported
        os.environ.setdefault("TRACKIO_DIR", str((log_dir / "trackio").resolve()))
        trackio = import_backend("trackio")
        self.trackio = trackio
        self.run = trackio.init(project=project_name, name=experiment_name, config=config or {})

    def log(self, data: dict[str, Any], step: int) -> None:
        metrics = scalars(data)
        if metrics:
            self.trackio.log(metrics, step=step)

    def finish(self) -> None:
        self.trackio.finish()


def clearml_server_configured() -> bool:
    """Whether the user pointed ClearML at a server (CLEARML_API_HOST, or a clearml.conf file)."""
    if os.environ.get("CLEARML_API_HOST"):
        return True
    conf = os.environ.get("CLEARML_CONFIG_FILE") or str(Path.home() / "clearml.conf")
    return Path(conf).is_file()


class ClearmlBackend:
    def __init__(self, project_name: str, experiment_name: str, config: Any, log_dir: Path) -> None:
        os.environ.setdefault("CLEARML_CACHE_DIR", str((log_dir / "clearml").resolve()))
        clearml = import_backend("clearml")
        offline_env = os.environ.get("CLEARML_OFFLINE_MODE")
        offline = (offline_env.strip().lower() not in ("", "0", "false", "no") if offline_env is not None
                   else not clearml_server_configured())
        clearml.Task.set_offline(offline_mode=offline)
        self.offline = offline
        if offline and hasattr(clearml.Task, "_report_subprocess_enabled"):
            # offline, events go to a local file: ClearML's reporting subprocess only adds a 6-11 s wait at close
            clearml.Task._report_subprocess_enabled = False
        self.task = clearml.Task.init(project_name=project_name, task_name=experiment_name, output_uri=False,
                                      auto_connect_frameworks=False, auto_connect_streams=False,
                                      auto_resource_monitoring=False, reuse_last_task_id=False)
        if config:
            self.task.connect_configuration(config, name="Hyperparameters")
        self.logger = self.task.get_logger()

    def log(self, data: dict[str, Any], step: int) -> None:
        for key, value in scalars(data).items():
            # a ClearML plot per metric group: "val-core/nq/reward/mean@2" -> title val-core, series the rest
            title, _, series = key.partition("/")
            self.logger.report_scalar(title=title, series=series or title, value=value, iteration=step)

    @property
    def offline_folder(self) -> Path | None:
        """The offline session's folder (task.json, metrics.jsonl); None when online."""
        return Path(self.task.get_offline_mode_folder()) if self.offline else None

    def finish(self) -> None:
        self.task.close()


OPTIONAL_BACKENDS = {"mlflow": MlflowBackend, "swanlab": SwanlabBackend, "trackio": TrackioBackend,
                     "clearml": ClearmlBackend}
