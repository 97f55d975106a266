"""Ulysses sequence parallelism (verl/utils/ulysses.py, issue 35 item 2): two gloo ranks run packed rows
split in halves, with the heads swapped around attention, and get the SP=1 log-probs and gradients
(GQA model: 4 heads, 2 key/value heads; a row whose length needs padding to the SP size), directly
on the model and through DataParallelPPOActor / DataParallelPPOCritic(sp_group=...), with gradient
checkpointing on as well as off."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.conftest import run_ranks
from tests.workers._batches import free_port
from verl.utils import ulysses


def test_heads_must_divide_by_the_sp_size_and_kv_heads_divide_it_or_by_it():
    ulysses.check_heads(4, 2, 2)
    ulysses.check_heads(4, 2, 4)      # 2 key/value heads repeated twice
    ulysses.check_heads(64, 8, 16)    # Qwen2.5-72B at SP=16: each key/value head twice
    ulysses.check_heads(40, 8, 8)     # Qwen2.5-32B at SP=8: no repeat
    for heads, kv_heads, size in [(28, 4, 8), (6, 4, 3), (12, 8, 12)]:
        with pytest.raises(ValueError, match=rf"ulysses_sequence_parallel_size={size} does not fit the model's "
                                             rf"attention heads \({heads}\) and key/value heads \({kv_heads}\)"):
            ulysses.check_heads(heads, kv_heads, size)
    with pytest.raises(ValueError, match="critic.ulysses_sequence_parallel_size=0: must be >= 1"):
        ulysses.check_heads(4, 2, 0, key="critic.ulysses_sequence_parallel_size")


def test_padding_to_the_sp_size_is_a_sequence_of_its_own():
    padded, pad = ulysses.padded_position_ids(torch.tensor([[0, 1, 2, 0, 1]]), 4)
    assert pad == 3 and padded.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    same, pad = ulysses.padded_position_ids(torch.tensor([[0, 1, 0, 1]]), 2)
    assert pad == 0 and same.tolist() == [[0, 1, 0, 1]]


def _model(kv_heads: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils.attention import PACKED_ATTENTION, attn_implementation

    attn_implementation("cpu", True)   # registers the packed attention
    config = Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)
    config._attn_implementation = PACKED_ATTENTION
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _packed_row():
    """Three sequences of 7, 12 and 6 tokens (25: odd, so SP=2 pads one token)."""
    g = torch.Generator().manual_seed(3)
    lengths = [7, 12, 6]
    ids = torch.randint(1, 101, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    weights = torch.randn(sum(lengths), generator=g)
    return ids, positions, weights


def _token_log_probs(logits_1nV: torch.Tensor, labels_n: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits_1nV[0].float(), dim=-1).gather(-1, labels_n[:, None]).squeeze(-1)


def _reference(ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               kv_heads: int = 2) -> tuple[torch.nn.Module, torch.Tensor]:
    """SP=1: the whole row on this rank; (the model with its gradients, the log-probs)."""
    reference = _model(kv_heads)
    logp_ref = _token_log_probs(reference(input_ids=ids, position_ids=positions, attention_mask=None,
                                          use_cache=False).logits, labels)
    (logp_ref * weights).sum().backward()
    return reference, logp_ref


def _check_core(rank: int) -> None:
    ids, positions, weights = _packed_row()
    labels = torch.roll(ids[0], -1)
    reference, logp_ref = _reference(ids, positions, labels, weights)
    # SP=2: my half, the heads swapped around attention.
    _check_sp_model(rank, _model(), ids, positions, labels, weights, logp_ref, reference)
    # With gradient checkpointing (reentrant here; the actor below runs the workers' non-reentrant):
    # the layers recomputed in the backward must run the all-to-alls too.
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    _check_sp_model(rank, model, ids, positions, labels, weights, logp_ref, reference)
    # Fewer key/value heads than SP ranks (4 heads, 1 key/value head, SP=2): the key/value head is
    # repeated before the all-to-all, each rank attending its 2 query heads with its copy.
    reference, logp_ref = _reference(ids, positions, labels, weights, kv_heads=1)
    _check_sp_model(rank, _model(kv_heads=1), ids, positions, labels, weights, logp_ref, reference)


def _check_sp_model(rank: int, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                    labels: torch.Tensor, weights: torch.Tensor, logp_ref: torch.Tensor,
                    reference: torch.nn.Module) -> None:
    n = ids.shape[1]
    group = dist.group.WORLD
    with ulysses.sequence_parallel(group, positions) as state:
        ids_local, pos_local, pad = ulysses.slice_packed(ids, positions, group)
        logits = model(input_ids=ids_local, position_ids=pos_local, attention_mask=None, use_cache=False).logits
    labels_padded = torch.cat([labels, labels.new_zeros(pad)])
    chunk = ids_local.shape[1]
    local_logp = _token_log_probs(logits, labels_padded[rank * chunk:(rank + 1) * chunk])
    logp = ulysses.gather_tokens(local_logp, group)[:n]
    with ulysses.resumed(state):
        (logp * weights).sum().backward()     # the same loss on both ranks
    # fp32, the same sums in another order: ~1e-6; 1e-5 holds on any CPU, a token attending
    # across a boundary or a head mixed up moves log-probs by > 1e-2.
    torch.testing.assert_close(logp, logp_ref.detach(), atol=1e-5, rtol=0)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= 2                          # FSDP's mean over the ranks
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(grad, ref.grad, atol=1e-6 + 1e-4 * scale, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _check_actor(rank: int, model_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from tests.workers._batches import make_ppo_batch
    from tests.workers.test_packed_equality import _config, meta
    from verl.utils import batch_keys as K
    from verl.utils.attention import attn_implementation
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    attn = attn_implementation("cpu", True)

    def actor(sp: bool, checkpointing: bool = False) -> DataParallelPPOActor:
        module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
        if checkpointing:   # as the workers enable it, before FSDP2 wraps the model
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if sp:
            module = apply_fsdp2(module, init_device_mesh("cpu", (2,)))   # FSDP's mean over the SP ranks
        return DataParallelPPOActor(_config(ppo_micro_batch_size=3), module,
                                    torch.optim.SGD(module.parameters(), lr=1.0), use_remove_padding=True,
                                    sp_group=dist.group.WORLD if sp else None)

    plain, sp, sp_gc = actor(False), actor(True), actor(True, checkpointing=True)
    # The same batch on both ranks (an SP group's ranks share their rows); 6 rows, 3 per micro-batch.
    data = meta(make_ppo_batch(plain.actor_module.config.vocab_size, batch_size=6, prompt_len=8,
                               response_len=10, seed=5), dynamic=False)
    lp_plain, ent_plain = plain.compute_log_prob(copy.copy(data), calculate_entropy=True)
    lp_sp, ent_sp = sp.compute_log_prob(copy.copy(data), calculate_entropy=True)
    real = data.batch[K.ATTENTION_MASK][:, -10:].bool()
    torch.testing.assert_close(lp_sp[real], lp_plain[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_sp[real], ent_plain[real], atol=1e-5, rtol=0)
    data.batch[K.OLD_LOG_PROBS] = lp_plain + 0.05 * torch.randn(lp_plain.shape, generator=torch.Generator().manual_seed(0))
    plain.update_policy(copy.copy(data))
    for split in (sp, sp_gc):
        split.update_policy(copy.copy(data))
        for (name, p), ref in zip(split.actor_module.named_parameters(), plain.actor_module.parameters()):
            value = p.detach().full_tensor()
            scale = float(ref.detach().abs().max())
            torch.testing.assert_close(value, ref.detach(), atol=1e-7 + 1e-4 * scale, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")


def _check_critic(rank: int, model_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from tests.workers._batches import make_ppo_batch
    from tests.workers.test_packed_equality import _config, meta
    from verl.utils import batch_keys as K
    from verl.utils.attention import attn_implementation
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl.utils.model import load_value_model
    from verl.workers.critic.dp_critic import DataParallelPPOCritic


    def critic(sp: bool) -> DataParallelPPOCritic:
        torch.manual_seed(0)   # the value head is initialised fresh: the same in both copies
        module = load_value_model(model_dir, attn_implementation=attn_implementation("cpu", True),
                                  use_remove_padding=True)
        if sp:   # with gradient checkpointing too (the actor checks SP with and without it)
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            module = apply_fsdp2(module, init_device_mesh("cpu", (2,)))
        return DataParallelPPOCritic(_config(ppo_micro_batch_size=3), module,
                                     torch.optim.SGD(module.parameters(), lr=1.0), use_remove_padding=True,
                                     sp_group=dist.group.WORLD if sp else None)

    plain, sp = critic(False), critic(True)
    data = meta(make_ppo_batch(plain.critic_module.config.vocab_size, batch_size=6, prompt_len=8,
                               response_len=10, seed=6), dynamic=False)
    values = plain.compute_values(copy.copy(data))
    torch.testing.assert_close(sp.compute_values(copy.copy(data)), values, atol=1e-5, rtol=0)
    data.batch[K.VALUES] = values
    plain.update_critic(copy.copy(data))
    sp.update_critic(copy.copy(data))
    for (name, p), ref in zip(sp.critic_module.named_parameters(), plain.critic_module.parameters()):
        scale = float(ref.detach().abs().max())
        torch.testing.assert_close(p.detach().full_tensor(), ref.detach(), atol=1e-7 + 1e-4 * scale, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _two_rank_sp(rank: int, port: int, model_dir: str, result_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        _check_core(rank)
        _check_actor(rank, model_dir)
        _check_critic(rank, model_dir)
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_the_row_boundaries_are_derived_once_for_every_layer_and_the_recompute(monkeypatch):
    """Under SP the packed row is fixed for the whole forward: its cu_seqlens (two host syncs) are derived
    on the first layer's call and reused by the other layers and by gradient checkpointing's recompute."""
    from verl.utils import packed_attention as pa

    created = not dist.is_initialized()
    if created:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        model = _model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids, positions, _ = _packed_row()
        calls = []
        derive = pa.cu_seqlens_from_position_ids
        monkeypatch.setattr(pa, "cu_seqlens_from_position_ids", lambda p: calls.append(1) or derive(p))
        with ulysses.sequence_parallel(group, positions) as state:
            ids_1n, pos_1n, _ = ulysses.slice_packed(ids, positions, group)
            logits = model(input_ids=ids_1n, position_ids=pos_1n).logits
        with ulysses.resumed(state):
            logits.float().square().mean().backward()
        assert len(calls) == 1 and state.boundaries[1] == 12     # two layers, forward and recompute
        assert all(p.grad is not None for p in model.parameters())
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_sp_equals_sp1_for_the_model_the_actor_and_the_critic(tiny_model_dir, tmp_path):
    """One spawn of two gloo ranks (SP group = both; ~100 s here, mostly start-up), three checks:
    the model's log-probs and gradients on one packed row, without and with (reentrant) gradient
    checkpointing; DataParallelPPOActor(sp_group) under FSDP2
    against the same actor unsplit (log-probs, entropies, the weights after one SGD(lr=1) step, i.e.
    the gradients), a second SP actor with non-reentrant gradient checkpointing likewise;
    DataParallelPPOCritic(sp_group, gradient checkpointing on) likewise (values, the SGD step)."""
    port = free_port()
    run_ranks(_two_rank_sp, lambda r: (r, port, tiny_model_dir, str(tmp_path)), tmp_path, timeout=300)
