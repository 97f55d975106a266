"""FSDP workers on a real 2-worker Ray group (CPU, gloo): generate, score, update, offload, critic."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers._batches import load_trainer_config, make_ppo_batch
from verl.protocol import DataProto
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from verl.utils import batch_keys as K
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker, normalize_actor_batch_sizes

torch.set_num_threads(1)


def trainer_config(model_dir: str, offload: bool = False):
    cfg = load_trainer_config(model_dir, **{
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.optim.lr": 3e-3,
        "actor_rollout_ref.actor.optim.total_training_steps": 20,
        "actor_rollout_ref.model.use_remove_padding": True,
        # Recomputing activations must not change a number either: exercised with the offload run.
        "actor_rollout_ref.model.enable_gradient_checkpointing": offload,
        "actor_rollout_ref.actor.fsdp_config.param_offload": offload,
        "actor_rollout_ref.actor.fsdp_config.grad_offload": offload,
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload": offload,
        "actor_rollout_ref.ref.fsdp_config.param_offload": offload,
        "actor_rollout_ref.ref.log_prob_micro_batch_size": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4,
        "actor_rollout_ref.rollout.micro_batch_size": 2,
        "data.max_response_length": 6,
        "critic.ppo_mini_batch_size": 8,
        "critic.ppo_micro_batch_size": 4,
        "critic.optim.lr": 1e-2,
        "critic.optim.total_training_steps": 20,
    })
    OmegaConf.resolve(cfg)
    return cfg


def make_group(worker_cls, workers: int = 2, **init_kwargs) -> tuple[RayWorkerGroup, RayResourcePool]:
    pool = RayResourcePool([workers], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(worker_cls, **init_kwargs))
    wg.init_model()
    return wg, pool


def close_group(wg: RayWorkerGroup, pool: RayResourcePool) -> None:
    wg.shutdown()
    pool.release()


def fixed_batch(model_dir: str) -> DataProto:
    vocab = AutoTokenizer.from_pretrained(model_dir).__len__()
    data = make_ppo_batch(vocab, batch_size=8, response_len=6, seed=7)
    data.batch[K.ADVANTAGES] = torch.ones_like(data.batch[K.ADVANTAGES])  # reinforce every sampled token
    return data


def test_batch_sizes_are_normalised_per_worker_and_checked(tiny_model_dir):
    cfg = trainer_config(tiny_model_dir)
    cfg.actor_rollout_ref.rollout.n = 3   # veRL's rollout.n scales the mini-batch (n_agent does not)
    normalize_actor_batch_sizes(cfg.actor_rollout_ref, "actor_rollout_ref", world_size=4)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8 * 3 // 4
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size == 1
    bad = trainer_config(tiny_model_dir)
    bad.actor_rollout_ref.actor.ppo_micro_batch_size = 6
    with pytest.raises(ValueError, match="actor.ppo_micro_batch_size=6"):
        normalize_actor_batch_sizes(bad.actor_rollout_ref, "actor", world_size=4)


def test_two_rank_actor_generates_scores_and_learns(tiny_model_dir, ray_cluster):
    cfg = trainer_config(tiny_model_dir)
    wg, pool = make_group(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor_rollout_ref")
    offload_wg = offload_pool = None
    try:
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        enc = tok(["Paris", "Question: where", "The quick brown fox", "Doc 1"], return_tensors="pt", padding=True)
        prompts = DataProto.from_dict(tensors={
            K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: enc["attention_mask"],
            K.POSITION_IDS: (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)},
            meta_info={K.META_DO_SAMPLE: False})
        info = wg.get_model_flops_info()[0]
        assert info.num_layers == 2 and info.num_params > 0
        generated = wg.generate_sequences(prompts)
        assert generated.batch[K.RESPONSES].shape == (4, 6)
        old = wg.compute_log_prob(generated).batch[K.OLD_LOG_PROBS]
        ref = wg.compute_ref_log_prob(generated).batch[K.REF_LOG_PROB]
        # Before any update the policy is the reference: same weights, kernels and CPU in one
        # process, so assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5) are ample.
        torch.testing.assert_close(old, ref)
        mask = generated.batch[K.ATTENTION_MASK][:, -6:].bool()
        # Greedy tokens are the most likely ones: log-probs are finite and no lower than log(1/V).
        assert bool((old[mask] > -torch.log(torch.tensor(float(len(tok))))).all())

        data = fixed_batch(tiny_model_dir)
        data.batch[K.OLD_LOG_PROBS] = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        first_old_log_probs = data.batch[K.OLD_LOG_PROBS]
        before = wg.get_state_fingerprint()
        metrics = [wg.update_actor(data).meta_info[K.META_METRICS]]
        after_one = wg.get_state_fingerprint()
        assert after_one[0] == after_one[1], "ranks disagree on the weights after an update"
        assert after_one[0] != before[0]

        # The data-parallel update equals one single-process update on the whole batch.
        single_cfg = copy.deepcopy(cfg.actor_rollout_ref.actor)
        single_cfg.ppo_mini_batch_size, single_cfg.ppo_micro_batch_size = 8, 2
        module = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01)
        single = DataParallelPPOActor(single_cfg, module, optimizer)
        single.update_policy(DataProto(batch=data.batch, meta_info={K.META_TEMPERATURE: 1.0}))
        # Adam's first step moves each element by ~lr = 3e-3 (sign of its gradient). DP and single
        # process sum the gradient in different orders (~1e-6 relative), which flips only elements
        # whose gradient is ~0: a handful, each by < 2*lr, so the sums agree within ~1e-5 typically;
        # 1e-3 is one third of one lr-sized flip, and a wrong shard or data split moves a sum by >> lr.
        for name, p in module.named_parameters():
            assert abs(float(p.detach().double().sum()) - after_one[0][name]) < 1e-3, name

        # On-policy PPO with every advantage +1: the sampled tokens' NLL must fall.
        rmask = data.batch[K.RESPONSE_MASK].bool()
        nll = [-float(data.batch[K.OLD_LOG_PROBS][rmask].mean())]
        for _ in range(19):
            data.batch[K.OLD_LOG_PROBS] = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
            nll.append(-float(data.batch[K.OLD_LOG_PROBS][rmask].mean()))
            metrics.append(wg.update_actor(data).meta_info[K.META_METRICS])
        assert nll[-1] < nll[0] - 1.0, nll
        assert all(x > y for x, y in zip(nll[:-1], nll[1:], strict=True)), nll
        assert all(set(m["actor/grad_nonfinite"]) == {0.0} for m in metrics)  # one entry per rank
        data.batch[K.OLD_LOG_PROBS] = first_old_log_probs
        close_group(wg, pool)
        wg = None

        # Offloading params, grads and optimizer state between calls (and gradient
        # checkpointing) changes no number.
        offload_wg, offload_pool = make_group(ActorRolloutRefWorker, config=trainer_config(tiny_model_dir, True).actor_rollout_ref,
                                              role="actor_rollout_ref")
        offload_metrics = [offload_wg.update_actor(data).meta_info[K.META_METRICS] for _ in range(1)]
        # Exact equality on purpose: same CPU, same kernels, same order; offloading only moves memory.
        assert offload_metrics[0]["actor/pg_loss"] == metrics[0]["actor/pg_loss"]
        assert offload_metrics[0]["actor/grad_norm"] == metrics[0]["actor/grad_norm"]
        assert offload_wg.get_state_fingerprint()[0] == after_one[0]
        ref_after = offload_wg.compute_ref_log_prob(data).batch[K.REF_LOG_PROB]
        # The reference stays frozen: same weights, kernels and CPU, so fp32 defaults are ample.
        torch.testing.assert_close(ref_after, data.batch[K.OLD_LOG_PROBS])
    finally:
        if wg is not None:
            close_group(wg, pool)
        if offload_wg is not None:
            close_group(offload_wg, offload_pool)


def test_colocated_critic_fits_returns_beside_the_actor(tiny_model_dir, ray_cluster):
    """The trainer's layout: actor+rollout and critic share each worker process (one process group)."""
    cfg = trainer_config(tiny_model_dir)
    class_dict = {"actor_rollout": RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                        role="actor_rollout"),
                  "critic": RayClassWithInitArgs(CriticWorker, config=cfg.critic)}
    pool = RayResourcePool([2], use_gpu=False)
    wg_dict = RayWorkerGroup(pool, create_colocated_worker_cls(class_dict))
    try:
        spawned = wg_dict.spawn(prefix_set=class_dict.keys())
        critic_wg, actor_wg = spawned["critic"], spawned["actor_rollout"]
        critic_wg.init_model()
        actor_wg.init_model()
        data = fixed_batch(tiny_model_dir)
        data.batch[K.RETURNS] = torch.full_like(data.batch[K.RETURNS], 0.5)
        values = critic_wg.compute_values(data).batch[K.VALUES]
        assert values.shape == (8, 6)
        assert bool((values[data.batch[K.ATTENTION_MASK][:, -6:] == 0] == 0).all())
        losses = []
        for _ in range(8):
            data.batch[K.VALUES] = critic_wg.compute_values(data).batch[K.VALUES]
            losses.append(critic_wg.update_critic(data).meta_info[K.META_METRICS]["critic/vf_loss"][0])
        assert losses[-1] < losses[0] * 0.5, losses
        assert actor_wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS].shape == (8, 6)
    finally:
        wg_dict.shutdown()
        pool.release()


@pytest.mark.parametrize(("device", "dtype"), [("cuda", torch.bfloat16), ("cpu", torch.float32)])
def test_the_reference_is_built_in_bf16_on_gpus_and_fp32_on_cpu(tiny_model_dir, device, dtype):
    """What the worker hands its sharded loader for the reference, on the meta device (no GPU needed):
    on CUDA the parameters in bf16, the dtype FSDP2 computes in (not an fp32 copy of weights nobody
    trains), the rotary buffers still fp32; frozen either way."""
    from types import SimpleNamespace

    from verl.utils.sharded_init import parameters_on_meta

    built = {}

    def load_sharded(build, model_cfg, trainable):
        with parameters_on_meta():
            built["module"] = build()
        built["trainable"] = trainable
        return built["module"]

    worker = SimpleNamespace(device=device, _load_sharded=load_sharded)
    model_cfg = OmegaConf.create({"path": tiny_model_dir})
    ref = ActorRolloutRefWorker._build_reference(worker, model_cfg, None, False)
    assert ref is built["module"] and built["trainable"] is False
    assert {p.dtype for p in ref.parameters()} == {dtype}
    assert {p.device.type for p in ref.parameters()} == {"meta"}
    assert {b.dtype for b in ref.buffers()} == {torch.float32}


def test_the_bf16_reference_gives_the_fp32_actors_logits_under_the_gpu_precision_policy(tiny_model_dir):
    """The contract the bf16 reference rests on: on CUDA FSDP2 computes the fp32 actor in
    gpu_mixed_precision's param_dtype, and the reference is stored in exactly that dtype, so at step 0
    its logits (hence ref_log_prob, the KL) are the actor's bit for bit. Run here with the GPU policy
    on a CPU gloo mesh; the reference goes through _build_reference as a CUDA worker builds it."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.conftest import free_port
    from verl.utils.fsdp_utils import gpu_mixed_precision
    from verl.utils.model import build_causal_lm, frozen_weight_dtype
    from verl.utils.sharded_init import load_sharded_model

    policy = gpu_mixed_precision()
    assert frozen_weight_dtype("cuda") == policy.param_dtype
    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def load_sharded(build, model_cfg, trainable):
            module, _ = load_sharded_model(build, model_cfg.path, mesh, "cpu", prepare=lambda m: m.requires_grad_(False),
                                           mixed_precision=policy)
            return module

        ref = ActorRolloutRefWorker._build_reference(SimpleNamespace(device="cuda", _load_sharded=load_sharded),
                                                     OmegaConf.create({"path": tiny_model_dir}), None, False)
        actor = load_sharded(lambda: build_causal_lm(tiny_model_dir), OmegaConf.create({"path": tiny_model_dir}), True)
        assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in actor.parameters()} == {torch.float32}
        ids = torch.randint(0, AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size, (2, 12),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(ref(ids).logits, actor(ids).logits)   # same bf16 values, same kernels: exact
    finally:
        if created:
            dist.destroy_process_group()
