"""veRL's import path: the registry functions, `agg_loss` (veRL's keywords) and `kl_penalty` import from
verl.trainer.ppo.core_algos, and a loss file written as veRL users write it (all of them from there,
veRL's loss signature, `agg_loss(..., **config.global_batch_info)`) loads through custom_algorithms.path
and trains an actor update."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.ppo import core_algos, registry
from verl.utils import torch_functional as tf

VERL_STYLE_FILE = '''
import torch

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import (
    agg_loss,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)


@register_policy_loss("verl_style_clipped_pg")
def compute_policy_loss_verl_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                   config=None, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    pg_losses = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_losses = pg_losses + 0.01 * kl_penalty(log_prob, old_log_prob, "low_var_kl")
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, {"actor/ppo_kl": verl_F.masked_mean(-negative_approx_kl, response_mask).detach().item()}


@register_adv_est("verl_style_batch_mean_baseline")
def compute_batch_mean_baseline(token_level_rewards, response_mask, index=None, config=None, **kwargs):
    scores = token_level_rewards.sum(dim=-1)
    advantages = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return advantages, advantages


assert get_policy_loss_fn("verl_style_clipped_pg") is compute_policy_loss_verl_style
assert get_adv_estimator_fn("verl_style_batch_mean_baseline") is compute_batch_mean_baseline
'''


def test_veRLs_names_import_from_core_algos() -> None:
    from verl.trainer.ppo.core_algos import (  # noqa: F401  (the import is the test)
        agg_loss,
        get_adv_estimator_fn,
        get_policy_loss_fn,
        kl_penalty,
        register_adv_est,
        register_policy_loss,
    )

    # one registry: a loss registered through either module is found through both
    for name in ("register_policy_loss", "get_policy_loss_fn", "register_adv_est", "get_adv_estimator_fn"):
        assert getattr(core_algos, name) is getattr(registry, name)
    assert list(inspect.signature(agg_loss).parameters) == [
        "loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens", "global_batch_size",
        "loss_scale_factor"]
    assert list(inspect.signature(kl_penalty).parameters) == ["logprob", "ref_logprob", "kl_penalty"]


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])   # 3 tokens, 2 rows with tokens


@pytest.mark.parametrize("mode", tf.LOSS_AGG_MODES)
def test_agg_loss_without_global_totals_is_the_micro_batchs_own_aggregation(mode: str) -> None:
    got = core_algos.agg_loss(loss_mat=LOSS, loss_mask=MASK, loss_agg_mode=mode, loss_scale_factor=4)
    assert float(got) == float(tf.agg_loss(LOSS, MASK, mode, loss_scale_factor=4))


def test_agg_loss_with_veRLs_global_totals_divides_by_them_times_dp_size() -> None:
    # token-mean: masked sum 7 over 12 tokens of the global batch, x 2 ranks
    got = core_algos.agg_loss(LOSS, MASK, "token-mean", dp_size=2, batch_num_tokens=12, global_batch_size=99)
    assert float(got) == pytest.approx(7 / 12 * 2)
    # seq-mean-token-sum: row sums 3 and 4 over 8 rows of the global batch, x 2 ranks
    got = core_algos.agg_loss(LOSS, MASK, "seq-mean-token-sum", dp_size=2, batch_num_tokens=99, global_batch_size=8)
    assert float(got) == pytest.approx((3 + 4) / 8 * 2)
    got = core_algos.agg_loss(LOSS, MASK, "seq-mean-token-mean", global_batch_size=4)
    assert float(got) == pytest.approx((1.5 + 4.0) / 4)
    # seq-mean-token-sum-norm: this project's mean over rows of token-sum / factor, over the global rows
    got = core_algos.agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_batch_size=4, loss_scale_factor=10)
    assert float(got) == pytest.approx((0.3 + 0.4) / 4)
    with pytest.raises(ValueError, match="global_batch_size"):
        core_algos.agg_loss(LOSS, MASK, "seq-mean-token-sum", global_batch_size=0)


def test_a_verl_style_loss_file_loads_through_custom_algorithms_and_trains_an_actor_update(
        tiny_model_dir: str, tmp_path) -> None:
    """The driver's check imports the file (its names then pass the checks), the trainer's worker config
    carries the file and an empty actor.global_batch_info (veRL's ActorConfig field), and the actor's
    update runs the file's loss: finite, a nonzero finite gradient, the weights moved."""
    from transformers import AutoModelForCausalLM

    from tests.workers._batches import make_ppo_batch
    from verl.trainer.config_check import config_errors
    from verl.trainer.main_ppo import compose_config
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import batch_keys as K
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    path = tmp_path / "my_verl_losses.py"
    path.write_text(VERL_STYLE_FILE)
    cfg = compose_config([f"custom_algorithms.path={path}", "critic.model.path=null",
                          "actor_rollout_ref.actor.policy_loss.loss_mode=verl_style_clipped_pg",
                          "algorithm.adv_estimator=verl_style_batch_mean_baseline",
                          f"actor_rollout_ref.model.path={tiny_model_dir}"])
    assert config_errors(cfg) == []
    OmegaConf.resolve(cfg)
    worker = RayPPOTrainer.worker_configs(SimpleNamespace(config=cfg, use_critic=False))["actor_rollout"]
    assert worker.actor.global_batch_info == {}

    advantages, _ = core_algos.compute_advantage(
        "verl_style_batch_mean_baseline", torch.tensor([[0.0, 1.0], [0.0, 3.0]]), torch.ones(2, 2),
        index=np.array(["a", "a"], dtype=object))
    torch.testing.assert_close(advantages, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))

    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    actor_cfg = worker.actor
    OmegaConf.update(actor_cfg, "ppo_mini_batch_size", 4)
    OmegaConf.update(actor_cfg, "ppo_micro_batch_size", 2)
    actor = DataParallelPPOActor(actor_cfg, module, torch.optim.SGD(module.parameters(), lr=1e-2))
    before = [p.detach().clone() for p in module.parameters()]
    data = make_ppo_batch(module.config.vocab_size, batch_size=4, seed=2)
    data.meta_info = {K.META_TEMPERATURE: 1.0}
    metrics = actor.update_policy(data)
    assert all(math.isfinite(v) for v in metrics["actor/pg_loss"]) and "actor/ppo_kl" in metrics
    assert metrics["actor/grad_nonfinite"] == [0.0]
    assert all(math.isfinite(v) and v > 0 for v in metrics["actor/grad_norm"])
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, module.parameters(), strict=True))
