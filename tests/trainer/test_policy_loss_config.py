"""The policy-loss keys through the real config path (Hydra's compose of ppo_trainer.yaml and the start-up
checks), custom_algorithms.path from the driver's check to an actor worker's update (a fresh process,
as a Ray worker is), and the actor's loss lookup."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.workers._batches import make_ppo_batch
from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.registry import (
    BUILTIN_POLICY_LOSSES,
    CUSTOM_ALGORITHMS_WORKER_KEY,
    POLICY_LOSS_REGISTRY,
    get_adv_estimator_fn,
    get_policy_loss_fn,
)
from verl.utils import batch_keys as K
from verl.workers.actor.dp_actor import DataParallelPPOActor

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "example/custom_algorithms.py"
LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


def errors(*overrides: str) -> list[str]:
    return config_errors(compose_config(list(overrides)))


def test_the_yaml_declares_veRLs_keys_and_defaults():
    actor = compose_config([]).actor_rollout_ref.actor
    assert OmegaConf.to_container(actor.policy_loss) == {
        "loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
        "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
    assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, None, None, 3.0)
    assert (actor.tau_pos, actor.tau_neg, actor.loss_scale_factor) == (1.0, 1.05, None)
    assert compose_config([]).custom_algorithms.path is None
    assert errors() == []


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"])
def test_every_builtin_loss_mode_passes_the_checks(mode):
    assert errors(f"{LOSS_KEY}={mode}", "algorithm.adv_estimator=grpo") == []


def test_an_unknown_loss_mode_is_refused_naming_the_key_and_the_choices():
    found = errors(f"{LOSS_KEY}=ppo2")
    assert len(found) == 1
    # the choices are every registered loss: the eight built-ins, and any a custom file registered in
    # this process before (an earlier test's example file: the registry is per process)
    registered = sorted(set(BUILTIN_POLICY_LOSSES) | set(POLICY_LOSS_REGISTRY))
    assert set(BUILTIN_POLICY_LOSSES) == {"cispo", "clip_cov", "geo_mean", "gpg", "gspo", "kl_cov", "sapo", "vanilla"}
    assert found[0].startswith(f"{LOSS_KEY}='ppo2' is unknown; choose one of {registered}")
    assert "custom_algorithms.path" in found[0]


@pytest.mark.parametrize("override,message", [
    ("actor_rollout_ref.actor.clip_ratio_low=-0.1", "actor_rollout_ref.actor.clip_ratio_low=-0.1 must be a number >= 0"),
    ("actor_rollout_ref.actor.clip_ratio_high=-1", "actor_rollout_ref.actor.clip_ratio_high=-1 must be a number >= 0"),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0", "policy_loss.clip_cov_ratio=0 must be in (0, 1]"),
    ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio=2", "policy_loss.kl_cov_ratio=2 must be in (0, 1]"),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_lb=6", "clip_cov_lb=6 must be < clip_cov_ub=5.0"),
    ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef=-1", "ppo_kl_coef=-1 must be a number >= 0"),
    ("actor_rollout_ref.actor.tau_neg=0", "actor_rollout_ref.actor.tau_neg=0 must be a number > 0"),
    ("actor_rollout_ref.actor.loss_scale_factor=0", "actor_rollout_ref.actor.loss_scale_factor=0 must be a number > 0"),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean", "actor_rollout_ref.actor.loss_agg_mode='seq-mean' is unknown"),
])
def test_bad_policy_loss_values_are_refused_naming_the_key(override, message):
    found = errors(override)
    assert any(message in e for e in found), found


def test_the_new_aggregation_mode_passes_for_actor_and_critic():
    assert errors("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                  "actor_rollout_ref.actor.loss_scale_factor=4096") == []


SUM_NORM = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"


@pytest.mark.parametrize("overrides,bound", [
    # <search> tags: (max_turns + 1) turns of data.max_response_length and max_turns observations
    (["do_search=true", "max_turns=2", "data.max_response_length=500", "data.max_obs_length=300"], 3 * 500 + 2 * 300),
    (["do_search=false", "data.max_response_length=500"], 500),
])
def test_dr_grpos_null_scale_factor_becomes_the_runs_response_length_bound(overrides, bound):
    cfg = compose_config([SUM_NORM, *overrides])
    assert cfg.actor_rollout_ref.actor.loss_scale_factor is None
    assert config_errors(cfg) == []
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == bound


def test_a_set_scale_factor_or_another_mode_is_left_alone():
    cfg = compose_config([SUM_NORM, "actor_rollout_ref.actor.loss_scale_factor=4096"])
    assert config_errors(cfg) == [] and cfg.actor_rollout_ref.actor.loss_scale_factor == 4096
    cfg = compose_config(["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    assert config_errors(cfg) == [] and cfg.actor_rollout_ref.actor.loss_scale_factor is None


def test_dr_grpos_gradient_scale_does_not_move_with_the_steps_longest_row():
    """Responses are padded to the step's longest row. One row (3 tokens) trained in a step whose other
    row has 5 tokens, then in one whose other row has 40: with the actor config the start-up check leaves,
    its per-token gradient is the same in both steps (a divisor taken from the padded width would make
    it 8x smaller in the second)."""
    cfg = compose_config([SUM_NORM, "do_search=false", "data.max_response_length=64"])
    assert config_errors(cfg) == []
    actor = cfg.actor_rollout_ref.actor
    loss_fn = get_policy_loss_fn("vanilla")

    def row_gradient(other_len: int) -> torch.Tensor:
        width = max(3, other_len)
        mask = torch.zeros(2, width)
        mask[0, :3], mask[1, :other_len] = 1.0, 1.0
        old = torch.full((2, width), -1.0)
        new = old.clone().requires_grad_(True)
        advantages = torch.ones(2, width)
        loss, _ = loss_fn(old, new, advantages, mask, actor.loss_agg_mode, actor)
        loss.backward()
        return new.grad[0, :3]

    short, long = row_gradient(5), row_gradient(40)
    torch.testing.assert_close(short, long, rtol=0, atol=0)
    # -A r / factor / rows: r = 1, A = 1, factor 64, 2 rows
    torch.testing.assert_close(short, torch.full((3,), -1.0 / 64 / 2))


def test_the_critics_value_loss_gets_the_same_constant_divisor():
    """The critic's loss_agg_mode follows the actor's: under seq-mean-token-sum-norm its value loss gets the
    run's bound too, so a row's value gradient does not move with the step's longest row either."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    cfg = compose_config([SUM_NORM, "do_search=false", "data.max_response_length=64"])
    assert cfg.critic.loss_scale_factor is None
    assert config_errors(cfg) == []
    critic = cfg.critic
    assert critic.loss_agg_mode == "seq-mean-token-sum-norm" and critic.loss_scale_factor == 64

    def row_gradient(other_len: int) -> torch.Tensor:
        width = max(3, other_len)
        mask = torch.zeros(2, width)
        mask[0, :3], mask[1, :other_len] = 1.0, 1.0
        vpreds = torch.zeros(2, width, requires_grad=True)
        loss, _ = compute_value_loss(vpreds, torch.ones(2, width), torch.zeros(2, width), mask, 10.0,
                                     critic.loss_agg_mode, critic.loss_scale_factor)
        loss.backward()
        return vpreds.grad[0, :3]

    short, long = row_gradient(5), row_gradient(40)
    torch.testing.assert_close(short, long, rtol=0, atol=0)
    # d/dv 0.5 (v - 1)^2 = -1 at v = 0, / factor 64 / 2 rows
    torch.testing.assert_close(short, torch.full((3,), -1.0 / 64 / 2))


def test_geo_mean_with_per_token_advantages_is_refused_with_the_reason(tiny_model_dir):
    found = errors(f"{LOSS_KEY}=geo_mean", "algorithm.adv_estimator=gae", f"critic.model.path={tiny_model_dir}")
    assert found == [f"{LOSS_KEY}=geo_mean needs one advantage per sequence (GMPO averages a row's advantages); "
                     "algorithm.adv_estimator=gae gives per-token advantages: use an outcome estimator (grpo, "
                     "rloo, reinforce_plus_plus) or another loss_mode"]


# ------------------------------------------------------------------ custom_algorithms.path
def test_a_custom_file_registers_its_names_before_the_checks_and_the_path_becomes_absolute(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = compose_config([f"custom_algorithms.path={EXAMPLE}", f"{LOSS_KEY}=reinforce_clipped_weight"])
    assert config_errors(cfg) == []
    assert cfg.custom_algorithms.path == str(REPO / EXAMPLE)
    assert get_policy_loss_fn("reinforce_clipped_weight").__module__.startswith("search_r1_custom_algorithms_")
    advantages, returns = get_adv_estimator_fn("group_mean_baseline")(
        token_level_rewards=torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 0.0]]),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]), index=["a", "a", "b"])
    torch.testing.assert_close(advantages, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))


def test_a_missing_custom_file_is_refused_naming_the_key(tmp_path):
    found = errors(f"custom_algorithms.path={tmp_path}/none.py")
    assert found == [f"custom_algorithms.path: no file '{tmp_path}/none.py'"]


def test_a_custom_file_that_fails_to_import_is_refused_naming_the_key_and_the_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    found = errors(f"custom_algorithms.path={bad}")
    assert found == [f"custom_algorithms.path: importing '{bad}' failed: RuntimeError: boom"]


def test_the_trainer_hands_the_custom_file_to_the_actor_workers_only_when_set(monkeypatch):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    monkeypatch.chdir(REPO)
    plain = compose_config([])
    OmegaConf.resolve(plain)
    assert RayPPOTrainer.worker_configs(SimpleNamespace(config=plain, use_critic=False))["actor_rollout"] \
        is plain.actor_rollout_ref
    cfg = compose_config([f"custom_algorithms.path={EXAMPLE}", f"{LOSS_KEY}=reinforce_clipped_weight"])
    assert config_errors(cfg) == []
    OmegaConf.resolve(cfg)
    worker = RayPPOTrainer.worker_configs(SimpleNamespace(config=cfg, use_critic=False))["actor_rollout"]
    assert worker[CUSTOM_ALGORITHMS_WORKER_KEY] == str(REPO / EXAMPLE)
    assert CUSTOM_ALGORITHMS_WORKER_KEY not in cfg.actor_rollout_ref          # the driver's tree is untouched


WORKER_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    from tests.workers._batches import make_ppo_batch
    from verl.trainer.ppo.registry import POLICY_LOSS_REGISTRY
    from verl.utils import batch_keys as K
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    config = OmegaConf.load(sys.argv[1])
    assert "reinforce_clipped_weight" not in POLICY_LOSS_REGISTRY      # a fresh process, as a Ray worker
    worker = ActorRolloutRefWorker(config, role="actor")
    assert "reinforce_clipped_weight" in POLICY_LOSS_REGISTRY
    module = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
    OmegaConf.update(worker.config.actor, "ppo_mini_batch_size", 4)
    OmegaConf.update(worker.config.actor, "ppo_micro_batch_size", 2)
    actor = DataParallelPPOActor(worker.config.actor, module, torch.optim.SGD(module.parameters(), lr=1e-2))
    data = make_ppo_batch(module.config.vocab_size, batch_size=4, seed=2)
    data.meta_info = {K.META_TEMPERATURE: 1.0}
    metrics = actor.update_policy(data)
    print(sorted(metrics))
""")


def test_an_actor_worker_imports_the_custom_file_and_updates_with_its_loss(tiny_model_dir, tmp_path, monkeypatch):
    """The driver's check makes the path absolute, the trainer's worker config carries it, and an actor
    worker in a fresh process (nothing registered there) imports it when built, then its update runs
    the custom loss (which reports actor/ppo_kl but no clip fractions)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    monkeypatch.chdir(REPO)
    cfg = compose_config([f"custom_algorithms.path={EXAMPLE}", f"{LOSS_KEY}=reinforce_clipped_weight",
                          f"actor_rollout_ref.model.path={tiny_model_dir}"])
    assert config_errors(cfg) == []
    OmegaConf.resolve(cfg)
    worker_cfg = RayPPOTrainer.worker_configs(SimpleNamespace(config=cfg, use_critic=False))["actor_rollout"]
    OmegaConf.save(worker_cfg, tmp_path / "worker.yaml")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, str(tmp_path / "worker.yaml"), tiny_model_dir],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    keys = eval(done.stdout.strip().splitlines()[-1])
    assert "actor/pg_loss" in keys and "actor/ppo_kl" in keys and "actor/pg_clipfrac" not in keys


# ------------------------------------------------------------------ the actor's lookup
def _actor(model_dir: str, **settings):
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OmegaConf.create({"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 4, "clip_ratio": 0.2, **settings})
    return DataParallelPPOActor(cfg, module, torch.optim.SGD(module.parameters(), lr=1e-2))


def test_the_actor_refuses_an_unknown_loss_mode_when_built(tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown actor_rollout_ref.actor.policy_loss.loss_mode 'nope'"):
        _actor(tiny_model_dir, policy_loss={"loss_mode": "nope"})


@pytest.mark.parametrize("mode", ["gspo", "cispo"])
def test_the_actor_logs_the_chosen_losss_metrics(tiny_model_dir, mode):
    """The pg_loss the actor logs is the registered loss's value on the actor's own log-probs."""
    actor = _actor(tiny_model_dir, policy_loss={"loss_mode": mode}, clip_ratio_high=0.28)
    data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=4, seed=5)
    data.meta_info = {K.META_TEMPERATURE: 1.0}
    probe = copy.copy(data)
    probe.meta_info = {**data.meta_info, K.META_MICRO_BATCH_SIZE: 4}
    log_probs, _ = actor.compute_log_prob(probe)
    data.batch[K.OLD_LOG_PROBS] = log_probs - 0.1
    expected, expected_metrics = get_policy_loss_fn(mode)(
        data.batch[K.OLD_LOG_PROBS], log_probs, data.batch[K.ADVANTAGES], data.batch[K.RESPONSE_MASK].float(),
        "token-mean", actor.config)
    metrics = actor.update_policy(data)
    assert metrics["actor/pg_loss"] == [pytest.approx(float(expected), rel=1e-4, abs=1e-6)]
    for name, value in expected_metrics.items():
        assert metrics[name] == [pytest.approx(value, rel=1e-4, abs=1e-6)]


@pytest.mark.parametrize("mode", ["gspo", "geo_mean", "vanilla"])
def test_a_mini_batch_split_into_micro_batches_updates_as_the_unsplit_one(tiny_model_dir, mode):
    """gspo / geo_mean average over rows whatever loss_agg_mode (token-mean here) says: the actor weighs
    their micro-batches by row share, the entropy term's by token share, so 2 + 2 + 2 rows (with unequal
    token counts) give the update of 6 rows in one micro-batch."""
    probe = _actor(tiny_model_dir)
    data = make_ppo_batch(probe.actor_module.config.vocab_size, batch_size=6, seed=9)
    data.batch[K.RESPONSE_MASK][0, 2:] = 0
    data.meta_info = {K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 6}
    log_probs, _ = probe.compute_log_prob(data)
    # old log-probs near the current ones: ratios inside the clip band, the policy term has a gradient
    data.batch[K.OLD_LOG_PROBS] = log_probs + 0.01 * torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(1))
    updated = []
    for micro in (6, 2):
        actor = _actor(tiny_model_dir, policy_loss={"loss_mode": mode}, ppo_mini_batch_size=6,
                       ppo_micro_batch_size=micro, entropy_coeff=0.01)
        before = [p.detach().clone() for p in actor.actor_module.parameters()]
        actor.update_policy(data)
        updated.append([p.detach() - b for p, b in zip(actor.actor_module.parameters(), before, strict=True)])
    assert any(float(d.abs().max()) > 0 for d in updated[0])
    for split, whole in zip(updated[1], updated[0], strict=True):
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-4)
