"""DataParallelPPOActor in one process: packing, micro-batching, temperature, non-finite skip."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from tests.workers._batches import free_port, make_ppo_batch
from verl.utils import batch_keys as K
from verl.utils.fsdp_utils import apply_fsdp2
from verl.workers.actor.dp_actor import DataParallelPPOActor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def single_rank_group():
    """A world-size-1 gloo process group, so FSDP2 wraps the model as on a real rank."""
    created = False
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def actor_config(**overrides):
    base = {
        "ppo_mini_batch_size": 6, "ppo_micro_batch_size": 2, "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 40, "grad_clip": 1.0, "clip_ratio": 0.2, "entropy_coeff": 0.01,
        "use_kl_loss": False, "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl",
        "loss_agg_mode": "token-mean", "ppo_epochs": 1, "shuffle": False,
    }
    base.update(overrides)
    return OmegaConf.create(base)


def make_actor(model_dir, mesh, remove_padding=False, lr=1e-2, **overrides):
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    module = apply_fsdp2(module, mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    return DataParallelPPOActor(actor_config(**overrides), module, optimizer, use_remove_padding=remove_padding)


def with_meta(data, **meta):
    data.meta_info.update({K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 2, **meta})
    return data


def local_params(module):
    return {n: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
            for n, p in module.named_parameters()}


def test_packed_log_probs_equal_padded_log_probs(tiny_model_dir, single_rank_group):
    padded = make_actor(tiny_model_dir, single_rank_group, remove_padding=False)
    packed = make_actor(tiny_model_dir, single_rank_group, remove_padding=True)
    vocab = padded.actor_module.config.vocab_size
    data = with_meta(make_ppo_batch(vocab, batch_size=6, seed=1), micro_batch_size=3)
    lp_padded, ent_padded = padded.compute_log_prob(data, calculate_entropy=True)
    lp_packed, ent_packed = packed.compute_log_prob(data, calculate_entropy=True)
    mask = data.batch[K.ATTENTION_MASK][:, -lp_padded.shape[1]:].bool()
    assert lp_padded.shape == (6, 6)
    torch.testing.assert_close(lp_packed[mask], lp_padded[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed[mask], ent_padded[mask], atol=1e-5, rtol=0)
    # Packing must isolate sequences: with two rows in one pack, the second row is unchanged.
    lp_one_row, _ = packed.compute_log_prob(with_meta(data.slice(1, 2)), calculate_entropy=False)
    torch.testing.assert_close(lp_one_row[mask[1:2]], lp_packed[1:2][mask[1:2]], atol=1e-5, rtol=0)


def test_dynamic_bsz_matches_fixed_micro_batches(tiny_model_dir, single_rank_group):
    fixed = make_actor(tiny_model_dir, single_rank_group, loss_agg_mode="seq-mean-token-mean")
    dynamic = make_actor(tiny_model_dir, single_rank_group, loss_agg_mode="seq-mean-token-mean",
                         use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)
    data = make_ppo_batch(fixed.actor_module.config.vocab_size, batch_size=6, seed=2)
    lp_fixed, _ = fixed.compute_log_prob(with_meta(copy.copy(data)))
    lp_dynamic, _ = dynamic.compute_log_prob(with_meta(copy.copy(data), use_dynamic_bsz=True, max_token_len=20))
    torch.testing.assert_close(lp_dynamic, lp_fixed, atol=1e-5, rtol=0)

    data.batch[K.OLD_LOG_PROBS] = lp_fixed
    fixed.update_policy(with_meta(data))
    dynamic.update_policy(with_meta(data))
    for name, value in local_params(fixed.actor_module).items():
        torch.testing.assert_close(local_params(dynamic.actor_module)[name], value, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_temperature_divides_logits_before_log_softmax(tiny_model_dir, single_rank_group):
    actor = make_actor(tiny_model_dir, single_rank_group)
    data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=2, seed=3)
    lp_hot, _ = actor.compute_log_prob(with_meta(copy.copy(data), temperature=2.0))
    lp_cold, _ = actor.compute_log_prob(with_meta(copy.copy(data), temperature=1.0))
    batch = data.batch
    with torch.no_grad():
        logits = actor.actor_module(input_ids=batch[K.INPUT_IDS], attention_mask=batch[K.ATTENTION_MASK],
                                    position_ids=batch[K.POSITION_IDS]).logits[:, -7:-1]
    expected = torch.log_softmax(logits / 2.0, dim=-1).gather(-1, batch[K.RESPONSES].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp_hot, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(lp_hot, lp_cold)


def test_nonfinite_gradient_skips_the_step_and_is_counted(tiny_model_dir, single_rank_group):
    actor = make_actor(tiny_model_dir, single_rank_group)
    data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, seed=4)
    data.batch[K.ADVANTAGES] = torch.full_like(data.batch[K.ADVANTAGES], float("nan"))
    before = local_params(actor.actor_module)
    metrics = actor.update_policy(with_meta(data))
    assert metrics["actor/grad_nonfinite"] == [1.0]
    assert not all(torch.isfinite(torch.tensor(metrics["actor/grad_norm"])))
    for name, value in local_params(actor.actor_module).items():
        assert torch.equal(value, before[name]), f"{name} changed although the step was skipped"
    assert not actor.actor_optimizer.state, "Adam moments were created by a skipped step"


def test_update_policy_reports_metrics_and_moves_weights(tiny_model_dir, single_rank_group):
    actor = make_actor(tiny_model_dir, single_rank_group, use_kl_loss=True, ppo_epochs=2, ppo_mini_batch_size=3)
    data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, seed=5)
    data.batch[K.OLD_LOG_PROBS], _ = actor.compute_log_prob(with_meta(copy.copy(data)))
    data.batch[K.REF_LOG_PROB] = data.batch[K.OLD_LOG_PROBS] - 0.1
    before = local_params(actor.actor_module)
    metrics = actor.update_policy(with_meta(data))
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
                "actor/kl_coef", "actor/grad_norm"):
        assert metrics[key] and all(torch.isfinite(torch.tensor(metrics[key]))), key
    assert len(metrics["actor/grad_norm"]) == 4  # 2 epochs x 2 mini-batches
    assert metrics["actor/grad_nonfinite"] == [0.0]
    assert metrics["actor/kl_loss"][0] > 0  # low_var_kl of a 0.1 log-ratio
    changed = [n for n, v in local_params(actor.actor_module).items() if not torch.equal(v, before[n])]
    assert changed


def test_packing_is_refused_for_a_model_that_mixes_packed_sequences(tiny_model_dir):
    from verl.utils.remove_padding import check_packing_isolates_sequences

    inner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    check_packing_isolates_sequences(inner, inner.config.vocab_size)

    class IgnoresPositions(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
            return inner(input_ids=input_ids, use_cache=False)  # plain causal mask over the whole pack

    leaky = IgnoresPositions()
    leaky.register_parameter("p", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="use_remove_padding=False"):
        check_packing_isolates_sequences(leaky, inner.config.vocab_size)
