"""Tiny Qwen3 (q/k norms, head_dim 2 x hidden / heads) and Qwen3-MoE (4 experts, 2 a token) through the
actor's paths that depend on the architecture: packed (the registered varlen attention) == padded
for log-probs, entropies and one update's gradients; Ulysses SP = 2 == SP = 1 on a packed row
(simulated SP ranks, tests/utils/test_ulysses_kv_heads.py's); and the MoE router's load-balancing loss,
off by default and, with `output_router_logits`, added to the policy loss with `router_aux_loss_coef`."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from tests.utils.test_ulysses_kv_heads import _packed_row, _sp_log_probs, _token_log_probs, ranks  # noqa: F401
from tests.workers.test_packed_equality import (
    PROMPT,
    actor,
    assert_same_step,
    meta,
    protocol_batch,
    reference_calls,  # noqa: F401
)
from verl.utils import batch_keys as K
from verl.utils import ulysses
from verl.utils.attention import PACKED_ATTENTION, attn_implementation
from verl.utils.tiny_model import build_tiny_model, save_model_and_tokenizer, train_bpe_tokenizer

ARCHS = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tok = train_bpe_tokenizer()
    return {arch: str(save_model_and_tokenizer(build_tiny_model(tok, arch, seed=1), tok,
                                               tmp_path_factory.mktemp(arch))) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_padded_log_probs_and_gradients(arch_dirs, reference_calls, arch: str) -> None:  # noqa: F811
    padded, packed = actor(arch_dirs[arch], False), actor(arch_dirs[arch], True)
    config = padded.actor_module.config
    assert config.head_dim * config.num_attention_heads != config.hidden_size   # Qwen3's own head_dim
    data = meta(protocol_batch(config.vocab_size, "tags", seed=3), False)
    lp_padded, ent_padded = padded.compute_log_prob(copy.copy(data), calculate_entropy=True)
    lp_packed, ent_packed = packed.compute_log_prob(copy.copy(data), calculate_entropy=True)
    assert reference_calls and max(reference_calls) >= 2
    real = data.batch[K.ATTENTION_MASK][:, PROMPT:].bool()
    # fp32, summation order only (~1e-6); a token routed to other experts or a leak moves them by > 1e-2
    torch.testing.assert_close(lp_packed[real], lp_padded[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed[real], ent_padded[real], atol=1e-5, rtol=0)
    data.batch[K.OLD_LOG_PROBS] = lp_padded + 0.05 * torch.randn_like(lp_padded)
    padded.update_policy(copy.copy(data))
    packed.update_policy(copy.copy(data))
    assert_same_step(padded.actor_module, packed.actor_module)


@pytest.mark.parametrize("arch", ARCHS)
def test_sp2_log_probs_equal_sp1(arch_dirs, ranks, arch: str) -> None:  # noqa: F811
    attn_implementation("cpu", True)   # registers the packed attention
    model = AutoModelForCausalLM.from_pretrained(arch_dirs[arch], dtype=torch.float32).eval()
    model.config._attn_implementation = PACKED_ATTENTION
    ids, positions, labels = _packed_row()   # 25 tokens in 3 sequences: SP = 2 pads one
    with torch.no_grad():
        reference = _token_log_probs(model(input_ids=ids, position_ids=positions, attention_mask=None,
                                           use_cache=False).logits, labels)
    sim = ranks(2)
    with ulysses.sequence_parallel(None, positions):
        gathered = sim.run(lambda rank: _sp_log_probs(model, ids, positions, labels, None, rank))
    for rank, log_probs in enumerate(gathered):
        torch.testing.assert_close(log_probs, reference, atol=1e-5, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}")


def _moe_actor(model_dir: str, router_logits: bool, coef: float = 0.5):
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_router_logits=router_logits,
                                                  router_aux_loss_coef=coef)
    cfg = OmegaConf.create({"ppo_mini_batch_size": 6, "ppo_micro_batch_size": 6, "use_dynamic_bsz": False,
                            "grad_clip": None, "clip_ratio": 0.2, "entropy_coeff": 0.0, "use_kl_loss": False,
                            "loss_agg_mode": "token-mean", "ppo_epochs": 1, "shuffle": False, "state_masking": True})
    return DataParallelPPOActor(cfg, module, torch.optim.SGD(module.parameters(), lr=1.0), use_remove_padding=False)


def test_the_router_load_balancing_loss_is_off_by_default_and_adds_coef_times_its_gradient(arch_dirs) -> None:
    plain, with_aux = _moe_actor(arch_dirs["qwen3_moe"], False), _moe_actor(arch_dirs["qwen3_moe"], True, coef=0.5)
    data = meta(protocol_batch(plain.actor_module.config.vocab_size, "tags", seed=5), False)
    data.batch[K.OLD_LOG_PROBS] = torch.zeros_like(data.batch[K.ADVANTAGES])
    assert "actor/router_aux_loss" not in plain.update_policy(copy.copy(data))
    # outside the update (log-probs, the HF engine's cached decoding) the module computes no aux loss
    assert with_aux.actor_module.config.output_router_logits is False
    metrics = with_aux.update_policy(copy.copy(data))
    assert metrics["actor/router_aux_loss"][0] > 0
    # SGD(lr=1): the two steps differ by coef x the gradient of transformers' aux_loss on the same batch
    reference = AutoModelForCausalLM.from_pretrained(arch_dirs["qwen3_moe"], dtype=torch.float32,
                                                     output_router_logits=True)
    b = data.batch
    out = reference(input_ids=b[K.INPUT_IDS], attention_mask=b[K.ATTENTION_MASK], position_ids=b[K.POSITION_IDS])
    assert out.aux_loss.item() == pytest.approx(metrics["actor/router_aux_loss"][0], rel=1e-6)
    out.aux_loss.backward()
    after_plain = dict(plain.actor_module.named_parameters())
    router = "model.layers.1.mlp.gate.weight"
    for name, p in with_aux.actor_module.named_parameters():
        grad = dict(reference.named_parameters())[name].grad
        expected = after_plain[name].detach() - 0.5 * (grad if grad is not None else 0)
        torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert dict(reference.named_parameters())[router].grad.abs().max() > 0
