"""ReMax end to end through `run_ppo`: real Ray workers (FSDP on gloo, HF rollout) on the toy task; the
greedy baseline rollout runs in the step, and advantages are 0/1 scores minus a 0/1 baseline."""

from __future__ import annotations

import math
from pathlib import Path

from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config, run_ppo


def test_one_remax_step_rolls_out_greedily_and_trains_without_a_critic(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="remax",
                                       n_agent=2) + ["critic.model.path=null"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    assert [h["step"] for h in history] == [1]
    step = history[0]
    assert step["timing_s/gen_max"] > 0 and step["timing_s/gen"] > 0
    assert not any(k.startswith("critic/values") for k in step)
    # 0/1 rewards, gamma 1: every advantage is a sampled score minus a greedy score, in {-1, 0, 1}
    assert -1.0 <= step["critic/advantages/min"] <= step["critic/advantages/max"] <= 1.0
    assert all(math.isfinite(step[k]) for k in ("actor/pg_loss", "critic/advantages/mean"))
