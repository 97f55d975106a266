"""One LoRA GRPO step end to end through `run_ppo` (real Ray workers, FSDP on gloo, HF rollout): the
reference is the actor with the adapter off, the checkpoint holds the adapter alone, the HF export is
PEFT's adapter, and the merged export differs from the base model only in the adapted weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.mark.slow   # ~1-2 min on a 2-core CPU
def test_one_lora_grpo_step_trains_only_the_adapter(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    ckpt = tmp_path / "ckpt"
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(ckpt), adv_estimator="grpo", n_agent=2) + [
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=5e-2", "trainer.save_freq=1", "trainer.save_hf_model=true",
        "trainer.save_merged_lora=true"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (step,) = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    assert cfg.actor_rollout_ref.actor.use_kl_loss and math.isfinite(step["actor/kl_loss"])
    assert step["timing_s/ref"] > 0 and step["timing_s/update_actor"] > 0

    done = ckpt / "global_step_1"
    hf, merged = done / "hf", done / "hf_merged"
    assert (hf / ADAPTER_CONFIG).is_file() and (hf / ADAPTER_WEIGHTS).is_file()
    adapter = load_file(hf / ADAPTER_WEIGHTS)
    assert len(adapter) == 28 and any(float(t.abs().max()) > 0 for k, t in adapter.items() if ".lora_B." in k)
    # the checkpoint: the adapter and its optimizer state, no base weight
    saved = dcp.FileSystemReader(str(done / "actor" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    # the merged model: the base plus B A where an adapter sits, every other tensor the base's bit for bit
    base, after = _state(Path(tiny_model_dir)), _state(merged)
    adapted = {k.removeprefix("base_model.model.").replace(".lora_B.weight", ".weight")
               for k in adapter if ".lora_B." in k}
    assert adapted and adapted <= set(after)
    for name, tensor in after.items():
        if name in adapted:
            assert not torch.equal(tensor.float(), base[name].float()), name
        else:
            assert torch.equal(tensor.float(), base[name].float()), name
