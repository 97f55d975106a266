"""verl/utils/memory_plan.py: the plan's certain bytes are the real tensors' sizes, the shipped
model configs have their public parameter counts, and 72B on one 80 GB GPU does not fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from verl.trainer.main_ppo import compose_config
from verl.utils.memory_plan import GIB, ModelShape, adamw_state_bytes, plan_memory, read_model_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "example" / "model_configs"
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32"}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tie", [False, True])
def test_certain_bytes_equal_the_actor_and_adamw_tensors_of_a_tiny_qwen2(tmp_path: Path, tie: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.utils import fsdp_utils
    from verl.utils.model import load_causal_lm, load_value_model

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**{**TINY, "tie_word_embeddings": tie})).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    shape = ModelShape.from_config(config)
    # the workers' own loaders and optimizer builder (fp32 on CPU), one step so AdamW has its state
    for model, (params, tensors) in ((load_causal_lm(str(tmp_path)), shape.causal_lm()),
                                     (load_value_model(str(tmp_path)), shape.value_model())):
        optim = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.01})
        optimizer, _ = fsdp_utils.build_optimizer(model, optim)
        model(input_ids=torch.tensor([[1, 2, 3]])).logits.float().sum().backward()
        optimizer.step()
        real = list(model.parameters())
        assert (params, tensors) == (sum(p.numel() for p in real), len(real))
        assert 4 * params == _tensor_bytes(real)                                   # fp32 parameters
        assert 4 * params == _tensor_bytes(p.grad for p in real)                   # fp32 gradients
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        assert adamw_state_bytes(params, tensors) == _tensor_bytes(state)


def test_shipped_configs_have_the_public_parameter_counts() -> None:
    expected = {"qwen2.5-3b": 3.09, "qwen2.5-3b-instruct": 3.09, "qwen2.5-7b": 7.62, "qwen2.5-7b-instruct": 7.62,
                "qwen2.5-32b": 32.76, "qwen2.5-72b": 72.71,
                # Qwen3 (issue 47; tests/utils/test_memory_plan_moe.py counts them against transformers too)
                "qwen3-4b": 4.02, "qwen3-8b": 8.19, "qwen3-32b": 32.76, "qwen3-30b-a3b": 30.53}
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted(expected)
    for name, billions in expected.items():
        config, where = read_model_config(str(CONFIGS / name))
        architecture = {"qwen2.5": "Qwen2ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}.get(
            name if name.endswith("a3b") else name.split("-")[0], "Qwen3ForCausalLM")
        assert config["architectures"] == [architecture] and config["torch_dtype"] == "bfloat16", where
        assert round(ModelShape.from_config(config).causal_lm()[0] / 1e9, 2) == billions, name


def test_72b_on_one_80gb_gpu_without_offload_does_not_fit_and_7b_on_eight_does() -> None:
    big = compose_config([f"actor_rollout_ref.model.path={CONFIGS / 'qwen2.5-72b'}", "algorithm.adv_estimator=grpo",
                          "trainer.n_gpus_per_node=1", "data.train_batch_size=8",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=8", "do_search=false"])
    OmegaConf.resolve(big)
    plan = plan_memory(big, device_gib=80)
    name, gib = plan.largest()
    assert name == "actor_update" and gib > 80
    # fp32 params + grads + AdamW alone: 16 bytes per parameter on the one GPU; 8 rows of activations
    # without checkpointing make the backward the larger of the update's two peaks
    update = next(p for p in plan.phases if p.name == "actor_update")
    assert update.binding == "backward" and update.certain == update.moments["backward"].certain
    assert update.certain["actor params (fp32 shard)"] == 4 * plan.actor_params
    assert update.certain["actor AdamW state (shard)"] == adamw_state_bytes(plan.actor_params, plan.actor_tensors)
    assert "activations" in update.estimated
    # with gradient checkpointing the optimizer step binds: params, grads, AdamW and foreach AdamW's fp32
    # temporary, 20 bytes per parameter, beside the reference's bf16 copy (2 bytes: it is built in the dtype
    # it computes in, verl/utils/model.py frozen_weight_dtype)
    checkpointed = copy.deepcopy(big)
    checkpointed.actor_rollout_ref.model.enable_gradient_checkpointing = True
    update = next(p for p in plan_memory(checkpointed).phases if p.name == "actor_update")
    assert update.binding == "optimizer step" and not update.estimated
    assert update.certain["reference params (bf16 shard)"] == 2 * plan.actor_params
    assert update.total == 22 * plan.actor_params + 4 * plan.actor_tensors
    assert update.total > update.moments["backward"].total

    small = compose_config([f"actor_rollout_ref.model.path={CONFIGS / 'qwen2.5-7b'}",
                            f"critic.model.path={CONFIGS / 'qwen2.5-7b'}", "trainer.n_gpus_per_node=8",
                            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    OmegaConf.resolve(small)
    plan = plan_memory(small, device_gib=80)
    assert plan.largest()[1] < 80
    update = next(p for p in plan.phases if p.name == "actor_update")
    assert update.certain["actor params (fp32 shard)"] == -(-4 * plan.actor_params // 8)   # sharded over 8
    assert max(plan.phase_gib().values()) * GIB >= update.total - GIB


def _pipelined_7b(*extra: str):
    cfg = compose_config([f"actor_rollout_ref.model.path={CONFIGS / 'qwen2.5-7b'}", "algorithm.adv_estimator=grpo",
                          "trainer.n_gpus_per_node=8", "trainer.pipeline=one_step_off", "trainer.rollout_pool=2",
                          "data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
                          "actor_rollout_ref.rollout.n_agent=1", "do_search=false", *extra])
    OmegaConf.resolve(cfg)
    return plan_memory(cfg, device_gib=80)


def test_a_pipelined_run_plans_the_rollout_pools_gpu_and_the_weight_sync_buffers() -> None:
    # 7B on 8 GPUs, 2 of them the rollout pool: the engine (vLLM's pool) is there, beside one full tensor
    # arriving in the engine's dtype (bf16); no FSDP copy of the policy; the train GPUs have no engine.
    plan = _pipelined_7b()
    phases = {p.name: p for p in plan.phases}
    assert "rollout" not in phases and plan.world == 6
    pool = phases["rollout_pool"].certain
    shape = ModelShape.from_config(read_model_config(str(CONFIGS / "qwen2.5-7b"))[0], "qwen2.5-7b")
    embeddings_bf16 = 2 * shape.vocab_size * shape.hidden_size
    assert pool == {"weight-sync receive buffer (largest full tensor, bf16)": embeddings_bf16,
                    "vLLM's rebuilt layer shard during a push (largest tensor / TP)": embeddings_bf16,
                    "vLLM pool (gpu_memory_utilization=0.5 x 80 GiB)": int(0.5 * 80 * GIB)}
    send = phases["weight_sync_send"].certain
    assert send["actor params (fp32 shard)"] == -(-4 * plan.actor_params // 6)   # the train pool's shard
    assert send["weight-sync send buffer (largest full tensor, bf16)"] == embeddings_bf16
    # each of the 6 train ranks casts its shard before the all-gather
    assert send["weight-sync shard cast to bf16 (largest tensor / train ranks)"] == -(-embeddings_bf16 // 6)
    # 40 GiB of vLLM pool + the received tensor and vLLM's rebuilt copy of it (TP=1): 2 x 1.1 GB
    assert phases["rollout_pool"].total / GIB == pytest.approx(42.02, abs=0.05)
    # the HF engine on the rollout pool: one unsharded bf16 copy of the policy instead of vLLM's pool
    hf = {p.name: p for p in _pipelined_7b("actor_rollout_ref.rollout.name=hf").phases}["rollout_pool"].certain
    assert hf == {"weight-sync receive buffer (largest full tensor, bf16)": embeddings_bf16,
                  "HF engine weights (one unsharded bf16 copy)": 2 * plan.actor_params}


def test_a_folder_without_config_json_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="example/model_configs"):
        read_model_config(str(tmp_path / "nothing"))


def test_the_log_prob_head_is_planned_as_the_fused_chunked_head_runs() -> None:
    # Qwen2.5-7B, 16 rows of 4548 tokens of which 4500 are response positions: the fused head keeps
    # per-token state only; its vocabulary-wide tensors are one 1024-row chunk's.
    from verl.utils.memory_plan import head_bytes

    shape = ModelShape(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    kept = 16 * 4500
    log_prob = head_bytes(shape, kept, backward=False)
    assert log_prob == {"log-prob head chunk (1024 rows x vocab)": 2 * 4 * 1024 * 152064,
                        "log-prob head per response token": 16 * kept}
    update = head_bytes(shape, kept, backward=True)
    assert update["log-prob head chunk (1024 rows x vocab)"] == max(8 * 1024 * 152064, 2 * 1024 * 152064 + 2 * 152064 * 3584)
    assert update["log-prob head per response token"] == kept * (16 + 4 * 3584)
    assert update["log-prob head lm_head grad"] == 4 * 152064 * 3584            # several chunks: fp32 sum
    one_chunk = head_bytes(shape, 512, backward=True)
    assert one_chunk["log-prob head chunk (512 rows x vocab)"] == 8 * 512 * 152064
    assert one_chunk["log-prob head lm_head grad"] == 2 * 152064 * 3584           # bf16, as the weight
    assert sum(log_prob.values()) < 1.5 * 1024 ** 3      # the unfused (16 x 4548 x vocab fp32) logits: 41 GiB


def _seven_b(*extra: str):
    cfg = compose_config([f"actor_rollout_ref.model.path={CONFIGS / 'qwen2.5-7b'}",
                          f"critic.model.path={CONFIGS / 'qwen2.5-7b'}", "trainer.n_gpus_per_node=8", "do_search=false",
                          "actor_rollout_ref.actor.ppo_micro_batch_size=64", "critic.ppo_micro_batch_size=8", *extra])
    OmegaConf.resolve(cfg)
    return {p.name: p for p in plan_memory(cfg).phases}


def test_the_root_unit_the_critics_value_pass_and_dynamic_batches_are_planned() -> None:
    phases = _seven_b()
    v, h = 152064, 3584
    update = phases["actor_update"].certain
    assert update["gathered root unit (bf16)"] == 2 * (2 * v * h + h)                 # untied: embeddings + lm_head
    assert update["reduce-scatter staging (bf16 + fp32)"] == 6 * (2 * v * h + h)     # the root is the largest unit
    assert phases["critic_values"].certain["gathered root unit (bf16)"] == 2 * (v * h + h)   # no lm_head
    # the value pass has its own micro-batch: 4 rows per GPU instead of the update's 1
    small = phases["critic_values"].estimated["activations"]
    big = _seven_b("critic.forward_micro_batch_size_per_gpu=4")["critic_values"].estimated["activations"]
    assert big == 4 * small and phases["critic_update"].estimated == _seven_b()["critic_update"].estimated
    # packed by tokens: every one of ppo_max_token_len_per_gpu tokens may be a response position
    dyn = _seven_b("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384")
    assert dyn["actor_update"].certain["log-prob head per response token"] == 16384 * (16 + 4 * h)
    # the log-prob pass reads its own key (log_prob_use_dynamic_bsz), not the actor's
    lp = _seven_b("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false")
    assert lp["actor_log_prob"].certain["log-prob head per response token"] == 16 * 16 * 500    # 128/8 rows x 500


def test_bypass_mode_plans_no_old_log_prob_pass() -> None:
    # algorithm.rollout_correction bypass: the old log-probs are the engine's, the actor makes no pass
    assert "actor_log_prob" in _seven_b()
    bypass = _seven_b("algorithm.rollout_correction.bypass_old_logprob_for_rollout=true")
    assert "actor_log_prob" not in bypass and "actor_update" in bypass and "reference_log_prob" in bypass


# tests/utils/gpu_measurements/: scripts/gpu_checks/memory_plan_vs_allocated.py's JSON of 2026-11-26 on one H200 (torch 2.11,
# FSDP2 on one rank, bf16 compute): Qwen2.5-0.5B's shape (8 rows, micro 4, 1024 + 512) and Qwen2.5-3B's with
# gradient checkpointing (16 rows, micro 4, 2048 + 512). Its update was the actor's first.
MEASURED = [Path(__file__).parent / "gpu_measurements" / f"memory_plan_qwen2.5-{m}_h200.json" for m in ("0.5b", "3b_gc")]


def _measured_plan(path: Path, tmp_path: Path, first_update: bool):
    report = json.loads(path.read_text())
    (tmp_path / "config.json").write_text(json.dumps(report["model"]["config"]))
    cfg = compose_config([o.replace("<temporary folder>", str(tmp_path)) for o in report["overrides"]])
    OmegaConf.resolve(cfg)
    plan = plan_memory(cfg, model_config=report["model"]["config"], first_update=first_update)
    return report, {p.name: p for p in plan.phases}


@pytest.mark.parametrize("path", MEASURED, ids=lambda p: p.stem)
def test_the_plan_rederives_the_measured_first_update_and_log_prob_pass(path: Path, tmp_path: Path) -> None:
    report, phases = _measured_plan(path, tmp_path, first_update=True)
    update = report["phases"]["actor_update"]
    params = report["held_bytes"]["actor params (fp32 shard)"]
    # the first update: before it the GPU held the parameters (and CUDA's ~35 MB of workspaces), no AdamW state
    assert params <= update["allocated_before_bytes"] < params + 64 * 2 ** 20
    for name in ("actor_update", "actor_log_prob"):
        measured = report["phases"][name]["measured_peak_bytes"]
        over = (phases[name].total - measured) / measured
        assert -0.03 <= over <= 0.10, f"{path.name} {name}: plan {phases[name].total} vs measured {measured}"
    # which peak binds: the 0.5B's backward (8.4 GB of activations); the 3B's optimizer step, where
    # foreach AdamW's sqrt(exp_avg_sq) makes 5 fp32 copies of the 3.09 B parameters: 61.72 GB of 61.79
    first = phases["actor_update"]
    assert first.binding == ("optimizer step" if "3b" in path.name else "backward")
    assert first.moments["optimizer step"].total == 5 * params + 4 * report["model"]["parameter_tensors"]
    # every later update's backward also holds AdamW's state: that steady state is what preflight checks
    _, steady = _measured_plan(path, tmp_path, first_update=False)
    backward = steady["actor_update"].moments["backward"]
    assert backward.total - first.moments["backward"].total == report["held_bytes"]["actor AdamW state (shard)"]
    assert steady["actor_update"].total >= first.total and steady["actor_log_prob"].total == phases["actor_log_prob"].total


def test_foreach_adamw_allocates_one_fp32_copy_of_the_parameters_in_its_step() -> None:
    # On CUDA torch's AdamW takes the foreach path for FSDP2's DTensor parameters (on CPU it loops per
    # tensor, so the group is switched to foreach here): the step allocates exactly one temporary the
    # size of the parameters, `_foreach_sqrt(exp_avg_sqs)`, beside params, grads and both moments.
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import _foreach_supported_types
    from torch.utils._python_dispatch import TorchDispatchMode

    from verl.utils import fsdp_utils
    from verl.utils.memory_plan import ADAM_STEP_TEMPORARIES

    assert DTensor in _foreach_supported_types
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    optimizer, _ = fsdp_utils.build_optimizer(model, OmegaConf.create({"lr": 1e-3, "weight_decay": 0.01}))
    for group in optimizer.param_groups:
        group["foreach"] = True

    class NewFloatTensors(TorchDispatchMode):
        """Bytes of the floating tensors each out-of-place op returns."""

        def __init__(self) -> None:
            super().__init__()
            self.by_op: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if not name.endswith("_"):                    # in-place ops write into their inputs
                tensors = out if isinstance(out, (list, tuple)) else [out]
                size = sum(t.numel() * t.element_size() for t in tensors
                           if isinstance(t, torch.Tensor) and t.is_floating_point())
                self.by_op[name] = self.by_op.get(name, 0) + size
            return out

    for _ in range(2):                                   # the second step: AdamW's state exists already
        model(torch.randn(8, 64)).sum().backward()
        tracker = NewFloatTensors()
        with tracker:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = 4 * sum(p.numel() for p in model.parameters())
    big = {op: size for op, size in tracker.by_op.items() if size >= 1024}
    assert big == {"aten::_foreach_sqrt": ADAM_STEP_TEMPORARIES * params}


@pytest.mark.parametrize("size", ["0.5b", "3b_gc"])
def test_the_steady_state_plan_rederives_the_throughput_runs_peak(size: str, tmp_path: Path) -> None:
    # scripts/gpu_checks/actor_throughput.py on the same H200: a warm-up update, then 3 timed ones, so its
    # peak is an update with AdamW's state resident during the backward: the steady state preflight checks
    from scripts.gpu_checks.memory_plan_vs_allocated import QWEN2_5_0_5B, BatchShape, compose

    run = json.loads((Path(__file__).parent / "gpu_measurements" / f"actor_throughput_{size}.json").read_text())
    model = QWEN2_5_0_5B if run["config"] == "0.5b" else json.loads((REPO / run["config"]).read_text())
    shape = BatchShape(run["rows"], run["micro"], run["prompt"], run["response"])
    _, _, plan = compose(model, shape, "cuda", run["extra"], str(tmp_path))
    update = next(p for p in plan.phases if p.name == "actor_update")
    measured = run["max_allocated_gib"] * GIB
    assert -0.03 <= (update.total - measured) / measured <= 0.10, (update.total / GIB, run["max_allocated_gib"])
    assert update.binding == ("optimizer step" if size == "3b_gc" else "backward")
