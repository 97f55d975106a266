"""`critic.loss_agg_mode` is declared, tied to the actor's, and reaches the critic's value loss."""

from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

from tests.workers._batches import make_ppo_batch
from verl.trainer.config_check import validate_config
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo import core_algos
from verl.utils import batch_keys as K
from verl.utils.model import load_value_model
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from verl.workers.fsdp_workers import normalize_critic_batch_sizes

torch.set_num_threads(1)


def _first_value_loss(model_dir: str, overrides: list[str]) -> tuple[float, float]:
    """(vf_loss of a one-mini-batch critic update built from the composed config, the same loss recomputed)."""
    cfg = compose_config([f"critic.model.path={model_dir}", "critic.ppo_mini_batch_size=6",
                          "critic.ppo_micro_batch_size=6", "data.train_batch_size=6", "trainer.n_gpus_per_node=1",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.actor.ppo_micro_batch_size=6",
                          *overrides])
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    normalize_critic_batch_sizes(cfg.critic, world_size=1)
    torch.manual_seed(0)  # a fresh value head: the same initial weights for every run
    module = load_value_model(model_dir)
    critic = DataParallelPPOCritic(cfg.critic, module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    # Rows of 1..6 response tokens: token-mean and seq-mean-token-mean weigh them differently.
    data = make_ppo_batch(module.config.vocab_size, batch_size=6, seed=21)
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 6
    values = critic.compute_values(copy.copy(data))
    data.batch[K.VALUES] = values
    loss = critic.update_critic(data)["critic/vf_loss"][0]
    # Before the (only) optimizer step the predictions are the values just computed: clipping is inert.
    expected, _ = core_algos.compute_value_loss(values, data.batch[K.RETURNS], values, data.batch[K.RESPONSE_MASK],
                                                float(cfg.critic.cliprange_value), cfg.critic.loss_agg_mode)
    return loss, float(expected)


def test_critic_value_loss_uses_the_actors_loss_agg_mode_through_the_config(tiny_model_dir: str) -> None:
    token_mean, token_mean_expected = _first_value_loss(tiny_model_dir, [])
    seq_mean, seq_mean_expected = _first_value_loss(
        tiny_model_dir, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    # Same weights, same fp32 forward on the same 6 rows; the update's forward and compute_values
    # may batch differently (last-bit kernel differences), so compare to 1e-5 relative, far below
    # the gap between the two aggregation modes asserted next.
    assert abs(token_mean - token_mean_expected) <= 1e-5 * abs(token_mean_expected)
    assert abs(seq_mean - seq_mean_expected) <= 1e-5 * abs(seq_mean_expected)
    assert abs(seq_mean - token_mean) > 1e-2 * abs(token_mean)
