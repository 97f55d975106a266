"""global_profiler (issue 46 item 6, veRL's keys tool / steps / save_path): a profiled training step leaves
chrome traces of the driver and of each worker process, and only the chosen steps do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from tests.trainer._profiled_worker import ProfiledWorker
from verl.utils.profiler import ProfilerConfig, StepProfiler, trace_path


def trace_names(path: Path) -> set[str]:
    """The event names of a chrome trace file (it must parse as JSON and hold events)."""
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert events, path
    return {e.get("name", "") for e in events}


class _RecordingGroup:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start_profile(self, save_path: str, step: int, group: str) -> None:
        self.calls.append(("start", save_path, step, group))

    def stop_profile(self) -> list[str | None]:
        self.calls.append(("stop",))
        return [None]


def test_a_step_that_takes_several_calls_stays_in_one_trace_and_other_steps_are_not_traced(tmp_path: Path) -> None:
    group = _RecordingGroup()
    profiler = StepProfiler(ProfilerConfig("torch", (2,), str(tmp_path)), lambda: [("actor_rollout", group)])
    profiler.begin(1)
    profiler.end(1)
    assert group.calls == [] and not list(tmp_path.iterdir())
    profiler.begin(2)           # dynamic sampling: a generation batch that did not finish step 2
    profiler.end(1)
    profiler.begin(2)           # the next call of the same step: still the same recording
    profiler.end(2)
    assert group.calls == [("start", str(tmp_path), 2, "actor_rollout"), ("stop",)]
    assert profiler.written == [str(trace_path(tmp_path, 2, "driver"))]
    trace_names(tmp_path / "step_2" / "driver.json")


@pytest.mark.parametrize("node, message", [
    ({"tool": "nsys", "steps": [1]}, "global_profiler.tool=nsys is not wired"),
    ({"tool": "npu", "steps": [1]}, "global_profiler.tool='npu' is unknown"),
    ({"tool": "torch", "steps": [0]}, "global_profiler.steps=[0] must be a list of training steps"),
    ({"tool": "torch", "steps": None}, "profiles the steps in global_profiler.steps, which is empty"),
])
def test_bad_profiler_settings_are_refused_naming_the_key(node: dict, message: str) -> None:
    errors = ProfilerConfig.errors(OmegaConf.create({"global_profiler": {"save_path": "p", **node}}))
    assert any(message in e for e in errors), errors
    assert ProfilerConfig.errors(OmegaConf.create({"global_profiler": {"tool": None, "steps": None}})) == []


def test_the_trainer_traces_the_chosen_step_on_the_driver(tiny_model_dir: str, tmp_path: Path) -> None:
    """fit() with global_profiler.steps=[1]: the driver's trace names the step's stages, and the worker
    groups are asked to trace the same step."""
    from tests.trainer.test_main_ppo import ScriptedActorRollout, _scripted_trainer

    class ProfiledScripted(ScriptedActorRollout, _RecordingGroup):
        def __init__(self, *args) -> None:
            ScriptedActorRollout.__init__(self, *args)
            _RecordingGroup.__init__(self)

    save = tmp_path / "profile"
    trainer = _scripted_trainer(tiny_model_dir, tmp_path, extra=(
        "global_profiler.tool=torch", "global_profiler.steps=[1]", f"global_profiler.save_path={save}"))
    scripted = trainer.actor_rollout_wg
    trainer.actor_rollout_wg = ProfiledScripted(scripted.response_ids, scripted.pad_id)
    trainer.fit()
    assert trainer.actor_rollout_wg.calls == [("start", str(save), 1, "actor_rollout"), ("stop",)]
    names = trace_names(save / "step_1" / "driver.json")
    assert {"step", "gen", "adv", "update_actor"} <= names, sorted(names)[:50]


def test_each_worker_process_writes_a_chrome_trace_of_its_calls(ray_cluster, tmp_path: Path) -> None:
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(ProfiledWorker))
    try:
        group.start_profile(str(tmp_path), 3, "actor_rollout")
        group.matmul_work()
        written = group.stop_profile()
    finally:
        group.shutdown()
        pool.release()
    assert written == [str(trace_path(tmp_path, 3, f"actor_rollout_rank{r}")) for r in range(2)]
    for path in written:
        names = trace_names(Path(path))
        assert "matmul_work" in names and "aten::mm" in names, sorted(names)[:40]


@pytest.mark.slow
def test_run_ppo_writes_traces_of_the_profiled_step(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    """One GRPO step through run_ppo (two Ray workers, HF rollout, tiny model) with global_profiler on."""
    from verl.trainer.main_ppo import compose_config, run_ppo

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    save = tmp_path / "profile"
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt")) + [
        "global_profiler.tool=torch", "global_profiler.steps=[1]", f"global_profiler.save_path={save}"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    run_ppo(cfg, reward_fn=ContainsTokenReward(tok))
    assert {"gen", "update_actor"} <= trace_names(save / "step_1" / "driver.json")
    for rank in range(2):
        names = trace_names(save / "step_1" / f"actor_rollout_rank{rank}.json")
        assert {"generate_sequences", "compute_log_prob", "update_actor"} <= names, rank
