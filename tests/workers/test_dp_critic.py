"""DataParallelPPOCritic in one process: value alignment, packing, dynamic micro-batches."""

from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

from tests.workers._batches import make_ppo_batch
from verl.utils import batch_keys as K
from verl.utils.model import load_value_model
from verl.workers.critic.dp_critic import DataParallelPPOCritic

torch.set_num_threads(1)


def critic(model_dir: str, remove_padding: bool, state_masking: bool = True, sgd: bool = False,
           **overrides) -> DataParallelPPOCritic:
    cfg = OmegaConf.create({"state_masking": state_masking, "ppo_mini_batch_size": 6, "ppo_micro_batch_size": 2, "use_dynamic_bsz": False,
                            "ppo_max_token_len_per_gpu": 40, "grad_clip": 1.0, "cliprange_value": 0.5,
                            "ppo_epochs": 1, **overrides})
    torch.manual_seed(0)  # the value head is freshly initialised: make every copy identical
    module = load_value_model(model_dir)
    # SGD(lr=1): parameters after a step are params - grad, so comparing them compares gradients.
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0) if sgd else torch.optim.AdamW(module.parameters(), lr=1e-2)
    return DataParallelPPOCritic(cfg, module, optimizer, use_remove_padding=remove_padding)


def test_values_are_read_at_the_position_before_each_response_token(tiny_model_dir):
    padded, packed = critic(tiny_model_dir, False), critic(tiny_model_dir, True)
    data = make_ppo_batch(padded.critic_module.config.vocab_size, batch_size=6, seed=11)
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 4
    values = padded.compute_values(copy.copy(data))
    b = data.batch
    with torch.no_grad():
        full = padded.critic_module(input_ids=b[K.INPUT_IDS], attention_mask=b[K.ATTENTION_MASK],
                                    position_ids=b[K.POSITION_IDS]).logits.squeeze(-1)
    response_attn = b[K.ATTENTION_MASK][:, -6:]
    # The same padded forward on the same inputs: fp32 defaults of assert_close are ample.
    torch.testing.assert_close(values, full[:, -7:-1] * response_attn)
    # Packed vs padded attention kernels: rounding only (~1e-6 on values of size ~1).
    torch.testing.assert_close(packed.compute_values(copy.copy(data)), values, atol=1e-5, rtol=0)
    data.meta_info.update({K.META_USE_DYNAMIC_BSZ: True, K.META_MAX_TOKEN_LEN: 16})
    # Dynamic micro-batches regroup the same packed rows: the same rounding bound.
    torch.testing.assert_close(packed.compute_values(data), values, atol=1e-5, rtol=0)


def test_value_loss_is_masked_to_policy_tokens(tiny_model_dir):
    c = critic(tiny_model_dir, False)
    data = make_ppo_batch(c.critic_module.config.vocab_size, batch_size=6, seed=12)
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 6
    data.batch[K.VALUES] = c.compute_values(copy.copy(data))
    returns = data.batch[K.RETURNS]
    # Huge returns on masked-out (observation / padding) tokens must not move the loss.
    poisoned = copy.deepcopy(data)
    poisoned.batch[K.RETURNS] = torch.where(data.batch[K.RESPONSE_MASK].bool(), returns, torch.full_like(returns, 1e6))
    loss = critic(tiny_model_dir, False).update_critic(data)["critic/vf_loss"]
    loss_poisoned = critic(tiny_model_dir, False).update_critic(poisoned)["critic/vf_loss"]
    assert loss == loss_poisoned
    # critic.state_masking=False trains on every real response token, observations included.
    unmasked = critic(tiny_model_dir, False, state_masking=False).update_critic(poisoned)["critic/vf_loss"]
    assert unmasked[0] > 1e6


def test_value_head_fallback_gives_one_value_per_token(tiny_model_dir):
    from transformers import AutoModel

    from verl.utils.model import CausalLMWithValueHead, get_model_flops_info

    torch.manual_seed(0)
    module = CausalLMWithValueHead(AutoModel.from_pretrained(tiny_model_dir), hidden_size=64)
    cfg = OmegaConf.create({"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2, "grad_clip": 1.0,
                            "cliprange_value": 0.5})
    c = DataParallelPPOCritic(cfg, module, torch.optim.AdamW(module.parameters(), lr=1e-2), use_remove_padding=True)
    data = make_ppo_batch(module.config.vocab_size, batch_size=4, seed=13)
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 2
    values = c.compute_values(copy.copy(data))
    assert values.shape == (4, 6) and torch.isfinite(values).all()
    data.batch[K.VALUES] = values
    assert c.update_critic(data)["critic/grad_nonfinite"] == [0.0]
    assert get_model_flops_info(module).num_layers == 2


def test_token_mean_value_loss_over_uneven_micro_batches_is_the_mini_batch_token_mean(tiny_model_dir):
    """Issue 13 item 7 for the critic: micro-batches weigh their share of the mini-batch's tokens."""
    whole = critic(tiny_model_dir, False, sgd=True, grad_clip=None, ppo_micro_batch_size=6)
    split = critic(tiny_model_dir, False, sgd=True, grad_clip=None, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=14)
    data = make_ppo_batch(whole.critic_module.config.vocab_size, batch_size=6, prompt_len=8, response_len=6, seed=13)
    # Four one-token rows next to two six-token ones.
    data.batch[K.ATTENTION_MASK][4:, -6:] = 1
    data.batch[K.RESPONSE_MASK][4:] = 1
    data.batch[K.RESPONSE_MASK][:4, 1:] = 0
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 6
    data.batch[K.VALUES] = whole.compute_values(copy.copy(data))
    whole.update_critic(copy.copy(data))
    split.update_critic(copy.copy(data))
    for (name, a), (_, b) in zip(whole.critic_module.named_parameters(), split.critic_module.named_parameters(),
                                 strict=True):
        # The same gradient up to fp32 summation order (~1e-7 relative); a row-weighted
        # token-mean would move it by tens of percent.
        torch.testing.assert_close(b, a, atol=1e-7 + 1e-4 * float(a.abs().max()), rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_the_critic_passes_its_loss_scale_factor_to_the_value_loss(tiny_model_dir, monkeypatch):
    """critic.loss_scale_factor (set at start-up under seq-mean-token-sum-norm) reaches compute_value_loss."""
    from verl.trainer.ppo import core_algos

    seen = []
    real = core_algos.compute_value_loss

    def recording(*args, **kwargs):
        seen.append(args[6] if len(args) > 6 else kwargs.get("loss_scale_factor"))
        return real(*args, **kwargs)

    monkeypatch.setattr(core_algos, "compute_value_loss", recording)
    worker = critic(tiny_model_dir, False, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=96)
    data = make_ppo_batch(worker.critic_module.config.vocab_size, batch_size=6, prompt_len=8, response_len=6, seed=3)
    data.meta_info[K.META_MICRO_BATCH_SIZE] = 2
    data.batch[K.VALUES] = worker.compute_values(copy.copy(data))
    worker.update_critic(copy.copy(data))
    assert seen and set(seen) == {96}
