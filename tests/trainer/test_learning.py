"""The engine learns: GRPO makes a tiny random model say a target word (real workers, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from scripts.bench.toy_task import TOY_DATA_SOURCE, ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config, run_ppo

MAX_STEPS = 20


def test_grpo_lifts_the_reward_from_chance_to_almost_always(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # A random model samples the target token in ~2-3% of 16-token responses; 64 rollouts a
    # step give GRPO a few positive samples to amplify.
    paths = write_toy_parquets(tmp_path / "data", n_train=64, n_val=8)
    overrides = toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="grpo",
                              steps=MAX_STEPS, batch_size=8, n_agent=8, response_length=16,
                              val_before_train=True, n_workers=1)   # learning, not the split over workers
    cfg = compose_config([*overrides, "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.test_freq=1000"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))

    val_key = f"val/test_score/{TOY_DATA_SOURCE}"
    before, steps = history[0], history[1:]
    assert before["step"] == 0 and before[val_key] < 0.2
    scores = np.array([h["critic/score/mean"] for h in steps])
    assert len(scores) == MAX_STEPS
    assert scores[:2].mean() < 0.2
    smoothed = np.convolve(scores, np.ones(3) / 3, mode="valid")
    assert smoothed.max() > 0.8, scores.round(3).tolist()
    # the last step validates (greedy, every row): the learned behaviour is the policy's mode
    assert steps[-1][val_key] > 0.8
