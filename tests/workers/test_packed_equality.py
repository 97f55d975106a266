"""Issue 35 item 3: packed (the registered "search_r1_varlen" attention) == padded (sdpa), for the
actor and the critic: log-probs, entropies, values and the gradients of one update.

The batches are shaped like each protocol's rollouts: the tag protocol's one <information> block
inside the response, the tool protocol's several tool-response turns; those observation tokens are
masked out of the loss (response_mask 0) but are attended to. Some rows are full length (no
padding), so a packed sequence ends exactly at the end of a micro-batch, fixed or by tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import verl.utils.packed_attention as packed_attention
from tests.workers._batches import make_ppo_batch
from verl.utils import batch_keys as K
from verl.utils.attention import PACKED_ATTENTION, attn_implementation
from verl.utils.model import load_value_model
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic

torch.set_num_threads(1)

PROMPT, RESPONSE, ROWS = 8, 10, 6
FULL = PROMPT + RESPONSE
# Observation spans (response positions) masked out of the loss in each protocol's batches.
OBSERVATIONS = {"tags": [(3, 6)], "tools": [(2, 4), (6, 8)]}


def protocol_batch(vocab_size: int, protocol: str, seed: int):
    data = make_ppo_batch(vocab_size, batch_size=ROWS, prompt_len=PROMPT, response_len=RESPONSE, seed=seed)
    b = data.batch
    g = torch.Generator().manual_seed(seed + 100)
    # Rows 2 and 5 are full length: with micro-batches of 3 rows, each packed micro-batch ends
    # exactly where a sequence ends (no padding after it); by tokens, a full row fills a budget of FULL.
    for row in (2, 5):
        b[K.ATTENTION_MASK][row] = 1
        b[K.INPUT_IDS][row] = torch.randint(3, vocab_size, (FULL,), generator=g)
        b[K.RESPONSES][row] = b[K.INPUT_IDS][row, PROMPT:]
        b[K.PROMPTS][row] = b[K.INPUT_IDS][row, :PROMPT]
    b[K.POSITION_IDS] = (torch.cumsum(b[K.ATTENTION_MASK], dim=-1) - 1).clamp(min=0)
    response_attn = b[K.ATTENTION_MASK][:, PROMPT:]
    mask = response_attn.clone()
    for start, end in OBSERVATIONS[protocol]:
        mask[:, start:end] = 0
    b[K.RESPONSE_MASK] = mask
    b[K.ADVANTAGES] = torch.randn(ROWS, RESPONSE, generator=g) * response_attn
    b[K.RETURNS] = torch.randn(ROWS, RESPONSE, generator=g) * response_attn
    b[K.OLD_LOG_PROBS] = torch.zeros(ROWS, RESPONSE)
    b[K.VALUES] = torch.zeros(ROWS, RESPONSE)
    return data


def _config(**overrides):
    base = {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size": 3, "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": FULL, "grad_clip": None, "clip_ratio": 0.2, "entropy_coeff": 0.01,
            "use_kl_loss": False, "loss_agg_mode": "token-mean", "ppo_epochs": 1, "shuffle": False,
            "state_masking": True, "cliprange_value": 0.5}
    base.update(overrides)
    return OmegaConf.create(base)


def actor(model_dir: str, packed: bool, **overrides) -> DataParallelPPOActor:
    attn = attn_implementation("cpu", packed)
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                  **({"attn_implementation": attn} if attn else {}))
    assert (module.config._attn_implementation == PACKED_ATTENTION) == packed
    # SGD(lr=1): parameters after a step are params - grad, so comparing them compares gradients.
    return DataParallelPPOActor(_config(**overrides), module, torch.optim.SGD(module.parameters(), lr=1.0),
                                use_remove_padding=packed)


def critic(model_dir: str, packed: bool, **overrides) -> DataParallelPPOCritic:
    torch.manual_seed(0)   # the value head is initialised fresh: the same in both copies
    module = load_value_model(model_dir, attn_implementation=attn_implementation("cpu", packed),
                              use_remove_padding=packed)
    return DataParallelPPOCritic(_config(**overrides), module, torch.optim.SGD(module.parameters(), lr=1.0),
                                 use_remove_padding=packed)


def meta(data, dynamic: bool):
    data.meta_info.update({K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 3, K.META_USE_DYNAMIC_BSZ: dynamic,
                           K.META_MAX_TOKEN_LEN: FULL})
    return data


def assert_same_step(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """After one SGD(lr=1) step from the same weights: the same gradients up to fp32 summation order
    (~1e-7 relative); 1e-4 of each tensor's scale holds on any CPU, a leak or a misplaced token moves
    gradients by tens of percent."""
    pb = dict(b.named_parameters())
    for name, value in a.named_parameters():
        scale = float(value.detach().abs().max())
        torch.testing.assert_close(pb[name].detach(), value.detach(), atol=1e-7 + 1e-4 * scale, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def reference_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the packed forwards that ran through the registered CPU reference path."""
    calls: list[int] = []
    real = packed_attention.reference_varlen_attention

    def counting(q, k, v, cu_seqlens, max_len, scale):
        calls.append(int(cu_seqlens.numel()) - 1)
        return real(q, k, v, cu_seqlens, max_len, scale)

    monkeypatch.setattr(packed_attention, "reference_varlen_attention", counting)
    return calls


@pytest.mark.parametrize("protocol", ["tags", "tools"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_actor_packed_equals_padded_log_probs_and_gradients(tiny_model_dir, reference_calls, protocol, dynamic):
    padded, packed = actor(tiny_model_dir, False, use_dynamic_bsz=dynamic), \
        actor(tiny_model_dir, True, use_dynamic_bsz=dynamic)
    data = meta(protocol_batch(padded.actor_module.config.vocab_size, protocol, seed=3), dynamic)
    lp_padded, ent_padded = padded.compute_log_prob(copy.copy(data), calculate_entropy=True)
    lp_packed, ent_packed = packed.compute_log_prob(copy.copy(data), calculate_entropy=True)
    assert reference_calls and max(reference_calls) >= 2   # packed micro-batches of several sequences
    real = data.batch[K.ATTENTION_MASK][:, PROMPT:].bool()
    # fp32 attention over <= 18 tokens per sequence: summation-order rounding (~1e-6 on values of
    # size < 10); 1e-5 holds on any CPU, a leak moves them by > 1e-2.
    torch.testing.assert_close(lp_packed[real], lp_padded[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed[real], ent_padded[real], atol=1e-5, rtol=0)
    data.batch[K.OLD_LOG_PROBS] = lp_padded + 0.05 * torch.randn_like(lp_padded)   # ratios away from 1
    padded.update_policy(copy.copy(data))
    packed.update_policy(copy.copy(data))
    assert_same_step(padded.actor_module, packed.actor_module)


@pytest.mark.parametrize("protocol", ["tags", "tools"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_critic_packed_equals_padded_values_and_gradients(tiny_model_dir, reference_calls, protocol, dynamic):
    padded, packed = critic(tiny_model_dir, False, use_dynamic_bsz=dynamic), \
        critic(tiny_model_dir, True, use_dynamic_bsz=dynamic)
    data = meta(protocol_batch(padded.critic_module.config.vocab_size, protocol, seed=4), dynamic)
    values = padded.compute_values(copy.copy(data))
    torch.testing.assert_close(packed.compute_values(copy.copy(data)), values, atol=1e-5, rtol=0)
    assert reference_calls
    data.batch[K.VALUES] = values
    padded.update_critic(copy.copy(data))
    packed.update_critic(copy.copy(data))
    assert_same_step(padded.critic_module, packed.critic_module)


def test_packing_check_passes_through_the_registered_attention(tiny_model_dir, reference_calls):
    """The one-time leak check (check_packing_isolates_sequences) runs on the packed implementation."""
    from verl.utils.remove_padding import check_packing_isolates_sequences

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation("cpu", True))
    check_packing_isolates_sequences(model, model.config.vocab_size)
    assert reference_calls and all(n == 2 for n in reference_calls)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_packed_forward_derives_its_boundaries_once_for_every_layer_and_the_recompute(
        tiny_model_dir, reference_calls, monkeypatch, role):
    """cu_seqlens cost two host syncs (nonzero, max): the actor and critic derive them once per packed
    micro-batch (`boundary_kwargs`) and every layer's attention, gradient checkpointing's recompute
    included, reuses them. The old code derived them in each layer: layers x (forward + recompute)."""
    worker = actor(tiny_model_dir, True) if role == "actor" else critic(tiny_model_dir, True)
    module = worker.actor_module if role == "actor" else worker.critic_module
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module.train()
    data = meta(protocol_batch(module.config.vocab_size, "tools", seed=5), dynamic=False)
    forward = worker.compute_log_prob if role == "actor" else worker.compute_values
    forward(copy.copy(data))               # the first call also runs the one-time packing check
    derived: list[int] = []
    real = packed_attention.cu_seqlens_from_position_ids
    monkeypatch.setattr(packed_attention, "cu_seqlens_from_position_ids",
                        lambda p: derived.append(1) or real(p))
    reference_calls.clear()
    out = forward(copy.copy(data))
    if role == "actor":
        data.batch[K.OLD_LOG_PROBS] = out[0]
        worker.update_policy(copy.copy(data))
    else:
        data.batch[K.VALUES] = out
        worker.update_critic(copy.copy(data))
    layers, micro_batches = module.config.num_hidden_layers, ROWS // 3
    assert layers >= 2
    # Two passes (no-grad forward; update forward + its recompute), two micro-batches each.
    assert len(derived) == 2 * micro_batches
    assert len(reference_calls) == 3 * micro_batches * layers and min(reference_calls) >= 2
