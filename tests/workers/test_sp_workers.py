"""Ulysses sequence parallelism through the real Ray workers (verl/workers/sp_groups.py): one PPO step
through `run_ppo` on 2 CPU workers (gloo) with ulysses_sequence_parallel_size=2 (one SP group, data
parallelism 1) matches the same step with SP=1 (data parallelism 2) on the same rollouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config, run_ppo

# rounding only: the packed rows are split over 2 ranks and the heads swapped, fp32 throughout
TOL = 1e-4


# packed by tokens (use_dynamic_bsz): each rank holds <= 64 tokens of a micro-batch, SP x 64 per group
DYNAMIC = [f"{section}.{key}={value}" for section, key, value in (
    ("actor_rollout_ref.actor", "use_dynamic_bsz", "true"), ("actor_rollout_ref.actor", "ppo_max_token_len_per_gpu", 64),
    ("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz", "true"),
    ("actor_rollout_ref.rollout", "log_prob_max_token_len_per_gpu", 64),
    ("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", "true"),
    ("actor_rollout_ref.ref", "log_prob_max_token_len_per_gpu", 64),
    ("critic", "use_dynamic_bsz", "true"), ("critic", "ppo_max_token_len_per_gpu", 64))]


def _step(tiny_model_dir: str, tmp_path: Path, sp: int, *more: str) -> dict:
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    extra = [*more, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}", f"critic.ulysses_sequence_parallel_size={sp}",
             "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / f"ckpt{sp}"), adv_estimator="gae") + extra)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (step,) = run_ppo(cfg, reward_fn=ContainsTokenReward(tok))
    return step


@pytest.mark.slow
def test_sp2_step_equals_sp1_step_through_ray_workers(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    one = _step(tiny_model_dir, tmp_path / "sp1", 1)
    two = _step(tiny_model_dir, tmp_path / "sp2", 2)
    dynamic = _step(tiny_model_dir, tmp_path / "sp2dyn", 2, *DYNAMIC)
    # the same rollouts (the rollout does not use SP): same responses and scores
    for key in ("response_length/mean", "critic/score/mean"):
        assert two[key] == one[key], key
    # old log-probs (engine vs actor gap), values, the updates' losses and gradient norms
    for key in ("rollout/log_prob_gap_max", "critic/values/mean", "critic/vf_loss", "critic/grad_norm",
                "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/reward_kl_penalty"):
        assert key in one and key in two, key
        assert two[key] == pytest.approx(one[key], rel=TOL, abs=TOL), (key, one[key], two[key])
    # packed by tokens, the micro-batches differ (so do the per-micro-batch loss metrics), the gradient does not
    for key in ("rollout/log_prob_gap_max", "critic/values/mean", "critic/grad_norm", "actor/grad_norm"):
        assert dynamic[key] == pytest.approx(one[key], rel=TOL, abs=TOL), (key, one[key], dynamic[key])
