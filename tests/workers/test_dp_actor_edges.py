"""DataParallelPPOActor behaviour mutation testing found unpinned (docs/testing.md, dp_actor): the
defaults of an actor config that leaves keys out, use_remove_padding read from the config and the
packing check on the first forward, a packed row whose prompt is one token, dynamic batching without a
fixed micro-batch size (and its entropies), the KL loss's sign, grad_clip, the non-finite count over
several mini-batches, the seed of every update call's shuffle, the data-parallel loss share, freed
gradients, and the error texts."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from tests.workers._batches import make_ppo_batch
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils import batch_keys as K
from verl.utils import torch_functional as tf
from verl.workers.actor.dp_actor import DataParallelPPOActor, shuffle_seed

torch.set_num_threads(1)

# The keys the actor reads without a default; everything else is left to the actor's defaults.
REQUIRED = {"ppo_mini_batch_size": 3, "ppo_micro_batch_size": 2, "clip_ratio": 0.2}
# What those defaults are meant to be, spelled out.
DEFAULTS = {"ppo_epochs": 1, "shuffle": False, "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "use_dynamic_bsz": False, "grad_clip": None, "use_remove_padding": False}


def make_actor(model_dir: str, optimizer: bool = True, lr: float = 1e-2, packing_arg: bool | None = None,
               **settings: Any) -> DataParallelPPOActor:
    """A plain (unwrapped) tiny Qwen2 actor with SGD, over REQUIRED + `settings`; `packing_arg` is the
    constructor's use_remove_padding (None: read from the config)."""
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OmegaConf.create({**REQUIRED, **settings})
    opt = torch.optim.SGD(module.parameters(), lr=lr) if optimizer else None
    return DataParallelPPOActor(cfg, module, opt, use_remove_padding=packing_arg)


def with_meta(data: DataProto, **meta: Any) -> DataProto:
    data = copy.copy(data)
    data.meta_info = {K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 2, **meta}
    return data


def params(actor: DataParallelPPOActor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.actor_module.parameters()]


def step_norm(before: list[torch.Tensor], actor: DataParallelPPOActor) -> float:
    return float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in
                                zip(actor.actor_module.parameters(), before, strict=True))))


def _vocab(model_dir: str) -> int:
    return AutoConfig.from_pretrained(model_dir).vocab_size


# ------------------------------------------------------------------ defaults and config


def test_actor_config_without_optional_keys_updates_as_the_documented_defaults(tiny_model_dir, randperms):
    """One epoch, mini-batches in order, token-mean, no entropy bonus, no KL loss (no ref_log_prob
    needed), fixed micro-batches (no ppo_max_token_len_per_gpu needed), no clipping."""
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=3)
    data = data.select(batch_keys=[k for k in data.batch.keys() if k != K.REF_LOG_PROB])
    # Micro-batches of 2 + 1 rows whose token shares differ from their row shares.
    data.batch[K.RESPONSE_MASK][2, 1:] = 0
    data.batch[K.RESPONSE_MASK][5, 1:] = 0
    bare, spelled = make_actor(tiny_model_dir), make_actor(tiny_model_dir, **DEFAULTS)
    before = params(bare)
    bare_metrics = bare.update_policy(with_meta(data))
    assert randperms == []                                            # no shuffle unless asked
    spelled_metrics = spelled.update_policy(with_meta(data))
    assert len(bare_metrics["actor/grad_norm"]) == 2                  # one epoch of 2 mini-batches
    assert "actor/kl_loss" not in bare_metrics
    assert bare_metrics == spelled_metrics
    for got, expected in zip(bare.actor_module.parameters(), spelled.actor_module.parameters(), strict=True):
        assert torch.equal(got, expected)
    assert step_norm(before, bare) > 0


class _IgnoresPositions(torch.nn.Module):
    """A causal LM that reads no sequence boundaries from position_ids (and ignores the mask):
    packed, every token attends to every earlier one, whichever sequence it belongs to."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, logits_to_keep=0,
                **boundaries):
        return self.inner(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep)


def test_packing_is_read_from_the_config_and_checked_on_the_first_forward(tiny_model_dir):
    data = with_meta(make_ppo_batch(_vocab(tiny_model_dir), batch_size=4, seed=9))
    packing = make_actor(tiny_model_dir, optimizer=False, use_remove_padding=True)   # config, no argument
    packing.actor_module = _IgnoresPositions(packing.actor_module)
    with pytest.raises(ValueError, match="attends across packed sequences.*use_remove_padding=False"):
        packing.compute_log_prob(data)
    # Without the key the padded forward runs: no packing, so no check to refuse this model.
    padded = make_actor(tiny_model_dir, optimizer=False)
    padded.actor_module = _IgnoresPositions(padded.actor_module)
    log_probs, _ = padded.compute_log_prob(data)
    assert log_probs.shape == (4, 6) and bool(torch.isfinite(log_probs).all())


def test_log_probs_come_without_entropy_unless_asked(tiny_model_dir):
    actor = make_actor(tiny_model_dir, optimizer=False)
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=2, seed=3)
    log_probs, entropy = actor.compute_log_prob(with_meta(data))
    assert entropy is None and log_probs.shape == (2, 6)


# ------------------------------------------------------------------ forward


def test_packed_log_prob_of_the_first_response_token_after_a_one_token_prompt(tiny_model_dir):
    """Row 0's prompt is a single token, so the position that predicts its first response token is the
    first token of the whole pack (packed slot 0): it must be kept like any other."""
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=3, seed=9)
    b = data.batch
    prompt_len = b[K.PROMPTS].shape[1]
    b[K.ATTENTION_MASK][0, :prompt_len - 1] = 0
    b[K.INPUT_IDS][0, :prompt_len - 1] = 0
    b[K.POSITION_IDS][0] = (torch.cumsum(b[K.ATTENTION_MASK][0], dim=-1) - 1).clamp(min=0)
    padded, _ = make_actor(tiny_model_dir, optimizer=False).compute_log_prob(with_meta(data, micro_batch_size=3))
    packed, _ = make_actor(tiny_model_dir, optimizer=False, packing_arg=True).compute_log_prob(
        with_meta(data, micro_batch_size=3))
    assert float(padded[0, 0]) < -0.1                         # a real log-prob, not the buffer's 0
    torch.testing.assert_close(packed[:, 0], padded[:, 0], atol=1e-5, rtol=0)


def test_dynamic_batching_needs_no_fixed_micro_batch_size_and_keeps_entropies_in_row_order(tiny_model_dir):
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=2)
    actor = make_actor(tiny_model_dir)
    fixed_lp, fixed_ent = actor.compute_log_prob(with_meta(data, micro_batch_size=6), calculate_entropy=True)
    meta = {K.META_TEMPERATURE: 1.0, K.META_USE_DYNAMIC_BSZ: True, K.META_MAX_TOKEN_LEN: 14}
    dyn = copy.copy(data)
    dyn.meta_info = meta                                      # no micro_batch_size
    dyn_lp, dyn_ent = actor.compute_log_prob(dyn, calculate_entropy=True)
    # The same fp32 forward over other row groupings: rounding only.
    torch.testing.assert_close(dyn_lp, fixed_lp, atol=1e-5, rtol=0)
    assert dyn_ent is not None
    torch.testing.assert_close(dyn_ent, fixed_ent, atol=1e-5, rtol=0)

    # The update too: token-budget micro-batches, ppo_micro_batch_size unset.
    dynamic = make_actor(tiny_model_dir, ppo_micro_batch_size=None, use_dynamic_bsz=True,
                         ppo_max_token_len_per_gpu=14)
    data.batch[K.OLD_LOG_PROBS] = fixed_lp
    metrics = dynamic.update_policy(with_meta(data))
    assert len(metrics["actor/grad_norm"]) == 2
    assert len(metrics["actor/pg_loss"]) > 2                  # <= 14 tokens each: more than one per mini-batch


# ------------------------------------------------------------------ loss and step


def _kl_to_ref(actor: DataParallelPPOActor, data: DataProto) -> float:
    log_probs, _ = actor.compute_log_prob(with_meta(data))
    kld = core_algos.kl_penalty(log_probs, data.batch[K.REF_LOG_PROB], "low_var_kl")
    return float(tf.agg_loss(kld, data.batch[K.RESPONSE_MASK].float(), "token-mean"))


def test_kl_loss_pulls_the_policy_toward_the_reference(tiny_model_dir):
    actor = make_actor(tiny_model_dir, lr=0.05, ppo_mini_batch_size=6, ppo_micro_batch_size=6,
                       use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl")
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=5)
    data.batch[K.ADVANTAGES] = torch.zeros_like(data.batch[K.ADVANTAGES])   # the KL term alone moves it
    data.batch[K.OLD_LOG_PROBS], _ = actor.compute_log_prob(with_meta(data))
    data.batch[K.REF_LOG_PROB] = data.batch[K.OLD_LOG_PROBS] - 0.5
    before = _kl_to_ref(actor, data)
    metrics = actor.update_policy(with_meta(data))
    assert metrics["actor/kl_loss"][0] == pytest.approx(before, rel=1e-4)
    assert _kl_to_ref(actor, data) < before


def test_grad_clip_bounds_the_step_and_the_reported_norm_is_the_unclipped_one(tiny_model_dir):
    actor = make_actor(tiny_model_dir, lr=1.0, ppo_mini_batch_size=6, ppo_micro_batch_size=3, grad_clip=1e-4)
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=3)
    before = params(actor)
    metrics = actor.update_policy(with_meta(data))
    assert metrics["actor/grad_norm"][0] > 1e-3
    assert step_norm(before, actor) == pytest.approx(1e-4, rel=1e-2)       # SGD, lr 1: the clipped gradient


def test_nonfinite_count_adds_up_over_the_mini_batches(tiny_model_dir):
    actor = make_actor(tiny_model_dir)
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=4)
    data.batch[K.ADVANTAGES][:3] = float("nan")               # the first mini-batch only
    metrics = actor.update_policy(with_meta(data))
    assert metrics["actor/grad_nonfinite"] == [1.0]
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"][1]))


def test_gradients_are_freed_when_the_update_returns(tiny_model_dir):
    """Between updates the rollout runs in the memory the gradients took (the memory plan counts
    actor gradients in the update phase only): they are freed, not kept zeroed."""
    actor = make_actor(tiny_model_dir)
    metrics = actor.update_policy(with_meta(make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=3)))
    assert metrics["actor/grad_nonfinite"] == [0.0]
    assert all(p.grad is None for p in actor.actor_module.parameters())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_under_data_parallelism_weighs_micro_batches_by_the_global_mini_batch(tiny_model_dir, monkeypatch,
                                                                                      mode):
    """On 2 ranks that hold the same rows, FSDP's average of the two gradients is each rank's own: it
    must equal the one-process gradient (the totals are faked here; the 2-rank run is the slow
    tests/workers/test_dp_gradient_share.py)."""
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=11)
    one = make_actor(tiny_model_dir, lr=1.0, ppo_mini_batch_size=6, loss_agg_mode=mode)
    before = params(one)
    one.update_policy(with_meta(data))
    monkeypatch.setattr(tf, "data_parallel_totals", lambda tokens, rows, device: (2 * tokens, 2.0 * rows, 2))
    two = make_actor(tiny_model_dir, lr=1.0, ppo_mini_batch_size=6, loss_agg_mode=mode)
    two.update_policy(with_meta(data))
    assert step_norm(before, one) > 0
    for got, expected in zip(two.actor_module.parameters(), one.actor_module.parameters(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_row_rejected_whole_is_not_a_row_of_the_seq_mean_in_any_micro_batch_split(tiny_model_dir, mode):
    """A row whose every token left response_mask (rollout-correction rejection) counts in neither the
    loss's denominator nor a micro-batch's row share: the update equals the one without that row, with
    the rows in one micro-batch or split 2 + 2 + (1 + the rejected one)."""
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=6, seed=11)
    without = make_actor(tiny_model_dir, lr=1.0, ppo_mini_batch_size=5, ppo_micro_batch_size=2, loss_agg_mode=mode)
    before = params(without)
    without.update_policy(with_meta(data[:5]))
    assert step_norm(before, without) > 0
    data.batch[K.RESPONSE_MASK][5] = 0
    for micro in (2, 6):
        rejected = make_actor(tiny_model_dir, lr=1.0, ppo_mini_batch_size=6, ppo_micro_batch_size=micro,
                              loss_agg_mode=mode)
        rejected.update_policy(with_meta(data, **{K.META_MICRO_BATCH_SIZE: micro}))
        for got, expected in zip(rejected.actor_module.parameters(), without.actor_module.parameters(), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_the_dual_clip_bound_comes_from_the_config_and_is_reported(tiny_model_dir):
    """Ratio e^5 on every token with A = -1: clip_ratio_c=3 holds each token's loss at 3 (no gradient,
    pg_clipfrac_lower 1); a bound of 1000 lets the ratio through."""
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=3, seed=5)
    probe = make_actor(tiny_model_dir, optimizer=False)
    log_probs, _ = probe.compute_log_prob(with_meta(data))
    data.batch[K.OLD_LOG_PROBS] = log_probs - 5.0
    data.batch[K.ADVANTAGES] = -torch.ones_like(log_probs)
    bounded = make_actor(tiny_model_dir, lr=1.0, clip_ratio_c=3.0)
    before = params(bounded)
    metrics = bounded.update_policy(with_meta(data))
    assert metrics["actor/pg_loss"] == pytest.approx([3.0, 3.0])           # two micro-batches (2 + 1 rows)
    assert metrics["actor/pg_clipfrac_lower"] == [1.0, 1.0]
    assert metrics["actor/pg_clipfrac"] == [0.0, 0.0]
    assert step_norm(before, bounded) == 0.0
    loose = make_actor(tiny_model_dir, lr=1.0, clip_ratio_c=1000.0).update_policy(with_meta(data))
    assert loose["actor/pg_loss"] == pytest.approx([math.exp(5.0)] * 2, rel=1e-4)
    assert loose["actor/pg_clipfrac_lower"] == [0.0, 0.0]


# ------------------------------------------------------------------ shuffle


def test_each_update_call_and_epoch_shuffles_with_its_own_seed_from_shuffle_seed(tiny_model_dir, randperms):
    def three_updates(seed: int) -> list[list[int]]:
        randperms.clear()
        actor = make_actor(tiny_model_dir, lr=1e-4, shuffle=True, ppo_epochs=2, shuffle_seed=seed)
        data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, seed=8)
        for _ in range(3):
            actor.update_policy(with_meta(data))
        return list(randperms)

    first = three_updates(5)
    cfg = OmegaConf.create({"shuffle_seed": 5})
    expected = [torch.randperm(6, generator=torch.Generator().manual_seed(shuffle_seed(cfg, call, epoch))).tolist()
                for call in range(3) for epoch in range(2)]
    assert first == expected                      # 3 updates x 2 epochs, seeded by (update call, epoch)
    assert len({tuple(p) for p in expected}) == 6
    assert three_updates(6) != first              # the configured seed changes the shuffle


# ------------------------------------------------------------------ errors


def test_missing_temperature_and_missing_optimizer_say_what_is_wrong(tiny_model_dir):
    actor = make_actor(tiny_model_dir, optimizer=False)
    data = make_ppo_batch(_vocab(tiny_model_dir), batch_size=2, seed=3)
    with pytest.raises(KeyError, match=r"meta_info\['temperature'\] is required"):
        actor.compute_log_prob(data)
    with pytest.raises(RuntimeError) as err:
        actor.update_policy(with_meta(data))
    assert str(err.value) == "update_policy needs an optimizer; this actor was built for inference only"
