"""algorithm.adv_estimator against the registry in the config check (built-ins and a custom name), the
estimators' needs (critic, two samples per prompt, ReMax's sync trainer, the optimal token baseline's
actor), and ReMax's greedy baseline rollout through the trainer's step (no workers: a fake engine)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_check import ConfigError, config_errors, validate_config
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.registry import ADV_ESTIMATOR_REGISTRY, register_adv_est
from verl.utils import batch_keys as K

SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size=2", "actor_rollout_ref.ref.log_prob_micro_batch_size=2"]
TWO = "actor_rollout_ref.rollout.n_agent=2"


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "grpo_passk", "rloo_vectorized",
                                  "reinforce_plus_plus_baseline", "opo", "gpg", "remax"])
def test_each_critic_free_estimator_validates_without_a_critic(name: str) -> None:
    run = validate_config(compose_config([*SMALL, TWO, f"algorithm.adv_estimator={name}", "critic.model.path=null"]))
    assert run.algorithm.need_critic is False


def test_only_gae_needs_a_critic() -> None:
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=gae needs a critic"):
        validate_config(compose_config([*SMALL, "critic.model.path=null"]))


def test_an_unknown_name_lists_the_registry() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(compose_config([*SMALL, "algorithm.adv_estimator=ppo2"]))
    message = str(info.value)
    assert "algorithm.adv_estimator='ppo2' is unknown" in message
    assert "'grpo_passk'" in message and "'remax'" in message and "custom_algorithms.path" in message


def test_a_registered_custom_name_passes_the_check() -> None:
    @register_adv_est("test_config_custom_estimator")
    def custom(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_level_rewards, token_level_rewards

    try:
        run = validate_config(compose_config([*SMALL, "algorithm.adv_estimator=test_config_custom_estimator",
                                              "critic.model.path=null"]))
        assert run.algorithm.adv_estimator == "test_config_custom_estimator"
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_config_custom_estimator", None)


def test_pass_at_k_needs_two_samples_per_prompt() -> None:
    errors = config_errors(compose_config([*SMALL, "algorithm.adv_estimator=grpo_passk", "critic.model.path=null"]))
    assert any("algorithm.adv_estimator=grpo_passk compares the best and second-best" in e
               and "must be >= 2 (got 1)" in e for e in errors)


def test_a_group_estimator_with_one_sample_per_prompt_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        validate_config(compose_config([*SMALL, "algorithm.adv_estimator=opo", "critic.model.path=null"]))
    assert "algorithm.adv_estimator=opo with actor_rollout_ref.rollout.n_agent * actor_rollout_ref.rollout.n = 1" \
        in caplog.text


def test_the_optimal_token_baseline_needs_the_actors_sum_pi_squared_and_the_old_log_prob_pass() -> None:
    otb = [*SMALL, TWO, "algorithm.adv_estimator=optimal_token_baseline", "critic.model.path=null"]
    errors = config_errors(compose_config(otb))
    assert any("set actor_rollout_ref.actor.calculate_sum_pi_squared=true" in e for e in errors), errors
    with_key = [*otb, "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    assert validate_config(compose_config(with_key)).algorithm.need_critic is False
    bypass = config_errors(compose_config([*with_key, "algorithm.rollout_correction.bypass_old_logprob_for_rollout=true",
                                           "actor_rollout_ref.rollout.name=vllm"]))
    assert any("bypass mode skips the old-log-prob pass that computes sum_pi_squared" in e for e in bypass), bypass


@pytest.mark.parametrize("pipeline", ["one_step_off", "async"])
def test_remax_is_refused_in_a_pipeline(pipeline: str) -> None:
    errors = config_errors(compose_config([*SMALL, TWO, "algorithm.adv_estimator=remax", "critic.model.path=null",
                                           f"trainer.pipeline={pipeline}", "trainer.rollout_pool=1"]))
    assert any(f"algorithm.adv_estimator=remax needs trainer.pipeline=sync (got {pipeline})" in e for e in errors)


# --------------------------------------------------------------------------- ReMax through the trainer
PROMPT, RESPONSE, GREEDY_TOKEN = 4, 3, 9


class FakeEngine:
    """generate_sequences as the plain rollout's: greedy rows answer GREEDY_TOKEN, sampled rows 1, 2, 3, ..."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        rows = len(gen_batch)
        do_sample = bool(gen_batch.meta_info[K.META_DO_SAMPLE])
        self.calls.append((do_sample, rows))
        token = torch.arange(1, rows + 1) if do_sample else torch.full((rows,), GREEDY_TOKEN)
        responses = token.unsqueeze(-1).repeat(1, RESPONSE)
        prompts = gen_batch.batch[K.INPUT_IDS]
        attention = torch.cat([gen_batch.batch[K.ATTENTION_MASK], torch.ones(rows, RESPONSE, dtype=torch.long)], -1)
        return DataProto.from_dict(tensors={
            K.PROMPTS: prompts, K.RESPONSES: responses, K.INPUT_IDS: torch.cat([prompts, responses], -1),
            K.ATTENTION_MASK: attention, K.POSITION_IDS: torch.cumsum(attention, -1) - 1})


def _score(batch: DataProto) -> torch.Tensor:
    """The first response token as the outcome reward, on the last token."""
    responses = batch.batch[K.RESPONSES]
    scores = torch.zeros(responses.shape, dtype=torch.float32)
    scores[:, -1] = responses[:, 0].float()
    return scores


def _remax_trainer(cfg: Any) -> tuple[RayPPOTrainer, FakeEngine]:
    """A trainer with no workers: the fake engine generates, `_score` rewards."""
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config, trainer.run = cfg, validate_config(cfg)
    trainer._rollout_pool_wg, trainer.actor_rollout_wg = None, (engine := FakeEngine())
    trainer.reward_fn = _score
    trainer.tokenizer, trainer._eos_token_ids = SimpleNamespace(pad_token_id=0), [2]
    trainer._engines_awake = lambda *args, **kwargs: nullcontext()
    trainer.use_kl_in_reward, trainer._bypass_old_log_prob, trainer.use_critic, trainer.pipelined = \
        False, False, False, False
    return trainer, engine


def _prompts(rows: int) -> DataProto:
    return DataProto.from_dict(tensors={
        K.INPUT_IDS: torch.full((rows, PROMPT), 5), K.ATTENTION_MASK: torch.ones(rows, PROMPT, dtype=torch.long),
        K.POSITION_IDS: torch.arange(PROMPT).repeat(rows, 1)},
        non_tensors={K.DATA_SOURCE: np.array(["nq"] * rows, dtype=object)})


def test_remax_rolls_out_greedily_once_per_prompt_and_subtracts_that_score() -> None:
    cfg = compose_config([*SMALL, TWO, "algorithm.adv_estimator=remax", "critic.model.path=null", "do_search=false"])
    trainer, engine = _remax_trainer(cfg)
    metrics: dict[str, float] = {}
    batch = trainer._rollout(_prompts(3), 0, metrics, {})
    # first the greedy pass on the 3 prompts, then the sampled one on 3 x 2 rows
    assert engine.calls == [(False, 3), (True, 6)]
    torch.testing.assert_close(batch.batch[K.REWARD_BASELINES], torch.full((6,), float(GREEDY_TOKEN)))
    trainer._reward_masks_advantages(batch, metrics)
    # sampled row i scores i + 1 on its last token: its return-to-go on every token is i + 1
    want = (torch.arange(1, 7, dtype=torch.float32) - GREEDY_TOKEN).unsqueeze(-1).repeat(1, RESPONSE)
    torch.testing.assert_close(batch.batch[K.ADVANTAGES], want)
    torch.testing.assert_close(batch.batch[K.RETURNS], torch.arange(1, 7, dtype=torch.float32).unsqueeze(-1)
                               .repeat(1, RESPONSE))


def test_remaxs_greedy_baseline_gets_the_overlong_penalty_the_sampled_rows_get() -> None:
    """Overlong shaping on (DAPO's buffer: data.max_response_length=4, len=2): every row, greedy or
    sampled, is 3 tokens long, 1 past the buffer's start, so each loses 1/2. The baseline is scored
    through the same path as the samples, so the penalty cancels in the advantage."""
    cfg = compose_config([*SMALL, TWO, "algorithm.adv_estimator=remax", "critic.model.path=null", "do_search=false",
                          "data.max_response_length=4", "reward_model.overlong_buffer.enable=true",
                          "reward_model.overlong_buffer.len=2", "reward_model.overlong_buffer.penalty_factor=1.0"])
    trainer, _ = _remax_trainer(cfg)
    metrics: dict[str, float] = {}
    batch = trainer._rollout(_prompts(3), 0, metrics, {})
    torch.testing.assert_close(batch.batch[K.REWARD_BASELINES], torch.full((6,), GREEDY_TOKEN - 0.5))
    trainer._reward_masks_advantages(batch, metrics)
    torch.testing.assert_close(batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1), torch.arange(1, 7) - 0.5)
    want = (torch.arange(1, 7, dtype=torch.float32) - GREEDY_TOKEN).unsqueeze(-1).repeat(1, RESPONSE)
    torch.testing.assert_close(batch.batch[K.ADVANTAGES], want)


def test_other_estimators_roll_out_once() -> None:
    cfg = compose_config([*SMALL, TWO, "algorithm.adv_estimator=grpo", "critic.model.path=null", "do_search=false"])
    trainer, engine = _remax_trainer(cfg)
    batch = trainer._rollout(_prompts(2), 0, {}, {})
    assert engine.calls == [(True, 4)]
    assert K.REWARD_BASELINES not in batch.batch.keys()
