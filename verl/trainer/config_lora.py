"""Config rules for LoRA (`actor_rollout_ref.model.lora_*`, veRL's keys; docs/lora.md)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from omegaconf import DictConfig, ListConfig

LORA_KEY = "actor_rollout_ref.model"


def lora_rank(cfg: DictConfig) -> int:
    """The actor's LoRA rank (0: LoRA off); a bad value reads as 0 here (check_lora names it)."""
    value = cfg.actor_rollout_ref.model.get("lora_rank", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _module_names(value: Any, key: str, errors: list[str], allow_null: bool) -> None:
    if value is None:
        if not allow_null:
            errors.append(f"{key}=null: give 'all-linear' or a list of module names (q_proj, v_proj, ...)")
        return
    if isinstance(value, str):
        if not value:
            errors.append(f"{key}='' names no module")
        return
    if isinstance(value, (list, tuple, ListConfig)):
        if not value and not allow_null:
            errors.append(f"{key}=[] names no module: LoRA would train nothing")
        if not all(isinstance(v, str) and v for v in value):
            errors.append(f"{key}={list(value)!r} must hold module names (non-empty strings)")
        return
    errors.append(f"{key}={value!r} must be a string ('all-linear') or a list of module names")


def check_lora(cfg: DictConfig, run: Any, has_gpu: bool | None) -> list[str]:
    """LoRA's keys: their values, a saved adapter to continue from, and what LoRA is not built for yet."""
    errors: list[str] = []
    model = cfg.actor_rollout_ref.model
    rank = model.get("lora_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        errors.append(f"{LORA_KEY}.lora_rank={rank!r} must be an int >= 0 (0 = LoRA off)")
        return errors
    critic_rank = cfg.critic.model.get("lora_rank", 0)
    if critic_rank not in (0, None):
        errors.append(f"critic.model.lora_rank={critic_rank!r}: critic LoRA is not supported yet (the value head "
                      "would have to train beside the adapter, and the critic's checkpoint / export handle neither); "
                      "set it to 0: the critic trains in full")
    adapter_path = model.get("lora_adapter_path")
    if rank == 0:
        if adapter_path:
            errors.append(f"{LORA_KEY}.lora_adapter_path={adapter_path!r} is set but {LORA_KEY}.lora_rank=0 "
                          "(LoRA off): set lora_rank > 0 to continue from the adapter")
        if cfg.trainer.get("save_merged_lora", False):
            errors.append(f"trainer.save_merged_lora=True exports a LoRA model merged; {LORA_KEY}.lora_rank=0")
        return errors
    alpha = model.get("lora_alpha", 16)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        errors.append(f"{LORA_KEY}.lora_alpha={alpha!r} must be a number > 0")
    _module_names(model.get("target_modules"), f"{LORA_KEY}.target_modules", errors, allow_null=False)
    _module_names(model.get("exclude_modules"), f"{LORA_KEY}.exclude_modules", errors, allow_null=True)
    if adapter_path:
        from verl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(str(adapter_path), f))]
        if missing:
            errors.append(f"{LORA_KEY}.lora_adapter_path={adapter_path!r} has no {' / '.join(missing)}: give a "
                          "folder a LoRA run exported (global_step_N/hf) or PeftModel.save_pretrained wrote")
        else:
            errors.extend(_check_saved_adapter(cfg, str(adapter_path), has_gpu))
    errors.extend(_check_lora_sync(cfg, rank, has_gpu))
    if run.pools.pipelined and adapter_path:
        errors.append(f"{LORA_KEY}.lora_adapter_path={adapter_path!r} with trainer.pipeline={cfg.trainer.pipeline}: "
                      "the rollout pool's first rollout would use the base model (it loads model.path; the "
                      "adapter arrives with the first push); use trainer.pipeline=sync to continue from an adapter")
    if importlib.util.find_spec("peft") is None:
        errors.append(f"{LORA_KEY}.lora_rank={rank} needs Hugging Face PEFT, which is not installed: "
                      "`pip install peft -c requirements-lock.txt`")
    return errors


SYNC_KEY = "actor_rollout_ref.rollout.lora_sync"


def _serves_adapter(cfg: DictConfig, has_gpu: bool | None = None) -> bool:
    """Whether a vLLM engine serves the adapter itself (lora_sync=adapter with rollout.name=vllm, or auto
    where it means vLLM: on GPUs, or not known; auto on CPU workers is the HF loop)."""
    rollout = cfg.actor_rollout_ref.rollout
    name = rollout.get("name", "hf")
    return rollout.get("lora_sync", "adapter") == "adapter" and (name == "vllm" or (name == "auto" and has_gpu is not False))


def _check_saved_adapter(cfg: DictConfig, adapter_path: str, has_gpu: bool | None = None) -> list[str]:
    """The continued adapter's own adapter_config.json (what the engine will load) under the adapter-mode
    rules: vLLM refuses these only at its first add_lora, after every rank has built its engine."""
    from verl.utils.lora import ADAPTER_CONFIG
    from verl.workers.rollout.vllm_lora import VLLM_LORA_RANKS, VLLM_UNSERVED_MODULES

    path = os.path.join(adapter_path, ADAPTER_CONFIG)
    key = f"{LORA_KEY}.lora_adapter_path"
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON object expected, got {type(saved).__name__}")
    except (OSError, ValueError) as err:
        return [f"{key}={adapter_path!r}: cannot read {path} ({err}); give a folder a LoRA run exported "
                "(global_step_N/hf) or PeftModel.save_pretrained wrote"]
    if str(saved.get("peft_type", "LORA")).upper() != "LORA":
        return [f"{key}={adapter_path!r}: {path} has peft_type={saved.get('peft_type')!r}, not a LoRA adapter"]
    if not _serves_adapter(cfg, has_gpu):
        return []
    fix = f"set {SYNC_KEY}=merged (full merged weights after each update) or continue from another adapter"
    where = f"{key}={adapter_path!r} ({path}) with {SYNC_KEY}=adapter"
    errors = []
    rank = saved.get("r")
    if isinstance(rank, int) and rank > VLLM_LORA_RANKS[-1]:
        errors.append(f"{where}: its r={rank}, and vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; {fix}")
    target = saved.get("target_modules")
    names = [target] if isinstance(target, str) else list(target or [])
    unserved = sorted(n for n in names if isinstance(n, str) and n.rsplit(".", 1)[-1] in VLLM_UNSERVED_MODULES)
    if unserved:
        errors.append(f"{where}: its target_modules hold {unserved}, which vLLM's LoRA does not serve; {fix}")
    if saved.get("modules_to_save"):
        errors.append(f"{where}: its modules_to_save={saved['modules_to_save']!r} (fully trained modules), which "
                      f"vLLM's LoRA does not load; {fix}")
    for flag in ("use_dora", "lora_bias"):
        if saved.get(flag):
            errors.append(f"{where}: its {flag}=true, which vLLM's LoRA does not serve; {fix}")
    return errors


def _check_lora_sync(cfg: DictConfig, rank: int, has_gpu: bool | None = None) -> list[str]:
    """actor_rollout_ref.rollout.lora_sync: its value, and what the adapter path's vLLM cannot serve."""
    from verl.workers.rollout.vllm_lora import LORA_SYNC_MODES, VLLM_LORA_RANKS, VLLM_UNSERVED_MODULES

    key = SYNC_KEY
    mode = cfg.actor_rollout_ref.rollout.get("lora_sync", "adapter")
    if mode not in LORA_SYNC_MODES:
        return [f"{key}={mode!r} must be one of {list(LORA_SYNC_MODES)} (adapter: vLLM serves the adapter over the "
                "base it loaded; merged: full merged weights after each update)"]
    if not _serves_adapter(cfg, has_gpu) or cfg.actor_rollout_ref.model.get("lora_adapter_path"):
        return []   # a continued adapter's own r / target_modules are what the engine loads (_check_saved_adapter)
    errors = []
    if rank > VLLM_LORA_RANKS[-1]:
        errors.append(f"{LORA_KEY}.lora_rank={rank} with {key}=adapter: vLLM serves LoRA ranks up to "
                      f"{VLLM_LORA_RANKS[-1]}; set {key}=merged")
    target = cfg.actor_rollout_ref.model.get("target_modules")
    names = [target] if isinstance(target, str) else list(target or [])
    unserved = [n for n in names if isinstance(n, str) and n.rsplit(".", 1)[-1] in VLLM_UNSERVED_MODULES]
    if unserved:
        errors.append(f"{LORA_KEY}.target_modules={names!r} with {key}=adapter: vLLM's LoRA does not serve "
                      f"{unserved}; set {key}=merged (full merged weights after each update) or leave them out")
    return errors
