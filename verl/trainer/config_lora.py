"""Config rules for LoRA (`actor_rollout_ref.model.lora_*`, veRL's keys; docs/lora.md)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from typing import Any

from omegaconf import DictConfig, ListConfig

logger = logging.getLogger(__name__)

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
    if not adapter_path:   # a continued adapter's own target_modules win (_check_saved_adapter)
        errors.extend(_embedding_targets(model.get("target_modules")))
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
    errors.extend(_check_lora_reference(cfg, adapter_path))
    return errors


def _embedding_targets(target: Any) -> list[str]:
    """LoRA on embed_tokens / lm_head, refused in every mode (verl/utils/lora.py, EMBEDDING_MODULES); a
    pattern string is checked against their usual full names (injection refuses any other match)."""
    from verl.utils.lora import EMBEDDING_MODULES, EMBEDDING_REASON

    if isinstance(target, str):
        if target == "all-linear":   # PEFT leaves the output head out of all-linear
            return []
        try:
            hit = [n for n in ("model.embed_tokens", "lm_head") if re.fullmatch(target, n)]
        except re.error:
            return []   # PEFT reports a bad pattern at injection
    else:
        hit = [n for n in (target or []) if isinstance(n, str) and n.rsplit(".", 1)[-1] in EMBEDDING_MODULES]
    if not hit:
        return []
    return [f"{LORA_KEY}.target_modules={target!r} adapts {sorted(hit)}: {EMBEDDING_REASON}"]


REFERENCE_KEY = "actor_rollout_ref.ref.lora_reference"
LORA_REFERENCES = ("base", "start_adapter")


def _check_lora_reference(cfg: DictConfig, adapter_path: Any) -> list[str]:
    """actor_rollout_ref.ref.lora_reference; a start-up warning where the KL reference is the raw base while
    the policy starts from a saved adapter (veRL's behaviour too)."""
    reference = cfg.actor_rollout_ref.ref.get("lora_reference", "base")
    if reference not in LORA_REFERENCES:
        return [f"{REFERENCE_KEY}={reference!r} must be one of {list(LORA_REFERENCES)} (base: the model without "
                "its adapter; start_adapter: the adapter of lora_adapter_path, frozen)"]
    if reference == "start_adapter" and not adapter_path:
        return [f"{REFERENCE_KEY}=start_adapter needs {LORA_KEY}.lora_adapter_path (without it the starting "
                "adapter is the base model: lora_B starts at zero); use lora_reference=base"]
    uses_reference = cfg.actor_rollout_ref.actor.get("use_kl_loss", False) or cfg.algorithm.get("use_kl_in_reward",
                                                                                                 False)
    if adapter_path and reference == "base" and uses_reference:
        logger.warning("%s.lora_adapter_path=%s with %s=base: the KL reference is the base model WITHOUT the "
                       "adapter you continue from (veRL does the same), so the KL term pulls the policy back "
                       "towards the raw base; set %s=start_adapter to measure KL against the starting adapter",
                       LORA_KEY, adapter_path, REFERENCE_KEY, REFERENCE_KEY)
    return []


SYNC_KEY = "actor_rollout_ref.rollout.lora_sync"


def _serves_adapter(cfg: DictConfig, has_gpu: bool | None = None) -> bool:
    """Whether a vLLM engine serves the adapter itself (lora_sync=adapter with rollout.name=vllm, or auto
    where it means vLLM: on GPUs, or not known; auto on CPU workers is the HF loop)."""
    rollout = cfg.actor_rollout_ref.rollout
    name = rollout.get("name", "hf")
    return rollout.get("lora_sync", "adapter") == "adapter" and (name == "vllm" or (name == "auto" and has_gpu is not False))


def _check_saved_adapter(cfg: DictConfig, adapter_path: str, has_gpu: bool | None = None) -> list[str]:
    """The continued adapter's own adapter_config.json: the fields the actor's loader cannot rebuild
    (verl/utils/lora.py, saved_adapter_errors), then what the engine will load under the adapter-mode
    rules: vLLM refuses these only at its first add_lora, after every rank has built its engine."""
    from verl.utils.lora import ADAPTER_CONFIG, saved_adapter_errors
    from verl.workers.rollout.vllm_lora import VLLM_LORA_RANKS

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
    # what the actor's loader cannot rebuild as PeftModel.from_pretrained would, in every mode
    errors = saved_adapter_errors(saved, f"{key}={adapter_path!r} ({path})")
    if not _serves_adapter(cfg, has_gpu):
        return errors
    fix = f"set {SYNC_KEY}=merged (full merged weights after each update) or continue from another adapter"
    where = f"{key}={adapter_path!r} ({path}) with {SYNC_KEY}=adapter"
    rank = saved.get("r")
    ranks = [rank, *(saved.get("rank_pattern") or {}).values()]
    if all(isinstance(r, int) for r in ranks) and max(ranks) > VLLM_LORA_RANKS[-1]:
        pattern = f" (rank_pattern up to {max(ranks)})" if max(ranks) != rank else ""
        errors.append(f"{where}: its r={rank}{pattern}, and vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; {fix}")
    if saved.get("use_dora"):
        errors.append(f"{where}: its use_dora=true, which vLLM's LoRA does not serve; {fix}")
    return errors


def _check_lora_sync(cfg: DictConfig, rank: int, has_gpu: bool | None = None) -> list[str]:
    """actor_rollout_ref.rollout.lora_sync: its value, and what the adapter path's vLLM cannot serve."""
    from verl.workers.rollout.vllm_lora import LORA_SYNC_MODES, VLLM_LORA_RANKS

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
    return errors
