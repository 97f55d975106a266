"""ReMax end to end through `run_ppo`: real Ray workers (FSDP on gloo, HF rollout) on the toy task with
searches (a stand-in retrieval server); the greedy baseline rollout runs through the same generation
manager, sampling off, once per prompt, before the sampled rollout. The same step trains with a policy
loss of the user's own (custom_algorithms.path): the Ray actor workers, processes of their own, import
the file themselves."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from search_r1.llm_agent.generation import LLMGenerationManager
from tests.trainer.test_main_ppo import fake_search_server
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.utils import batch_keys as K

EXAMPLE = Path(__file__).resolve().parents[2] / "example" / "custom_algorithms.py"


def test_one_remax_step_rolls_out_greedily_with_searches_and_trains_a_custom_loss_without_a_critic(
        ray_cluster, tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bool, int]] = []
    run_llm_loop = LLMGenerationManager.run_llm_loop

    def recording(self, gen_batch, initial_input_ids):  # noqa: ANN001, ANN202
        calls.append((bool(gen_batch.meta_info[K.META_DO_SAMPLE]), len(gen_batch)))
        return run_llm_loop(self, gen_batch, initial_input_ids)

    monkeypatch.setattr(LLMGenerationManager, "run_llm_loop", recording)
    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    with fake_search_server() as server:
        cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), adv_estimator="remax",
                                           n_agent=2, batch_size=4, n_workers=1) + [
            "critic.model.path=null", "do_search=true", "max_turns=1", "actor_rollout_ref.actor.state_masking=true",
            "data.max_prompt_length=512", f"retriever.url={server['url']}/retrieve", "data.max_obs_length=160",
            f"custom_algorithms.path={EXAMPLE}", "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce_clipped_weight"])
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        history = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    # the greedy pass on the 4 prompts, then the sampled one on 4 x 2 rows
    assert calls == [(False, 4), (True, 8)]
    assert [h["step"] for h in history] == [1]
    step = history[0]
    assert step["timing_s/gen_max"] > 0 and step["timing_s/gen"] > 0
    assert not any(k.startswith("critic/values") for k in step)
    # 0/1 rewards, gamma 1: every advantage is a sampled score minus a greedy score, in {-1, 0, 1}
    assert -1.0 <= step["critic/advantages/min"] <= step["critic/advantages/max"] <= 1.0
    assert all(math.isfinite(step[k]) for k in ("actor/pg_loss", "critic/advantages/mean"))
    # the example loss reports actor/ppo_kl only: the built-in losses' clip fractions are absent
    assert math.isfinite(step["actor/ppo_kl"])
    assert "actor/pg_clipfrac" not in step and "actor/pg_clipfrac_lower" not in step
    assert math.isfinite(step["actor/grad_norm"]) and step["actor/grad_norm"] > 0
