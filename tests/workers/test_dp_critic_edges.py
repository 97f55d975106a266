"""DataParallelPPOCritic behaviour mutation testing found unpinned (docs/testing.md): the defaults of
state_masking, ppo_epochs and shuffle, the per-update, per-epoch reproducible shuffle, the error text,
the packing check, and the padded forward's attention_mask and position_ids."""

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


class _IgnoresPositions(torch.nn.Module):
    """A value model that reads no sequence boundaries from position_ids: packed, every token
    attends to every earlier one, whichever sequence it belongs to."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, **boundaries):
        return self.inner(input_ids=input_ids, use_cache=False)   # a plain causal mask over the whole pack


def test_packing_critic_refuses_a_model_that_mixes_packed_sequences_and_accepts_one_that_does_not(tiny_model_dir):
    data = make_ppo_batch(load_value_model(tiny_model_dir).config.vocab_size, batch_size=4, seed=9)
    data.meta_info["micro_batch_size"] = 4
    leaky = make_critic(tiny_model_dir, model={"use_remove_padding": True})
    leaky.critic_module = _IgnoresPositions(leaky.critic_module)
    with pytest.raises(ValueError, match="attends across packed sequences.*use_remove_padding=False"):
        leaky.compute_values(copy.copy(data))
    packed = make_critic(tiny_model_dir, model={"use_remove_padding": True})
    values = packed.compute_values(copy.copy(data))   # the check passes: Qwen2 isolates packed sequences
    torch.testing.assert_close(values, make_critic(tiny_model_dir).compute_values(copy.copy(data)),
                               atol=1e-5, rtol=0)


# Why the padded forward must pass both attention_mask and position_ids, although Qwen2 under
# transformers 5 gives the same values without either one (docs/testing.md, dp_critic survivors):
# with attention_mask=None, transformers 5 cuts sequences where position_ids do not step by 1, and the
# trainer's position_ids (cumsum(mask) - 1, clamped at 0) repeat on every pad, so the real tokens form
# one segment of their own; without position_ids every row counts from 0 at its first pad, a shift of
# all real positions that RoPE attention does not see. Neither holds for every model the padded path
# is for (it is the fallback for models that fail the packing check): one whose positions are learned
# embeddings, one that takes a missing mask as "no padding" (transformers 4, most non-HF models).


class _MissingMaskMeansNoPadding(torch.nn.Module):
    """The inner model, but a missing attention_mask means every token is real (Hugging Face's
    documented meaning), not boundaries guessed from position_ids."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)


def _tiny_gpt2_value_model(vocab_size: int) -> torch.nn.Module:
    """A token-classification value model whose positions are learned absolute embeddings."""
    from transformers import GPT2Config, GPT2ForTokenClassification

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=2, num_labels=1,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, classifier_dropout=0.0,
                     bos_token_id=None, eos_token_id=None)
    return GPT2ForTokenClassification(cfg)


def _assert_padded_values_equal_each_row_alone(critic: DataParallelPPOCritic, vocab_size: int) -> None:
    """Left-padded prompts and right-padded responses, position_ids counting from 0 at the first real
    token, as the rollout builds them (position_ids_from_mask)."""
    data = make_ppo_batch(vocab_size, batch_size=4, seed=9)
    b = data.batch
    assert int((b["attention_mask"][:, 0] == 0).sum()) >= 2, "rows must start with left padding"
    data.meta_info["micro_batch_size"] = 4
    values = critic.compute_values(copy.copy(data))
    response_length = b["responses"].shape[1]
    for row in range(4):
        real = b["attention_mask"][row].bool()
        with torch.no_grad():
            alone = critic.critic_module(input_ids=b["input_ids"][row][real][None],
                                         attention_mask=torch.ones(1, int(real.sum()), dtype=torch.long),
                                         position_ids=torch.arange(int(real.sum()))[None],
                                         use_cache=False).logits.squeeze(-1)[0]
        n_resp = int(b["attention_mask"][row, -response_length:].sum())
        torch.testing.assert_close(values[row, :n_resp], alone[-n_resp - 1:-1], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, r=row: f"row {r}: {m}")


def test_padded_values_of_a_model_with_learned_positions_equal_each_row_run_alone(tiny_model_dir):
    vocab_size = load_value_model(tiny_model_dir).config.vocab_size
    critic = make_critic(tiny_model_dir, optimizer=False)
    critic.critic_module = _tiny_gpt2_value_model(vocab_size)
    _assert_padded_values_equal_each_row_alone(critic, vocab_size)


def test_padded_values_of_a_model_that_takes_no_mask_as_no_padding_equal_each_row_run_alone(tiny_model_dir):
    critic = make_critic(tiny_model_dir, optimizer=False)
    critic.critic_module = _MissingMaskMeansNoPadding(critic.critic_module)
    _assert_padded_values_equal_each_row_alone(critic, critic.critic_module.config.vocab_size)


def test_packing_check_runs_once_per_critic(tiny_model_dir, monkeypatch):
    """The check costs two extra forwards: the first packed forward runs it, later ones do not."""
    from verl.workers.critic import dp_critic

    calls = []
    check = dp_critic.check_packing_isolates_sequences
    monkeypatch.setattr(dp_critic, "check_packing_isolates_sequences",
                        lambda *args, **kw: calls.append(1) or check(*args, **kw))
    critic = make_critic(tiny_model_dir, model={"use_remove_padding": True})
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=6, seed=3)
    data.meta_info["micro_batch_size"] = 3
    critic.compute_values(copy.copy(data))
    critic.update_critic(copy.copy(data))
    critic.compute_values(copy.copy(data))
    assert len(calls) == 1


def test_compute_values_balances_micro_batches_by_tokens_when_the_batch_asks(tiny_model_dir, monkeypatch):
    critic = make_critic(tiny_model_dir)
    rows_per_forward: list[int] = []
    forward = critic._forward_micro_batch
    monkeypatch.setattr(critic, "_forward_micro_batch",
                        lambda micro: rows_per_forward.append(micro.batch_size[0]) or forward(micro))
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=6, seed=3)
    data.meta_info.update(micro_batch_size=6, max_token_len=14)
    fixed = critic.compute_values(copy.copy(data))
    assert rows_per_forward == [6]
    rows_per_forward.clear()
    data.meta_info["use_dynamic_bsz"] = True
    dynamic = critic.compute_values(copy.copy(data))
    assert len(rows_per_forward) > 1 and sum(rows_per_forward) == 6      # <= 14 real tokens per forward
    torch.testing.assert_close(dynamic, fixed, rtol=1e-4, atol=1e-5)     # in the batch's row order


def test_critic_update_frees_the_gradients(tiny_model_dir):
    """After each optimizer step the gradients are freed, not kept as zeros (a model's worth of memory)."""
    critic = make_critic(tiny_model_dir)
    data = make_ppo_batch(critic.critic_module.config.vocab_size, batch_size=6, seed=3)
    critic.update_critic(copy.copy(data))
    assert all(p.grad is None for p in critic.critic_module.parameters())
