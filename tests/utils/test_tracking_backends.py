"""The optional trackers (veRL's names): each run writes offline / locally and its metrics read back from the
tracker's own store; a missing package fails with its install command; unknown names are refused at start-up.

Each round trip runs in a subprocess: the trackers patch imports, register exit hooks and read their
environment once (ClearML, trackio), which must not leak into the other tests of this process.
mlflow, swanlab and trackio cannot be installed beside requirements-lock.txt (docs/training.md
"Trackers": mlflow-skinny needs cachetools<8, swanlab protobuf<7, trackio pillow<13, the lock pins
cachetools 8.0.1, protobuf 7.36.2, pillow 13.0.0): `scripts/setup_env.sh test` installs each, at the
versions requirements-trackers.txt pins, into .venv/trackers/<name>, which its round trip's subprocess
puts on PYTHONPATH. A fake module checks their calls everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.utils import tracking_backends as tb
from verl.utils.tracking import BACKENDS, JSONL_NAME, Tracking, read_jsonl

REPO = Path(__file__).resolve().parents[2]
METRICS = [({"val-core/nq/reward/mean@2": 0.5, "critic/score/mean": 1.0, "note": "text", "bad": float("nan")}, 1),
           ({"val-core/nq/reward/mean@2": 0.75}, 2)]

# Per tracker: the program's read-back of the run it just logged, as {metric: [[step, value], ...]}.
READ_BACK = {
    "clearml": """
        folder = tracker.backends["clearml"].offline_folder
        out = {}
        for event in json.loads((folder / "metrics.jsonl").read_text()):
            out.setdefault(event["metric"] + "/" + event["variant"], []).append([event["iter"], event["value"]])
        assert str(folder).startswith(str(log_dir)), folder
    """,
    "mlflow": """
        from mlflow.tracking import MlflowClient
        backend = tracker.backends["mlflow"]
        assert backend.tracking_uri.startswith(log_dir.resolve().as_uri()), backend.tracking_uri
        client = MlflowClient(backend.tracking_uri)
        run = client.get_run(backend.run.info.run_id)
        assert run.data.params["trainer/seed"] == "1", run.data.params
        out = {key: [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)]
               for key in run.data.metrics}
    """,
    "swanlab": """
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
        from swanlab.sdk.internal.core_python.store import DataStoreReader
        (path,) = (log_dir / "swanlog").glob("run-*/run-*.swanlab")
        reader, out = DataStoreReader(), {}
        reader.open(path)
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            if record.HasField("scalar"):
                out.setdefault(record.scalar.key, []).append([record.scalar.step, record.scalar.value.number])
    """,
    "trackio": """
        from trackio.sqlite_storage import SQLiteStorage
        assert list((log_dir / "trackio").glob("*.db"))
        out = {}
        for row in SQLiteStorage.get_logs("p", "e"):
            for key, value in row.items():
                if key not in ("step", "timestamp") and not key.startswith("_"):
                    out.setdefault(key, []).append([row["step"], value])
    """,
}
EXPECTED = {
    "clearml": {"val-core/nq/reward/mean@2": [[1, 0.5], [2, 0.75]], "critic/score/mean": [[1, 1.0]]},
    "mlflow": {"val-core/nq/reward/mean_at_2": [[1, 0.5], [2, 0.75]], "critic/score/mean": [[1, 1.0]]},
    "swanlab": {"val-core/nq/reward/mean@2": [[1, 0.5], [2, 0.75]], "critic/score/mean": [[1, 1.0]]},
    "trackio": {"val-core/nq/reward/mean@2": [[1, 0.5], [2, 0.75]], "critic/score/mean": [[1, 1.0]]},
}


def side_install(name: str) -> Path | None:
    """.venv/trackers/<name>: the tracker's own --no-deps install (requirements-trackers.txt), if made."""
    folder = Path(sys.prefix) / "trackers" / name
    return folder if folder.is_dir() else None


def run_round_trip(name: str, tmp_path: Path) -> dict[str, list[list[float]]]:
    """Log METRICS with backend `name` in a fresh interpreter (HOME and the log dir in tmp_path, no
    tracker variables set) and return what the tracker's store holds afterwards."""
    program = textwrap.dedent("""
        import json, sys
        from math import nan
        from pathlib import Path
        from verl.utils.tracking import Tracking
        log_dir = Path(sys.argv[1])
        tracker = Tracking("p", "e", [NAME], config={"trainer": {"seed": 1, "logger": [NAME]}}, log_dir=log_dir)
        for data, step in METRICS:
            tracker.log(data, step=step)
        tracker.finish()
    """).replace("NAME", repr(name)).replace("METRICS", repr(METRICS))
    program += textwrap.dedent(READ_BACK[name]) + '\nprint("READ_BACK " + json.dumps(out))\n'
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "SWANLAB_", "TRACKIO_", "CLEARML_", "TRAINS_"))}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join(
        str(p) for p in (side_install(name), REPO, os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", program, str(tmp_path / "logs")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("READ_BACK ")]
    return json.loads(line.removeprefix("READ_BACK "))


@pytest.mark.parametrize("name", ["clearml", "mlflow", "swanlab", "trackio"])
def test_tracker_writes_offline_and_reads_back(name: str, tmp_path: Path) -> None:
    module = tb.PACKAGES[name][0]
    if importlib.util.find_spec(module) is None and side_install(name) is None:
        pytest.skip(f"{module} is not installed: `bash scripts/setup_env.sh test` puts it in "
                    f"{Path(sys.prefix) / 'trackers' / name} (this file's docstring)")
    got = run_round_trip(name, tmp_path)
    for key, points in EXPECTED[name].items():
        assert got.get(key) == points, (key, got)
    assert not any("note" in key or "bad" in key for key in got), got   # text and NaN are not sent


def test_clearml_stays_offline_without_a_configured_server(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("CLEARML_API_HOST", "CLEARML_CONFIG_FILE"):
        monkeypatch.delenv(key, raising=False)
    assert not tb.clearml_server_configured()
    (tmp_path / "clearml.conf").write_text("api { api_server: http://127.0.0.1:8008 }\n")
    assert tb.clearml_server_configured()


class _Recorder(types.ModuleType):
    """A stand-in package: every attribute is a function that records its call."""

    def __init__(self, name: str, returns: dict[str, object] | None = None) -> None:
        super().__init__(name)
        self.calls: list[tuple[str, tuple, dict]] = []
        self.returns = returns or {}

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            self.calls.append((attr, args, kwargs))
            return self.returns.get(attr)

        return call


def test_mlflow_backend_logs_a_local_file_store_run_with_veRL_metric_keys(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    fake = _Recorder("mlflow", {"set_experiment": types.SimpleNamespace(experiment_id="7")})
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    tracker = Tracking("proj", "exp", ["mlflow"], config=OmegaConf.create({"a": {"b": [1, 2]}}), log_dir=tmp_path)
    tracker.log({"val-core/nq/reward/maj@4/mean": 0.5, "x//y z": 1, "s": "text"}, step=3)
    tracker.finish()
    calls = {name: (args, kwargs) for name, args, kwargs in fake.calls}
    assert calls["set_tracking_uri"][0] == ((tmp_path / "mlruns").resolve().as_uri(),)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    assert calls["set_experiment"][0] == ("proj",)
    assert calls["start_run"][1] == {"experiment_id": "7", "run_name": "exp"}
    assert calls["log_params"][0] == ({"a/b": "[1, 2]"},)
    assert calls["log_metrics"] == (({"val-core/nq/reward/maj_at_4/mean": 0.5, "x/y z": 1.0},), {"step": 3})
    assert "end_run" in calls


@pytest.mark.parametrize("name, module, mode_key", [("swanlab", "swanlab", "mode"), ("trackio", "trackio", None)])
def test_swanlab_and_trackio_backends_run_locally(name: str, module: str, mode_key: str | None, tmp_path: Path,
                                                  monkeypatch) -> None:
    for key in ("SWANLAB_MODE", "SWANLAB_LOG_DIR", "TRACKIO_DIR"):
        monkeypatch.delenv(key, raising=False)
    fake = _Recorder(module)
    monkeypatch.setitem(sys.modules, module, fake)
    tracker = Tracking("proj", "exp", [name], config={"a": 1}, log_dir=tmp_path)
    tracker.log({"val-core/nq/reward/best@2/mean": 1.0, "s": "text"}, step=2)
    tracker.finish()
    calls = {n: (args, kwargs) for n, args, kwargs in fake.calls}
    assert calls["log"] == (({"val-core/nq/reward/best@2/mean": 1.0},), {"step": 2})
    assert "finish" in calls
    if name == "swanlab":
        assert calls["init"][1]["mode"] == "offline"
        assert calls["init"][1]["logdir"] == str(tmp_path / "swanlog")
        assert calls["init"][1]["experiment_name"] == "exp"
    else:
        assert os.environ["TRACKIO_DIR"] == str((tmp_path / "trackio").resolve())
        assert calls["init"][1] == {"project": "proj", "name": "exp", "config": {"a": 1}}


@pytest.mark.parametrize("name", ["mlflow", "swanlab", "trackio", "clearml", "wandb"])
def test_a_missing_tracker_package_names_its_install_command(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, tb.PACKAGES[name][0], None)   # import raises ImportError
    with pytest.raises(ImportError, match=rf"trainer.logger contains '{name}' but .* `pip install -e \.\[{name}\]`"):
        Tracking("p", "e", ["jsonl", name], log_dir=tmp_path)


def test_file_is_veRL_s_name_for_the_jsonl_file(tmp_path: Path) -> None:
    tracker = Tracking("p", "e", ["file", "jsonl"], log_dir=tmp_path)
    tracker.log({"a": 1.0}, step=1)
    tracker.finish()
    assert read_jsonl(tmp_path / JSONL_NAME) == [{"step": 1, "a": 1.0}]   # once, though named twice


def test_unknown_logger_is_refused_at_start_up_naming_the_list() -> None:
    from verl.trainer.config_schema import ConfigError
    from verl.trainer.run_config import Trainer

    cfg = OmegaConf.create({"trainer": {"logger": ["console", "mlfow"], "device": "cpu", "ray_address": None}})
    with pytest.raises(ConfigError) as err:
        Trainer.from_config(cfg)
    assert "'mlfow'" in str(err.value)
    for name in ("console", "jsonl", "file", "wandb", "tensorboard", "mlflow", "swanlab", "trackio", "clearml"):
        assert repr(name) in str(err.value), name
    assert set(BACKENDS) == {"console", "jsonl", "file", "wandb", "tensorboard", "mlflow", "swanlab", "trackio",
                             "clearml"}


def test_a_tracker_whose_package_is_missing_is_refused_at_start_up(monkeypatch) -> None:
    from verl.trainer import config_check

    monkeypatch.setattr(config_check, "is_installed", lambda module: module != "swanlab")
    cfg = OmegaConf.load(REPO / "verl/trainer/config/ppo_trainer.yaml")
    cfg.trainer.logger = ["console", "swanlab"]
    errors = config_check.check_imports(cfg, config_check.RunConfig.from_config(cfg), None)
    assert any("'swanlab'" in e and "pip install -e .[swanlab]" in e for e in errors), errors


def test_the_side_installs_are_exact_pins_that_only_add_to_the_lock() -> None:
    """requirements-trackers.txt: each line a tracker of ours and exact pins of packages the lock does not
    have, so a round trip's PYTHONPATH adds the tracker without replacing any locked version."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    locked = {canonicalize_name(line.split("==")[0]) for line in (REPO / "requirements-lock.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    lines = [line.split() for line in (REPO / "requirements-trackers.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert sorted(tracker for tracker, *_ in lines) == ["mlflow", "swanlab", "trackio"]
    for tracker, *pins in lines:
        assert tracker in tb.PACKAGES and pins, tracker
        for pin in pins:
            req = Requirement(pin)
            assert [s.operator for s in req.specifier] == ["=="], pin
            assert canonicalize_name(req.name) not in locked, f"{tracker}: {pin} would shadow the lock's pin"
