"""trainer.pipeline=one_step_off|async: a rollout pool generating while the train pool trains.

Real Ray workers (the session's local cluster), FSDP over gloo, the HF engine, the weight-sync
group (gloo) between the pools; the toy task's tiny model and reward (scripts/bench/toy_task.py).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer import config_check, main_ppo
from verl.trainer.config_check import ConfigError
from verl.trainer.ppo import checkpointing as ck
from verl.trainer.run_config import RunConfig
from verl.utils import batch_keys as K

CLOCK_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "pipeline/")
# sync and the pipeline compute the same thing in different processes: equal up to float kernels
REL_TOL, ABS_TOL = 1e-4, 1e-6


class RecordingReward(ContainsTokenReward):
    """The toy reward, remembering the prompts of every batch it scores (one entry a training step);
    raises at call `fail_at` (a run killed mid-pipeline)."""

    def __init__(self, tokenizer: Any, fail_at: int | None = None) -> None:
        super().__init__(tokenizer)
        self.batches: list[frozenset[tuple[int, ...]]] = []
        self.fail_at = fail_at
        self.delay_s = 0.0

    def __call__(self, data: Any) -> Any:
        prompts = data.batch[K.PROMPTS]
        mask = data.batch[K.ATTENTION_MASK][:, : prompts.shape[-1]].bool()
        self.batches.append(frozenset(tuple(row[m].tolist()) for row, m in zip(prompts, mask, strict=True)))
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            raise RuntimeError("killed mid-pipeline")
        time.sleep(self.delay_s)    # a slow trainer (the reward runs in the driver's training thread)
        return super().__call__(data)


def _run(model_dir: str, data: Any, ckpt: Path, steps: int, workers: int, extra: list[str],
         reward: RecordingReward | None = None) -> tuple[list[dict], RecordingReward]:
    overrides = toy_overrides(model_dir, data, str(ckpt), adv_estimator="grpo", steps=steps, n_workers=workers)
    cfg = main_ppo.compose_config([*overrides, "actor_rollout_ref.rollout.temperature=1.0",
                                   # the same loss in both modes (a pipeline's default is token IS)
                                   "algorithm.rollout_correction.rollout_is=token", *extra])
    tok = AutoTokenizer.from_pretrained(model_dir)
    reward = reward or RecordingReward(tok)
    return main_ppo.run_ppo(cfg, reward_fn=reward, val_reward_fn=ContainsTokenReward(tok)), reward


def _computed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(CLOCK_PREFIXES)}


PIPELINE = ["trainer.pipeline=one_step_off", "trainer.rollout_pool=2"]
# One train and one rollout worker (2 workers in all) where the test is about the pipeline's timeline, not the
# sharded push: the push from a 2-rank train pool into 2 engines is the sync-equality test's (each more worker
# process is ~9 s of CPU).
PIPELINE_1_1 = ["trainer.pipeline=one_step_off", "trainer.rollout_pool=1"]


def test_one_step_off_waiting_for_each_sync_equals_sync_on_every_metric(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # 2 workers that generate and train vs a train pool of 2 (FSDP-sharded: the sender gathers) and a
    # rollout pool of 2 (each an HF engine's plain module, overwritten by every push), each rollout
    # waiting for the weights of the update before it: the same batches, samples, losses and updates.
    data = write_toy_parquets(tmp_path / "data", n_train=16, n_val=2)
    sync, sync_reward = _run(tiny_model_dir, data, tmp_path / "sync", 3, 2, [])
    piped, piped_reward = _run(tiny_model_dir, data, tmp_path / "piped", 3, 4,
                               [*PIPELINE, "+trainer.pipeline_wait_for_sync=true"])
    assert [h["step"] for h in piped] == [1, 2, 3]
    assert piped_reward.batches == sync_reward.batches
    for a, b in zip(sync, piped, strict=True):
        ca, cb = _computed(a), _computed(b)
        assert ca.keys() == cb.keys()
        for key in ca:
            assert math.isclose(ca[key], cb[key], rel_tol=REL_TOL, abs_tol=ABS_TOL), (a["step"], key, ca[key], cb[key])
    # the rollout pool sampled with the weights of every update: the engine's log-probs equal the
    # train pool's old log-probs (initial weights at step 3 would differ by far more: two updates)
    assert [h["pipeline/staleness"] for h in piped] == [0.0, 0.0, 0.0]
    assert [h["pipeline/weight_syncs"] for h in piped] == [0.0, 1.0, 2.0]
    for h in piped:
        assert h["rollout/log_prob_gap_max"] < 1e-3, h["rollout/log_prob_gap_max"]
    # a push: every parameter once (the tied lm_head is the embedding), in the CPU engine's dtype (fp32)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert [h["pipeline/weight_sync_bytes"] for h in piped] == [0.0, n_params * 4.0, 2 * n_params * 4.0]


@pytest.mark.slow   # two more pipelined runs: in CI's slow suite (the default suite's 15-minute goal)
def test_bypass_mode_anchors_ppo_on_the_stale_sampler_without_an_old_log_prob_pass(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # algorithm.rollout_correction bypass mode: old log-probs are the engine's (the weights one update
    # behind), not recomputed; the pipeline's default token IS is then not applied (its ratios would be 1)
    data = write_toy_parquets(tmp_path / "data", n_train=16, n_val=2)
    history, _ = _run(tiny_model_dir, data, tmp_path / "run", 4, 2,
                      [*PIPELINE_1_1, "algorithm.rollout_correction.rollout_is=null",
                       "algorithm.rollout_correction.bypass_old_logprob_for_rollout=true"])
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    for h in history:
        assert "timing_s/old_log_prob" not in h and "rollout/log_prob_gap_max" not in h
        assert not [k for k in h if k.startswith("rollout_corr/")]
    staleness = [h["pipeline/staleness"] for h in history]
    assert staleness == [0.0, 1.0, 1.0, 1.0], staleness
    # the PPO ratio's anchor is the sampler: the same weights at step 1 (ratio 1 up to the engine's
    # rounding), one update behind afterwards (the mean log-ratio old - new moves away from 0)
    fresh = abs(history[0]["actor/ppo_kl"])
    stale = [abs(h["actor/ppo_kl"]) for h in history[2:]]
    assert fresh < 1e-5 and min(stale) > 10 * max(fresh, 1e-7), (fresh, stale)


def test_async_never_trains_past_its_staleness_bound_with_a_slow_trainer(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # The rollout takes a fraction of a second, the trainer over a second a step: the producer runs
    # ahead until the bound stops it, so the bound is reached and never passed.
    data = write_toy_parquets(tmp_path / "data", n_train=24, n_val=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    slow = RecordingReward(tok)
    slow.delay_s = 2.0
    history, _ = _run(tiny_model_dir, data, tmp_path / "run", 6, 2,
                      ["trainer.pipeline=async", "trainer.max_staleness=2", "trainer.rollout_pool=1"], reward=slow)
    staleness = [h["pipeline/staleness"] for h in history]
    assert max(staleness) == 2.0 and all(s <= 2 for s in staleness), staleness
    assert staleness[:3] == [0.0, 1.0, 2.0]
    assert history[-1]["pipeline/dropped_stale"] == 0.0
    # the producer waited for the trainer (the bound), the trainer hardly for the producer
    assert sum(h["pipeline/rollout_idle_s"] for h in history) > 1.0


def _assert_one_step_off_trains_each_batch_one_update_after_the_weights_that_sampled_it(
        history: list[dict], reward: RecordingReward) -> None:
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    # batch 1 rolls out with the initial weights before anything trains; batch 2 with them too,
    # while step 1 trains; batch k >= 3 with the newest weights once step k - 2 is done
    staleness = [h["pipeline/staleness"] for h in history]
    assert staleness[:2] == [0.0, 1.0] and all(s <= 1 for s in staleness), staleness
    for h in history:   # trained at step s after s - 1 updates: version + staleness = s - 1
        assert h["pipeline/policy_version"] + h["pipeline/staleness"] == h["step"] - 1
    assert sum(v for k, v in history[-1].items() if k.startswith("pipeline/staleness_hist/")) == 4
    assert history[-1]["pipeline/dropped_stale"] == 0.0
    assert history[-1]["pipeline/weight_syncs"] == 2.0
    # stale samples: the engine's log-probs now differ from the trainer's, and the IS weights correct it
    assert history[-1]["rollout/log_prob_gap_max"] > 1e-3
    assert history[-1]["rollout_corr/is_weight_mean"] != 1.0
    assert len(set(reward.batches)) == 4      # four different batches, each trained once


def _assert_validation_from_the_checkpoint_samples_with_its_weights(
        model_dir: str, data: Any, ckpt: Path, extra: list[str]) -> None:
    # The checkpoint restores the train pool; the rollout pool starts from the model's own weights and
    # must get the checkpoint's before anything samples from it (here: +trainer.val_only validation).
    overrides = toy_overrides(model_dir, data, str(ckpt), adv_estimator="grpo", steps=4, n_workers=2)
    cfg = main_ppo.compose_config([*overrides, *extra, "+trainer.val_only=true"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = main_ppo.build_trainer(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    try:
        trainer.init_workers()
        before = trainer.rollout_wg.get_state_fingerprint()[0]
        history = trainer.fit()
        assert trainer.global_step == 2 and len(history) == 1
        trained = trainer.actor_rollout_wg.get_state_fingerprint()[0]
        assert trainer.rollout_wg.get_state_fingerprint()[0] == trained != before
    finally:
        trainer.shutdown()


@pytest.mark.slow   # four pipelined runs: in CI's slow suite (the default suite's 15-minute goal)
def test_one_step_off_staleness_and_a_killed_runs_checkpoint_validates_with_its_weights_and_resumes_without_training_a_batch_twice(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    # 16 prompts, batch 4: one epoch of 4 distinct batches. The straight run is one_step_off's timeline
    # (checkpointing every 2 steps changes nothing it trains). The second run checkpoints at step 2 and
    # dies in step 3, with batch 4 already drawn and rolled out by the producer. Validation alone from
    # its checkpoint samples with the checkpoint's weights (val_only). The resumed run must train batches 3 and 4 (rolling them out again, with its weights), and nothing else.
    data = write_toy_parquets(tmp_path / "data", n_train=16, n_val=2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    extra = [*PIPELINE_1_1, "trainer.save_freq=2"]
    straight, straight_reward = _run(tiny_model_dir, data, tmp_path / "straight", 4, 2, extra)
    _assert_one_step_off_trains_each_batch_one_update_after_the_weights_that_sampled_it(straight, straight_reward)
    killed = RecordingReward(tok, fail_at=3)
    with pytest.raises(RuntimeError, match="killed mid-pipeline"):
        _run(tiny_model_dir, data, tmp_path / "resumed", 4, 2, extra, reward=killed)
    assert ck.find_resume_dir(tmp_path / "resumed", "auto") == tmp_path / "resumed" / "global_step_2"
    _assert_validation_from_the_checkpoint_samples_with_its_weights(tiny_model_dir, data, tmp_path / "resumed", extra)
    resumed, resumed_reward = _run(tiny_model_dir, data, tmp_path / "resumed", 4, 2, extra)
    assert [h["step"] for h in resumed] == [3, 4]
    trained = killed.batches[:2] + resumed_reward.batches
    assert trained == straight_reward.batches
    assert len(set(trained)) == 4
    # the resumed run pushed the checkpoint's weights before its first rollout
    assert resumed[0]["pipeline/policy_version"] == 2.0 and resumed[0]["pipeline/staleness"] == 0.0


def _config(*overrides: str) -> Any:
    return main_ppo.compose_config(["trainer.device=cpu", *overrides])


def test_pipeline_pools_split_the_workers_and_batch_sizes_divide_the_train_pool() -> None:
    cfg = _config("trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=8", "trainer.nnodes=2",
                  "trainer.rollout_pool=8")
    assert RunConfig.from_config(cfg).pools.layout() == {"train_pool": [8], "rollout_pool": [8]}
    assert RunConfig.from_config(cfg).pools.world_size == 8 and RunConfig.from_config(cfg).pools.rollout_world_size == 8
    one_node = _config("trainer.pipeline=async", "trainer.n_gpus_per_node=8", "trainer.rollout_pool=2")
    assert RunConfig.from_config(one_node).pools.layout() == {"train_pool": [6], "rollout_pool": [2]}
    half = _config("trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=2")
    assert RunConfig.from_config(half).pools.layout() == {"train_pool": [1], "rollout_pool": [1]}
    sync = _config("trainer.n_gpus_per_node=8", "trainer.nnodes=2")
    assert RunConfig.from_config(sync).pools.layout() == {"global_pool": [8, 8]} and RunConfig.from_config(sync).pools.world_size == 16


def test_the_rollout_pool_keeps_its_engine_awake_and_the_train_pool_config_is_untouched() -> None:
    from verl.trainer.ppo.pipeline import rollout_pool_config

    cfg = _config("trainer.pipeline=one_step_off", "actor_rollout_ref.rollout.name=vllm")
    assert cfg.actor_rollout_ref.rollout.free_cache_engine is True
    pool = rollout_pool_config(cfg.actor_rollout_ref)
    assert pool.rollout.free_cache_engine is False
    assert cfg.actor_rollout_ref.rollout.free_cache_engine is True    # a copy: the train pool's is unchanged
    assert pool.actor == cfg.actor_rollout_ref.actor


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.pipeline=overlap"], "trainer.pipeline='overlap' is unknown"),
    (["trainer.pipeline=async", "trainer.max_staleness=0"], "trainer.max_staleness=0 must be an int >= 1"),
    (["trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=2", "trainer.rollout_pool=2"],
     r"trainer.rollout_pool in 1..1"),
    (["trainer.pipeline=one_step_off", "trainer.rollout_pool=two"], "trainer.rollout_pool='two' must be an int"),
    (["trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=4", "trainer.rollout_pool=1",
      "data.train_batch_size=4", "actor_rollout_ref.rollout.n_agent=2"],
     "the train pool trainer.nnodes\\*trainer.n_gpus_per_node-trainer.rollout_pool=3"),
    (["actor_rollout_ref.rollout.partial=true"], "actor_rollout_ref.rollout.partial=true needs trainer.pipeline"),
    (["trainer.pipeline=async", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.partial=true",
      "actor_rollout_ref.rollout.mode=async"], "partial=true needs actor_rollout_ref.rollout.mode=sync"),
    (["trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=8", "trainer.nnodes=2", "trainer.rollout_pool=4"],
     "the rollout pool takes whole nodes"),
    (["trainer.pipeline=one_step_off", "trainer.n_gpus_per_node=4", "trainer.rollout_pool=1",
      "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "must divide trainer.rollout_pool=1"),
])
def test_pipeline_settings_that_cannot_run_are_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_check.validate_config(_config(*overrides))


@pytest.mark.slow   # two more pipelined runs: in CI's slow suite (the default suite's 15-minute goal)
def test_one_step_off_with_dynamic_sampling_trains_only_varying_groups_within_the_bound(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    """DAPO's dynamic sampling in a pipeline: the rollout pool rolls out generation batches of 8 prompts,
    the trainer keeps the groups whose reward varies until 4 prompts' groups are kept, then trains on
    exactly those; no batch trains more than one update stale."""
    class FirstTokenParity(RecordingReward):
        """1 where the first response token's id is even: about half the groups of 2 vary."""

        def __call__(self, data: Any) -> Any:
            scores_BR = super().__call__(data)    # records the batch
            hit_B = (data.batch[K.RESPONSES][:, 0] % 2 == 0).float()
            last_B = (data.batch[K.ATTENTION_MASK][:, -scores_BR.shape[-1]:].sum(-1) - 1).clamp(min=0)
            scores_BR.zero_()
            scores_BR[torch.arange(len(hit_B)), last_B] = hit_B
            return scores_BR

    data = write_toy_parquets(tmp_path / "data", n_train=16, n_val=2)
    reward = FirstTokenParity(AutoTokenizer.from_pretrained(tiny_model_dir))
    history, _ = _run(tiny_model_dir, data, tmp_path / "run", 2, 2, [
        *PIPELINE_1_1, "algorithm.filter_groups.enable=true", "data.gen_batch_size=8",
        "algorithm.filter_groups.max_num_gen_batches=12"], reward=reward)
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["train/filter_groups/kept"] >= 4 and h["train/num_gen_batches"] >= 1
        assert h["train/filter_groups/generated"] == 8 * h["train/num_gen_batches"]
        assert h["pipeline/staleness"] <= 1 and h["pipeline/dropped_stale"] == 0
    # every generation batch drawn was scored once, by the trainer; a step's batch had 4 prompts x 2 rows
    assert len(reward.batches) == sum(h["train/num_gen_batches"] for h in history)
    assert all(h["response_length/mean"] > 0 for h in history)
