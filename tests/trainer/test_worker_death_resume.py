"""A training worker killed mid-run: the driver's error names the role and rank that died, the
last complete checkpoint and how to resume from it; running the same command does resume."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.single_controller.base import Dispatch, Worker, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, WorkerDiedError
from verl.trainer import main_ppo
from verl.trainer.ppo import checkpointing as ck

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class StepWorker(Worker):
    """Stands in for the actor_rollout workers: a call that takes long enough to be killed in."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_for(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


def _config(model_dir: str, data, ckpt: Path, steps: int, extra: list[str] = ()):
    overrides = toy_overrides(model_dir, data, str(ckpt), adv_estimator="grpo", steps=steps)
    return main_ppo.compose_config([*overrides, "trainer.save_freq=1", *extra])


def _save(root: Path, step: int) -> None:
    tmp = ck.begin_checkpoint(root, step)
    ck.save_driver_state(tmp, step, {"pos": step})
    ck.finalize_checkpoint(root, step, max_to_keep=3)


def _fit_while_a_worker_dies(trainer) -> WorkerDiedError:
    """trainer.fit() with its worker group doing a long call in which rank 1 is SIGKILLed."""
    pool = RayResourcePool([2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(StepWorker))
    group.role = "actor_rollout"   # as RayWorkerGroup.spawn names the trainer's view
    try:
        trainer.actor_rollout_wg = group
        trainer.load_checkpoint = lambda: group.train_for(120)   # the first call fit() makes
        pid = group.pid()[1]
        threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL)).start()
        with pytest.raises(WorkerDiedError) as info:
            trainer.fit()
        assert f"actor_rollout rank 1 (pid {pid}, node " in str(info.value)
        assert isinstance(info.value.__cause__, ray.exceptions.ActorDiedError)
        return info.value
    finally:
        group.shutdown()
        pool.release()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A built trainer (data, config; no workers spawned) whose checkpoint folder tests point anywhere."""
    data = write_toy_parquets(tmp_path_factory.mktemp("data"), n_train=8, n_val=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return main_ppo.build_trainer(_config(tiny_model_dir, data, tmp_path_factory.mktemp("ckpt"), steps=3),
                                  reward_fn=ContainsTokenReward(tok))


def test_the_error_names_the_dead_rank_and_the_checkpoint_to_resume_from(
        ray_cluster, trainer, tmp_path: Path) -> None:
    for step in (1, 2):
        _save(tmp_path, step)
    trainer.config.trainer.default_local_dir = str(tmp_path)
    trainer.config.trainer.resume_mode = "auto"
    message = str(_fit_while_a_worker_dies(trainer))
    assert f"Last complete checkpoint: {tmp_path / 'global_step_2'} (step 2)" in message
    assert "Running the same command resumes from it (trainer.resume_mode=auto)" in message


def test_the_resume_hint_without_a_checkpoint_or_without_auto(trainer, tmp_path: Path) -> None:
    cfg = trainer.config.trainer
    cfg.default_local_dir, cfg.resume_mode, cfg.save_freq = str(tmp_path), "auto", 1
    assert trainer._resume_hint() == (f"Last complete checkpoint: none under {tmp_path} (trainer.save_freq=1); "
                                      "running the same command starts again from step 0.")
    cfg.save_freq = -1
    assert "set trainer.save_freq=N to save every N steps" in trainer._resume_hint()
    _save(tmp_path, 3)
    cfg.resume_mode = "disable"
    assert trainer._resume_hint() == (
        f"Last complete checkpoint: {tmp_path / 'global_step_3'} (step 3). To resume from it, run the same "
        f"command with trainer.resume_mode=auto (or trainer.resume_mode={tmp_path / 'global_step_3'}); "
        "this run had trainer.resume_mode=disable.")


@pytest.mark.slow
def test_run_ppo_names_a_killed_worker_and_the_same_command_resumes(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    data = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    ckpt = tmp_path / "ckpt"
    cfg = _config(tiny_model_dir, data, ckpt, steps=4)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def kill_rank_1_after_the_first_checkpoint() -> None:
        while not (ckpt / ck.LATEST_FILE).is_file():
            time.sleep(0.2)
        # RayWorkerGroup names actors {prefix}{class}_{node}:{local rank}; this driver's namespace.
        name = next(n for n in ray.util.list_named_actors() if n.endswith("_0:1"))
        actor = ray.get_actor(name)
        os.kill(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1_after_the_first_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(WorkerDiedError) as info:
        main_ppo.run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    killer.join(timeout=5)
    latest = ck.latest_checkpoint(ckpt)
    message = str(info.value)
    assert "actor_rollout rank 1 (pid " in message
    assert f"Last complete checkpoint: {latest} (step {ck.step_of(latest)})" in message
    assert "Running the same command resumes from it" in message

    resumed = main_ppo.run_ppo(_config(tiny_model_dir, data, ckpt, steps=4),
                               reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    assert resumed[0]["step"] == ck.step_of(latest) + 1 and resumed[-1]["step"] == 4
