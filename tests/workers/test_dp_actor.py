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

from tests.conftest import run_ranks
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


def make_actor(model_dir, mesh, remove_padding=False, lr=1e-2, sgd=False, **overrides):
    from verl.utils.attention import attn_implementation

    attn = attn_implementation("cpu", remove_padding)   # packing: the registered packed attention, as workers load
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                  **({"attn_implementation": attn} if attn else {}))
    module = apply_fsdp2(module, mesh)
    # SGD with lr=1 leaves params - grad: comparing parameters then compares gradients, whose
    # differences are summation-order rounding. (After one Adam step each element moves by about
    # lr * sign(grad), so an element whose gradient is ~0 can differ by up to lr between two
    # summation orders: Adam makes parameter comparisons machine-dependent.)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0) if sgd else torch.optim.AdamW(module.parameters(), lr=lr)
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
    # Packed vs padded fp32 attention over <= 14 tokens: summation-order rounding, ~1e-6 on
    # log-probs and entropies of size < 10 (ln V); 1e-5 holds on any CPU, a leak moves them by > 1e-2.
    torch.testing.assert_close(lp_packed[mask], lp_padded[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_packed[mask], ent_padded[mask], atol=1e-5, rtol=0)
    # Packing must isolate sequences: with two rows in one pack, the second row is unchanged.
    lp_one_row, _ = packed.compute_log_prob(with_meta(data.slice(1, 2)), calculate_entropy=False)
    # Same argument: a pack of one row vs two differs by rounding only.
    torch.testing.assert_close(lp_one_row[mask[1:2]], lp_packed[1:2][mask[1:2]], atol=1e-5, rtol=0)


def _assert_same_gradient_step(a, b) -> None:
    """Parameters after one SGD(lr=1) step from the same start: the same gradient up to float
    summation order. fp32 sums of O(100) terms differ by ~1e-7 relative; 1e-4 of the largest
    element's gradient (+1e-7 absolute) holds on any CPU and is far below a wrong weighting
    (which changes gradients by tens of percent)."""
    pa, pb = local_params(a.actor_module), local_params(b.actor_module)
    for name, value in pa.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(pb[name], value, atol=1e-7 + 1e-4 * scale, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_dynamic_bsz_matches_fixed_micro_batches(tiny_model_dir, single_rank_group):
    fixed = make_actor(tiny_model_dir, single_rank_group, sgd=True, grad_clip=None, loss_agg_mode="seq-mean-token-mean")
    dynamic = make_actor(tiny_model_dir, single_rank_group, sgd=True, grad_clip=None,
                         loss_agg_mode="seq-mean-token-mean", use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)
    data = make_ppo_batch(fixed.actor_module.config.vocab_size, batch_size=6, seed=2)
    lp_fixed, _ = fixed.compute_log_prob(with_meta(copy.copy(data)))
    lp_dynamic, _ = dynamic.compute_log_prob(with_meta(copy.copy(data), use_dynamic_bsz=True, max_token_len=20))
    # Same fp32 forward, rows grouped differently: rounding only (~1e-6 on log-probs of size < 10).
    torch.testing.assert_close(lp_dynamic, lp_fixed, atol=1e-5, rtol=0)

    data.batch[K.OLD_LOG_PROBS] = lp_fixed
    fixed.update_policy(with_meta(data))
    dynamic.update_policy(with_meta(data))
    _assert_same_gradient_step(fixed, dynamic)


def test_token_mean_over_uneven_micro_batches_is_the_mini_batch_token_mean(tiny_model_dir, single_rank_group):
    """Issue 13 item 7: micro-batches of very different token counts weigh their tokens, not their rows."""
    whole = make_actor(tiny_model_dir, single_rank_group, sgd=True, grad_clip=None, ppo_micro_batch_size=6)
    split = make_actor(tiny_model_dir, single_rank_group, sgd=True, grad_clip=None,
                       use_dynamic_bsz=True, ppo_max_token_len_per_gpu=14)
    data = make_ppo_batch(whole.actor_module.config.vocab_size, batch_size=6, prompt_len=8, response_len=6, seed=9)
    # Two long rows and four one-token responses: row shares and token shares differ a lot.
    data.batch[K.RESPONSE_MASK][:4, 1:] = 0
    data.batch[K.OLD_LOG_PROBS], _ = whole.compute_log_prob(with_meta(copy.copy(data), micro_batch_size=6))
    whole.update_policy(with_meta(data))
    split.update_policy(with_meta(data))
    _assert_same_gradient_step(whole, split)


def test_log_probs_are_computed_in_eval_mode_after_an_update(single_rank_group, tmp_path):
    """Issue 13 item 5: with dropout in the model, old log-probs must not be sampled through it."""
    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer()
    model = build_tiny_qwen2(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model.config.attention_dropout = 0.5
    path = save_model_and_tokenizer(model, tok, tmp_path / "dropout")
    actor = make_actor(str(path), single_rank_group)
    data = make_ppo_batch(len(tok), batch_size=6, seed=6)
    data.batch[K.OLD_LOG_PROBS], _ = actor.compute_log_prob(with_meta(copy.copy(data)))
    actor.update_policy(with_meta(data))
    first, _ = actor.compute_log_prob(with_meta(copy.copy(data)))
    second, _ = actor.compute_log_prob(with_meta(copy.copy(data)))
    assert torch.equal(first, second)


def test_each_update_shuffles_its_mini_batches_anew_and_reproducibly(tiny_model_dir, single_rank_group, randperms):
    """Issue 13 item 6: the shuffle seed changes with every update call, and runs repeat it."""
    perms = randperms

    def two_updates() -> list[list[int]]:
        perms.clear()
        actor = make_actor(tiny_model_dir, single_rank_group, shuffle=True, ppo_mini_batch_size=3, lr=1e-4)
        data = make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, seed=8)
        for _ in range(2):
            actor.update_policy(with_meta(copy.copy(data)))
        return list(perms)

    first_run = two_updates()
    assert len(first_run) == 2 and first_run[0] != first_run[1]
    assert two_updates() == first_run


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
    # The same fp32 forward and log-softmax, kernels possibly batched differently: ~1e-6 rounding.
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
        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, **kwargs):
            return inner(input_ids=input_ids, use_cache=False)  # plain causal mask over the whole pack

    leaky = IgnoresPositions()
    leaky.register_parameter("p", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="use_remove_padding=False"):
        check_packing_isolates_sequences(leaky, inner.config.vocab_size)


def test_the_packing_check_runs_the_boundaries_training_passes(tiny_model_dir, monkeypatch):
    """The actor and critic hand each packed forward its boundaries (packed_attention.boundary_kwargs) and the
    attention uses them rather than the position ids: the check must go through them too, so wrong ones
    (here one sequence over the whole pack) are refused."""
    from verl.utils import packed_attention
    from verl.utils.attention import attn_implementation
    from verl.utils.remove_padding import check_packing_isolates_sequences

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attn_implementation("cpu", True))
    check_packing_isolates_sequences(model, model.config.vocab_size)

    def one_sequence(position_ids):
        n = position_ids.shape[-1]
        whole = torch.tensor([0, n], dtype=torch.int32)
        return {"cu_seq_lens_q": whole, "cu_seq_lens_k": whole, "max_length_q": n, "max_length_k": n}

    monkeypatch.setattr(packed_attention, "boundary_kwargs", one_sequence)
    with pytest.raises(ValueError, match="attends across packed sequences"):
        check_packing_isolates_sequences(model, model.config.vocab_size)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_vocabulary_wide_work_sees_response_positions_only(tiny_model_dir, single_rank_group, remove_padding):
    """Issue 13 item 13: the lm_head (and log-softmax, entropy after it) runs on the positions that
    predict a response token, not on prompt or retrieved-passage positions."""
    actor = make_actor(tiny_model_dir, single_rank_group, remove_padding=remove_padding)
    data = with_meta(make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, prompt_len=8,
                                    response_len=6, seed=10), micro_batch_size=6)
    actor.compute_log_prob(data)   # the one-time packing self-check runs its own forwards first
    rows: list[tuple[int, ...]] = []
    head = actor.actor_module.lm_head
    handle = head.register_forward_hook(lambda mod, args, out: rows.append(tuple(args[0].shape[:-1])))
    try:
        actor.compute_log_prob(data, calculate_entropy=True)
    finally:
        handle.remove()
    mask = data.batch[K.ATTENTION_MASK]
    if remove_padding:
        # One packed row; only positions P-1 .. T-2 that hold a real token (<= B * R of them).
        predicting = mask[:, 8 - 1:-1]
        assert rows == [(1, int(predicting.sum()))]
        assert int(predicting.sum()) < int(mask.sum())
    else:
        assert rows == [(6, 6)]   # the R positions that predict a response token, no more


def test_packing_kernel_choice_per_device(monkeypatch):
    """Issue 35, pinned on CPU: packing loads the registered packed attention on every device;
    on CUDA it needs flash-attn only when packing_kernel=flash_attn asks for it, imported, not only
    found (a build for another torch fails only when loaded), and a torch with varlen_attn otherwise."""
    import sys
    from types import ModuleType

    import verl.utils.attention as attention
    from verl.utils.attention import PACKED_ATTENTION, PACKED_FLASH_ATTENTION, attn_implementation

    monkeypatch.setitem(sys.modules, "flash_attn", None)    # installed but not loadable
    assert attn_implementation("cuda", use_remove_padding=True) == PACKED_ATTENTION
    with pytest.raises(ValueError, match="needs a working flash-attn.*--no-build-isolation"):
        attn_implementation("cuda", use_remove_padding=True, packing_kernel="flash_attn")
    assert attn_implementation("cuda", use_remove_padding=False) is None
    assert attn_implementation("cpu", use_remove_padding=True) == PACKED_ATTENTION
    assert attn_implementation("cpu", use_remove_padding=True, packing_kernel="flash_attn") == PACKED_ATTENTION
    with pytest.raises(ValueError, match="packing_kernel='triton': expected one of"):
        attn_implementation("cpu", use_remove_padding=True, packing_kernel="triton")
    monkeypatch.setitem(sys.modules, "flash_attn", ModuleType("flash_attn"))
    assert attn_implementation("cuda", True, packing_kernel="flash_attn") == PACKED_FLASH_ATTENTION
    monkeypatch.setattr(attention, "has_varlen_attn", lambda: False)
    with pytest.raises(ValueError, match="no torch.nn.attention.varlen.varlen_attn"):
        attn_implementation("cuda", use_remove_padding=True)


def test_packing_check_holds_in_bf16_and_when_kernels_depend_on_shape(tiny_model_dir):
    """Issue 13 item 12: under bf16 on a GPU, different shapes take different kernels, so a packed
    forward and a lone one differ by more than any fixed tolerance. The check compares two
    forwards of the same shape instead; here a model whose logits shift with the input length
    (a stand-in for shape-dependent kernels) must pass, and it is run in bf16 as well."""
    from verl.utils.remove_padding import check_packing_isolates_sequences

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    check_packing_isolates_sequences(model, model.config.vocab_size)

    class ShapeDependentKernels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False, **kwargs):
            out = self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=use_cache, **kwargs)
            out.logits = out.logits + 0.05 * input_ids.shape[-1]   # rounding that depends on the shape
            return out

    check_packing_isolates_sequences(ShapeDependentKernels(), model.config.vocab_size)


def _tiny_qwen2(vocab_size: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _actor_saved_bytes_per_response_token(vocab_size: int, remove_padding: bool) -> float:
    from verl.utils.logprob_head import SavedTensorBytes

    module = _tiny_qwen2(vocab_size)
    actor = DataParallelPPOActor(actor_config(), module, None, use_remove_padding=remove_padding)
    # Ids below 4096: the same batch for every vocabulary size.
    micro = make_ppo_batch(4096, batch_size=4, prompt_len=8, response_len=6, seed=11).batch
    actor._packing_checked = True     # the packing self-check's forwards are not the head's
    response_mask = micro[K.RESPONSE_MASK].float()
    with SavedTensorBytes(exclude=module.parameters()) as saved:
        entropy, log_prob = actor._forward_micro_batch(micro, temperature=0.7, calculate_entropy=True)
        loss = ((log_prob - 0.01 * entropy) * response_mask).sum()
    loss.backward()
    assert module.lm_head.weight.grad is not None and torch.isfinite(module.lm_head.weight.grad).all()
    return saved.nbytes / micro[K.RESPONSES].numel()


@pytest.mark.parametrize("remove_padding", [True, False])
def test_autograd_memory_of_a_micro_batch_does_not_grow_with_the_vocabulary(remove_padding):
    """Issue 21 item 19: a training micro-batch (log-probs + entropy, then backward) saves the
    hidden states of the response positions for the head, not their (positions, V) logits and
    softmax. Measured per response token, V = 4096 vs 32768: previous head 30.0 vs 211.6 KB
    (packed) and 39.1 vs 268.5 KB (padded); fused head 4.1 vs 4.1 KB and 6.3 vs 6.3 KB."""
    small = _actor_saved_bytes_per_response_token(4096, remove_padding)
    large = _actor_saved_bytes_per_response_token(32768, remove_padding)
    assert abs(large - small) <= 16, (small, large)
    assert small < 4 * 4096, small     # the whole model's activations: far below one fp32 row of V


@pytest.mark.parametrize("remove_padding", [True, False])
def test_fused_head_under_fsdp2_matches_plain_logits_values_and_gradients(tiny_model_dir, single_rank_group,
                                                                          remove_padding):
    """The fused head runs inside the FSDP2 root's forward (unsharded, tied lm_head weight):
    log-probs, entropies and every parameter's gradient equal those of the plain full-logits
    log_softmax on an unwrapped copy of the model."""
    actor = make_actor(tiny_model_dir, single_rank_group, remove_padding=remove_padding)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    micro = make_ppo_batch(reference.config.vocab_size, batch_size=4, prompt_len=8, response_len=6, seed=12).batch
    responses = micro[K.RESPONSES]
    length = responses.shape[1]
    real = micro[K.ATTENTION_MASK][:, -length:].bool()
    g = torch.Generator().manual_seed(13)
    coef_lp, coef_ent = torch.randn(responses.shape, generator=g), torch.randn(responses.shape, generator=g)

    actor.actor_module.train()
    entropy, log_prob = actor._forward_micro_batch(micro, temperature=0.8, calculate_entropy=True)
    ((log_prob * coef_lp + entropy * coef_ent) * real).sum().backward()

    logits = reference(input_ids=micro[K.INPUT_IDS], attention_mask=micro[K.ATTENTION_MASK],
                       position_ids=micro[K.POSITION_IDS], use_cache=False).logits[:, -length - 1:-1] / 0.8
    log_softmax = torch.log_softmax(logits, dim=-1)
    ref_log_prob = log_softmax.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_log_prob * coef_lp + ref_entropy * coef_ent) * real).sum().backward()

    # fp32, packed or padded attention over <= 14 tokens: ~1e-6 rounding (see the tests above).
    torch.testing.assert_close(log_prob[real], ref_log_prob[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[real], ref_entropy[real], atol=1e-5, rtol=0)
    ref_grads = dict(reference.named_parameters())
    for name, param in actor.actor_module.named_parameters():
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        expected = ref_grads[name].grad
        torch.testing.assert_close(grad, expected, atol=1e-7 + 1e-4 * float(expected.abs().max()), rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _weighted_head_loss(micro, log_prob, entropy):
    real = micro[K.ATTENTION_MASK][:, -micro[K.RESPONSES].shape[1]:].float()
    return ((log_prob - 0.5 * entropy) * real).sum()


def _plain_log_probs(model, micro, temperature):
    """(entropy, log_prob) from the full logits and a textbook log_softmax: the reference."""
    length = micro[K.RESPONSES].shape[1]
    logits = model(input_ids=micro[K.INPUT_IDS], attention_mask=micro[K.ATTENTION_MASK],
                   position_ids=micro[K.POSITION_IDS], use_cache=False).logits[:, -length - 1:-1] / temperature
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    log_prob = log_softmax.gather(-1, micro[K.RESPONSES].unsqueeze(-1)).squeeze(-1)
    return -(log_softmax.exp() * log_softmax).sum(-1), log_prob


def _two_rank_fused_head_gradients(rank: int, port: int, model_dir: str, result_dir: str) -> None:
    import traceback

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        micros = [make_ppo_batch(vocab, batch_size=3, seed=20 + r).batch for r in range(2)]
        worst = {}
        for remove_padding in (False, True):
            module = apply_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                 init_device_mesh("cpu", (2,)))
            actor = DataParallelPPOActor(actor_config(), module, None, use_remove_padding=remove_padding)
            entropy, log_prob = actor._forward_micro_batch(micros[rank], 0.8, calculate_entropy=True)
            _weighted_head_loss(micros[rank], log_prob, entropy).backward()   # FSDP averages the 2 ranks
            grads = {n: p.grad.full_tensor() for n, p in module.named_parameters()}
            if rank == 0:
                reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                losses = [_weighted_head_loss(m, *reversed(_plain_log_probs(reference, m, 0.8))) for m in micros]
                (sum(losses) / 2).backward()
                worst[remove_padding] = max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
                                            for n, p in reference.named_parameters())
        if rank == 0:
            torch.save(worst, os.path.join(result_dir, "worst.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
def test_fused_head_gradients_are_exact_with_the_weights_sharded_over_two_ranks(tiny_model_dir, tmp_path):
    """Two gloo ranks, FSDP2 resharding after forward: the fused head reads the lm_head weight
    inside the root's forward, where it is unsharded, and its backward sees it gathered again.
    The averaged gradients equal the plain path's on an unwrapped model (measured: 5e-7 of the
    largest element; a head reading a shard would fail outright or be off by O(1))."""

    port = free_port()
    run_ranks(_two_rank_fused_head_gradients, lambda r: (r, port, tiny_model_dir, str(tmp_path)), tmp_path)
    worst = torch.load(tmp_path / "worst.pt")
    assert set(worst) == {False, True}
    assert max(worst.values()) < 1e-4, worst


def test_fused_head_under_bf16_mixed_precision_stays_close_to_fp32(tiny_model_dir, single_rank_group):
    """FSDP2 with the GPU mixed-precision policy (bf16 parameters and activations in forward):
    the head gets bf16 hidden states and a bf16 weight, returns fp32 log-probs, and the
    gradients stay within bf16 rounding (~1%) of the fp32 ones, not O(1) away."""
    from verl.utils.fsdp_utils import gpu_mixed_precision

    results = {}
    for mixed in (False, True):
        module = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        module = apply_fsdp2(module, single_rank_group, gpu_mixed_precision() if mixed else None)
        actor = DataParallelPPOActor(actor_config(), module, None, use_remove_padding=False)
        micro = make_ppo_batch(module.config.vocab_size, batch_size=4, seed=14).batch
        entropy, log_prob = actor._forward_micro_batch(micro, 0.8, calculate_entropy=True)
        assert log_prob.dtype == entropy.dtype == torch.float32
        _weighted_head_loss(micro, log_prob, entropy).backward()
        results[mixed] = log_prob.detach(), {n: p.grad.to_local() for n, p in module.named_parameters()}
    (lp32, grads32), (lp16, grads16) = results[False], results[True]
    torch.testing.assert_close(lp16, lp32, atol=0.02, rtol=0.01)
    for name, grad in grads32.items():
        error = float((grads16[name].float() - grad).norm() / grad.norm())
        assert error < 0.05, (name, error)


def test_rollout_is_weights_in_the_batch_weight_the_policy_loss(tiny_model_dir, single_rank_group):
    # algorithm.rollout_correction puts rollout_is_weights in the batch: the actor multiplies each
    # token's policy loss by its weight (all 2: twice the loss; all 1: the loss without weights).
    data = make_ppo_batch(make_actor(tiny_model_dir, single_rank_group).actor_module.config.vocab_size,
                          batch_size=6, seed=11)
    losses = {}
    for name, scale in (("none", None), ("ones", 1.0), ("twos", 2.0)):
        actor = make_actor(tiny_model_dir, single_rank_group)
        batch = copy.deepcopy(data)
        batch.batch[K.OLD_LOG_PROBS], _ = actor.compute_log_prob(with_meta(copy.copy(batch)))
        if scale is not None:
            batch.batch[K.ROLLOUT_IS_WEIGHTS] = torch.full_like(batch.batch[K.OLD_LOG_PROBS], scale)
        losses[name] = actor.update_policy(with_meta(batch))["actor/pg_loss"][0]
    assert losses["ones"] == pytest.approx(losses["none"], rel=1e-5, abs=1e-7)
    assert losses["twos"] == pytest.approx(2 * losses["none"], rel=1e-5, abs=1e-7)
    assert abs(losses["none"]) > 1e-6


@pytest.mark.parametrize("remove_padding", [True, False])
def test_sum_pi_squared_is_the_full_softmax_squared_at_each_response_token(tiny_model_dir, single_rank_group,
                                                                          remove_padding):
    """actor.calculate_sum_pi_squared (the optimal token baseline's statistic): the old-log-prob pass
    gives sum_v pi(v)^2 at each response token, from the same forward as its log-probs, equal to the
    unpacked model's full softmax at temperature T."""
    actor = make_actor(tiny_model_dir, single_rank_group, remove_padding=remove_padding)
    data = with_meta(make_ppo_batch(actor.actor_module.config.vocab_size, batch_size=6, prompt_len=8,
                                    response_len=6, seed=11), micro_batch_size=4, temperature=0.8)
    out = actor.compute_log_prob_outputs(copy.copy(data), calculate_sum_pi_squared=True)
    log_probs, _ = actor.compute_log_prob(copy.copy(data))
    torch.testing.assert_close(out.log_probs, log_probs, atol=1e-6, rtol=0)
    assert out.entropy is None and out.sum_pi_squared.shape == log_probs.shape
    mask, ids = data.batch[K.ATTENTION_MASK], data.batch[K.INPUT_IDS]
    with torch.no_grad():
        logits = actor.actor_module(input_ids=ids, attention_mask=mask,
                                    position_ids=data.batch[K.POSITION_IDS]).logits[:, 8 - 1:-1].float()
    probs = torch.softmax(logits / 0.8, dim=-1)
    response_mask = mask[:, 8:].bool()
    expected = (probs * probs).sum(-1)
    torch.testing.assert_close(out.sum_pi_squared[response_mask], expected[response_mask], atol=1e-5, rtol=1e-5)
    assert bool(((out.sum_pi_squared > 0) & (out.sum_pi_squared <= 1 + 1e-6))[response_mask].all())
