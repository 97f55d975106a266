"""DataParallelPPOCritic settings mutation testing found unpinned (docs/testing.md): the defaults of
state_masking, ppo_epochs and shuffle, the per-update, per-epoch reproducible shuffle, the error text."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from tests.workers._batches import make_ppo_batch
from verl.utils.model import load_value_model
from verl.workers.actor.dp_actor import shuffle_seed
from verl.workers.critic.dp_critic import DataParallelPPOCritic

torch.set_num_threads(1)


def make_critic(model_dir: str, optimizer: bool = True, **settings) -> DataParallelPPOCritic:
    cfg = OmegaConf.create({"ppo_mini_batch_size": 3, "ppo_micro_batch_size": 3, "cliprange_value": 0.5,
                            "grad_clip": 1.0, **settings})   # state_masking, ppo_epochs, shuffle: defaults
    torch.manual_seed(0)
    module = load_value_model(model_dir)
    return DataParallelPPOCritic(cfg, module, torch.optim.SGD(module.parameters(), lr=1e-3) if optimizer else None)


@pytest.fixture
def randperms(monkeypatch) -> list[list[int]]:
    calls: list[list[int]] = []
    real = torch.randperm

    def recording(n, *args, **kwargs):
        out = real(n, *args, **kwargs)
        calls.append(out.tolist())
        return out

    monkeypatch.setattr(torch, "randperm", recording)
    return calls


def test_critic_defaults_mask_observations_one_epoch_no_shuffle(tiny_model_dir, randperms):
    critic = make_critic(tiny_model_dir)
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=6, seed=3)
    mask = critic._loss_mask(data.batch)
    assert torch.equal(mask, data.batch["response_mask"].float())          # state_masking defaults to true
    assert not torch.equal(mask, data.batch["attention_mask"][:, -6:].float())
    metrics = critic.update_critic(copy.copy(data))
    assert len(metrics["critic/grad_norm"]) == 2                            # one epoch of 2 mini-batches
    assert randperms == []                                                  # no shuffle unless asked


def test_critic_shuffles_anew_every_update_and_epoch_and_reproducibly(tiny_model_dir, randperms):
    def two_updates() -> list[list[int]]:
        randperms.clear()
        critic = make_critic(tiny_model_dir, shuffle=True, ppo_epochs=2, shuffle_seed=5)
        data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=6, seed=3)
        for _ in range(3):
            critic.update_critic(copy.copy(data))
        return list(randperms)

    first = two_updates()
    cfg = OmegaConf.create({"shuffle_seed": 5})
    expected = [torch.randperm(6, generator=torch.Generator().manual_seed(shuffle_seed(cfg, call, epoch))).tolist()
                for call in range(3) for epoch in range(2)]
    assert first == expected                      # 3 updates x 2 epochs, seeded by (update call, epoch)
    assert len({tuple(p) for p in expected}) == 6
    assert two_updates() == first


def test_update_without_optimizer_says_so(tiny_model_dir):
    critic = make_critic(tiny_model_dir, optimizer=False)
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=3, seed=3)
    with pytest.raises(RuntimeError) as err:
        critic.update_critic(data)
    assert str(err.value) == "update_critic needs an optimizer"


def test_critic_reads_packing_and_dynamic_batching_from_its_config(tiny_model_dir):
    assert make_critic(tiny_model_dir).use_remove_padding is False
    assert make_critic(tiny_model_dir, model={"use_remove_padding": True}).use_remove_padding is True
    data = make_ppo_batch(load_value_model(tiny_model_dir).config.vocab_size, batch_size=6, seed=3)
    fixed = make_critic(tiny_model_dir).update_critic(copy.copy(data))
    dynamic = make_critic(tiny_model_dir, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=14).update_critic(
        copy.copy(data))
    assert len(fixed["critic/vf_loss"]) == 2                   # one micro-batch of 3 rows per mini-batch
    assert len(dynamic["critic/vf_loss"]) > 2                  # <= 14 tokens per micro-batch: more of them


def test_critic_metrics_grad_clip_and_nonfinite_count(tiny_model_dir):
    data = make_ppo_batch(load_value_model(tiny_model_dir).config.vocab_size, batch_size=6, seed=3)
    critic = make_critic(tiny_model_dir, grad_clip=1e-3)
    before = [p.detach().clone() for p in critic.critic_module.parameters()]
    metrics = critic.update_critic(copy.copy(data))
    for key in ("critic/vf_clipfrac", "critic/vpred_mean"):
        assert len(metrics[key]) == 2 and all(isinstance(v, float) for v in metrics[key]), key
    assert all(norm > 1e-3 for norm in metrics["critic/grad_norm"])      # the norm before clipping
    step = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(critic.critic_module.parameters(), before)))
    assert float(step) <= 2 * 1e-3 * 1e-3 * 1.01                         # lr x clip per step, 2 steps
    poisoned = copy.copy(data)
    poisoned.batch["returns"] = torch.full_like(data.batch["returns"], float("nan"))
    assert make_critic(tiny_model_dir).update_critic(poisoned)["critic/grad_nonfinite"] == [2.0]


def test_padded_values_equal_each_row_run_alone_without_padding(tiny_model_dir):
    critic = make_critic(tiny_model_dir)
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=4, seed=9)
    data.meta_info["micro_batch_size"] = 4
    values = critic.compute_values(copy.copy(data))
    b = data.batch
    response_length = b["responses"].shape[1]
    for row in range(4):
        real = b["attention_mask"][row].bool()
        ids = b["input_ids"][row][real][None]
        with torch.no_grad():
            alone = critic.critic_module(input_ids=ids).logits.squeeze(-1)[0]
        n_resp = int(b["attention_mask"][row, -response_length:].sum())
        # Response token j is valued at the position before it.
        expected = alone[-n_resp - 1:-1]
        torch.testing.assert_close(values[row, :n_resp], expected, rtol=1e-4, atol=1e-5)
