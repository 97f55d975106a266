"""`+trainer.preflight=true`: the run's own config, composed and checked in seconds, with no Ray,
worker or weights; exit status 0 when the run would start, 1 otherwise (verl/trainer/preflight.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from verl.trainer import main_ppo
from verl.trainer.config_check import ConfigError
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.trainer.preflight import run_preflight

REPO = Path(__file__).resolve().parents[2]
# 2 workers: 8 prompts x 1 sample, mini-batches of 4 rollouts, micro-batches of 2
SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size=2", "actor_rollout_ref.ref.log_prob_micro_batch_size=2",
         "trainer.logger=[console]"]
# 2 nodes x 8 GPUs joined through Slurm, the PPO recipe (one critic row per worker)
TWO_BY_EIGHT = ["trainer.ray_address=auto", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                "data.train_batch_size=512", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                "actor_rollout_ref.actor.ppo_micro_batch_size=64", "critic.ppo_micro_batch_size=16",
                "trainer.logger=[console]"]


def test_a_valid_config_passes_with_the_per_worker_sizes_the_workers_will_use() -> None:
    cfg = compose_config(SMALL)
    report = run_preflight(cfg, has_gpu=False)
    assert report.ok, report.render()
    text = report.render()
    assert "trainer.nnodes=1 x trainer.n_gpus_per_node=2 = 2" in text
    assert "rollout: auto -> hf" in text
    # normalize_actor/critic_batch_sizes' own results: 4 rollouts / 2 workers, 2 rows / 2 workers
    assert "actor per worker: mini-batch 2 rows, micro-batch 1, log-prob micro-batch 1; 2 optimizer step(s)" in text
    assert "critic per worker: mini-batch 2 rows, micro-batch 1, forward micro-batch 1" in text
    assert text.endswith("preflight OK")
    # the workers divided copies: the caller's config is untouched, interpolations included
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert OmegaConf.is_interpolation(cfg.critic, "ppo_mini_batch_size")


def test_what_the_workers_would_refuse_over_nnodes_x_n_gpus_per_node_fails() -> None:
    report = run_preflight(compose_config([*TWO_BY_EIGHT, "critic.ppo_micro_batch_size=8"]))
    assert not report.ok
    text = report.render()
    assert "preflight FAILED" in text
    assert "critic.ppo_micro_batch_size=8 is not divisible by trainer.nnodes*trainer.n_gpus_per_node=16" in text
    # the critic worker's own division (normalize_critic_batch_sizes), reported with the world size
    assert "critic worker batch sizes over 16 workers: critic.ppo_micro_batch_size=8 (x1) is not divisible by " \
           "the 16 data-parallel workers" in text
    assert run_preflight(compose_config(TWO_BY_EIGHT)).ok


def test_cluster_settings_and_missing_packages_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    report = run_preflight(compose_config([*SMALL, "trainer.nnodes=2"]), has_gpu=False)
    assert any("trainer.nnodes=2 needs a Ray cluster" in e for e in report.errors), report.render()

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    report = run_preflight(compose_config([*SMALL, "trainer.logger=[console,wandb]"]), has_gpu=False)
    assert any("`pip install -e .[wandb]`" in e for e in report.errors), report.render()


def test_run_ppo_with_preflight_checks_and_returns_without_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args, **kwargs):
        raise AssertionError("preflight started part of the run")

    for name in ("build_trainer", "_init_ray", "wait_for_retriever"):
        monkeypatch.setattr(main_ppo, name, must_not_run)
    assert run_ppo(compose_config([*SMALL, "+trainer.preflight=true"])) == []
    with pytest.raises(ConfigError, match=r"preflight FAILED[\s\S]*actor_rollout_ref.actor.ppo_micro_batch_size=3"):
        run_ppo(compose_config([*SMALL, "+trainer.preflight=true", "actor_rollout_ref.actor.ppo_micro_batch_size=3"]))


def _entry_point(tmp_path: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides, "+trainer.preflight=true",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def test_the_entry_point_exits_0_or_1_with_the_report(tmp_path: Path) -> None:
    ok, seconds = _entry_point(tmp_path / "ok", TWO_BY_EIGHT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "preflight OK" in ok.stdout
    assert "host unknown from here" in ok.stdout      # joining a cluster from a machine with no GPU
    print(f"preflight of a 2 x 8 config through python -m verl.trainer.main_ppo: {seconds:.1f} s")
    assert seconds < 240                               # seconds on an idle machine; generous for a busy CI box
    bad, _ = _entry_point(tmp_path / "bad", [*TWO_BY_EIGHT, "critic.ppo_micro_batch_size=8"])
    assert bad.returncode == 1
    assert "preflight FAILED" in bad.stdout and "critic.ppo_micro_batch_size=8" in bad.stdout
    assert "Traceback" not in bad.stderr
