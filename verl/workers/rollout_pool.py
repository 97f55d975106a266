"""A pipelined run's rollout rank (worker role `rollout`): the rollout engine alone, fed by weight pushes.

The rollout pool never trains, so it holds no FSDP module, no fp32 copy and no optimizer: only what
its engine generates with, in the dtype the engine computes in (`engine_weight_dtype`).

- vLLM: the engine loads the model path's weights itself (the configured `load_format`, or `auto`
  where that is a random-init `dummy`: no actor streams weights in before the first push) and keeps
  them between rollouts (`free_cache_engine=false`: sleeping would discard them, and there is no
  copy to reload from). A push streams each received tensor into the engine's weight load
  (`vLLMRollout.sync_weights`: one reload per push, checkpoint names, tensor by tensor).
- HF: one plain module (not FSDP) in the compute dtype (FSDP2's mixed-precision dtype, bf16, on a
  GPU; fp32 on CPU, where no mixed precision runs) on the device, frozen; the engine generates with
  it, and a push broadcasts each tensor straight into its parameter, in place.

Versions: the worker counts the weights it holds (0: the model path's; one more per push); the
engine records the version it holds and a generation phase refuses to begin on another one.

    pool = RolloutPoolEngine.build(cfg.actor_rollout_ref, tokenizer, "cuda", attn=None, seed=1000)
    pool.join(manifest)                                  # manifest.dtype == pool.dtype
    received = pool.receive(group, manifest, version=1)  # one push, straight into the engine
    with pool.generation_phase(version=1):
        out = pool.rollout.generate_sequences(prompts)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import open_dict
from torch import nn

from verl.utils import fsdp_utils
from verl.utils.lora import LoraSpec
from verl.utils.model import load_causal_lm
from verl.workers.lora_push import push_mode
from verl.workers.rollout import BaseRollout, HFRollout, build_rollout
from verl.workers.weight_sync import (
    PushManifest,
    ReceivedTensors,
    WeightSyncGroup,
    check_module_takes,
    receive_into_module,
)

_RANDOM_INIT_FORMATS = ("dummy", "dummy_dtensor", "dummy_hf")


@dataclass(frozen=True)
class RolloutPoolState:
    """What a rollout rank holds, for tests and debugging (`ActorRolloutRefWorker.rollout_pool_state`)."""

    version: int                    # the worker's count: 0 = the model path's weights, +1 per push
    engine_version: int | None      # the version the engine holds (equal to `version` outside a push)
    dtype: str                      # the engine's weight dtype (what pushes carry)
    engine_loads: int               # vLLM: weight reloads so far (one per push); HF: pushes written in place
    fsdp_modules: int               # FSDP-wrapped modules alive in this process (0: the rollout pool trains nothing)
    dtensors: int                   # DTensors (sharded tensors) alive in this process (0)
    params: int                     # elements of the engine's weights this process holds (HF module; 0 for vLLM)
    last_push: tuple[str, ...]      # the tensors of the last push, in the order the engine took them
    push_mode: str = "full"         # what pushes carry: full, or with LoRA adapter / merged (lora_push.py)
    lora: dict[str, Any] | None = None   # vLLM: its lora_state() (LoRA mode, adapters, loads, bytes); HF: None
    lora_ids: tuple[int, ...] = ()  # the LoRARequest id each generation phase's requests carried (version + 1)


def engine_compute_dtype(device: str) -> torch.dtype:
    """The HF engine's compute dtype: FSDP2's mixed-precision parameter dtype on a GPU, fp32 on CPU."""
    return fsdp_utils.gpu_mixed_precision().param_dtype if device == "cuda" else torch.float32


def rollout_pool_engine_config(rollout_cfg: Any) -> Any:
    """The rollout config a rollout-pool engine is built with: awake between rollouts, and (vLLM)
    its own weights read from the model path instead of a random init."""
    cfg = copy.deepcopy(rollout_cfg)
    with open_dict(cfg):
        cfg.free_cache_engine = False
        if str(cfg.get("load_format", "dummy")) in _RANDOM_INIT_FORMATS:
            cfg.load_format = "auto"
    return cfg


class RolloutPoolEngine:
    """A rollout rank's engine (`rollout`), the HF engine's plain module (`module`, None for vLLM)
    and the version of the weights the engine holds."""

    def __init__(self, rollout: BaseRollout, module: nn.Module | None, device: str, lora: LoraSpec | None = None) -> None:
        self.rollout, self.module, self.device = rollout, module, device
        # LoRA: what a push carries (verl/workers/lora_push.py): the adapter alone where the engine
        # serves it (vLLM, lora_sync=adapter), else the merged weights; `full` without LoRA
        self.push_mode = push_mode(lora, getattr(rollout, "adapter_sync", None) is not None)
        self.version = 0                   # the model path's weights, loaded at build
        self.pushes = 0
        self.last_push: tuple[str, ...] = ()
        self.lora_ids: list[int] = []
        if not self._is_hf:
            self.rollout.synced_version = 0  # type: ignore[attr-defined]

    @property
    def _is_hf(self) -> bool:
        return isinstance(self.rollout, HFRollout)

    @classmethod
    def build(cls, config: Any, tokenizer: Any, device: str, attn: str | None, seed: int,
              device_index: int | None = None) -> RolloutPoolEngine:
        """The engine of `config` (the actor_rollout_ref tree) with the model path's weights. With LoRA
        a vLLM engine is built as the sync path builds it (lora_sync=adapter: enable_lora, the base
        from the model path); the HF engine's module stays plain (pushes carry merged weights)."""
        model_cfg = config.model
        lora = LoraSpec.from_model_config(model_cfg)
        rollout_cfg = rollout_pool_engine_config(config.rollout)
        module = None
        if build_rollout_name(rollout_cfg, device) == "hf":
            torch.manual_seed(0)   # as the train pool loads: a weight the checkpoint lacks is initialised alike
            module = load_causal_lm(model_cfg.path, model_cfg.get("override_config"), engine_compute_dtype(device),
                                    attn)
            module.requires_grad_(False)
            module.to(device).eval()
        rollout = build_rollout(rollout_cfg, module, tokenizer, model_path=model_cfg.path, seed=seed, device=device,
                                device_index=device_index, lora=lora if module is None else None)
        return cls(rollout, module, device, lora)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in: what a push carries."""
        if self.module is not None:
            return next(self.module.parameters()).dtype
        return self.rollout.weight_dtype  # type: ignore[attr-defined]

    def join(self, manifest: PushManifest) -> None:
        """Check that pushes of `manifest` can go straight into this engine."""
        if manifest.mode != self.push_mode:
            raise ValueError(f"weight push: the sender pushes {manifest.mode!r} tensors, the rollout engine takes "
                             f"{self.push_mode!r} (actor_rollout_ref.model.lora_rank must be the same for both pools)")
        if manifest.dtype != self.dtype:
            raise ValueError(f"weight push: the sender casts to {manifest.dtype}, the rollout engine holds {self.dtype}")
        if self.module is not None:
            check_module_takes(manifest, self.module, self.device)

    def receive(self, group: WeightSyncGroup, manifest: PushManifest, version: int) -> int:
        """One push into the engine; afterwards it holds `version`. Returns the bytes received."""
        if self.module is not None:
            self.last_push = tuple(receive_into_module(group, manifest, self.module))
            received = manifest.nbytes
        elif manifest.mode == "adapter":
            # the adapter (small): received whole, written as this version's adapter folder, loaded
            stream = ReceivedTensors(group, manifest, self.device)
            try:
                tensors = {name: tensor.cpu() for name, tensor in stream}
            finally:
                received = stream.finish()
            self.rollout.sync_adapter(tensors, version=version)  # type: ignore[attr-defined]
            self.last_push = tuple(stream.names)
        else:
            stream = ReceivedTensors(group, manifest, self.device)
            try:
                self.rollout.sync_weights(stream, version=version)  # type: ignore[attr-defined]
            finally:
                received = stream.finish()   # raises if the load stopped early (after draining the push)
            self.last_push = tuple(stream.names)
        self.version = version
        self.pushes += 1
        return received

    @contextmanager
    def generation_phase(self, version: int) -> Iterator[None]:
        """The engine ready to generate with weights `version` (those of the last push), and put back after."""
        if self.version != version:
            raise RuntimeError(f"the rollout pool's engine holds weights version {self.version}, the worker {version}")
        if self.module is not None:
            yield      # the module is frozen in eval mode; HFRollout sets eval around its own calls too
            return
        self.rollout.wake_up(lambda: self._check_engine_holds(version))  # type: ignore[attr-defined]
        request = getattr(self.rollout, "lora_request", None)
        if request is not None:
            self.lora_ids.append(int(request.lora_int_id))
        try:
            yield
        finally:
            self.rollout.sleep()  # type: ignore[attr-defined]

    def _check_engine_holds(self, version: int) -> None:
        """The engine's wake-time weight load: nothing to load (pushes went straight in), only a check
        that nothing discarded them (a level-2 sleep would: there is no copy to reload from)."""
        held = self.rollout.synced_version  # type: ignore[attr-defined]
        if held != version:
            raise RuntimeError(f"the rollout pool's vLLM engine holds weights version {held}, not the pushed {version}: "
                               "it discarded them (actor_rollout_ref.rollout.free_cache_engine must be false here)")

    def state(self, worker_version: int) -> RolloutPoolState:
        engine_version = self.version if self._is_hf else self.rollout.synced_version  # type: ignore[attr-defined]
        fsdp_modules, dtensors = sharded_objects_alive()
        return RolloutPoolState(
            version=worker_version, engine_version=engine_version, dtype=str(self.dtype).removeprefix("torch."),
            engine_loads=self.pushes if self._is_hf else self.rollout.weight_loads,  # type: ignore[attr-defined]
            fsdp_modules=fsdp_modules, dtensors=dtensors,
            params=sum(p.numel() for p in self.module.parameters()) if self.module is not None else 0,
            last_push=self.last_push, push_mode=self.push_mode,
            lora=self.rollout.lora_state() if hasattr(self.rollout, "lora_state") else None,  # type: ignore[attr-defined]
            lora_ids=tuple(self.lora_ids))


def sharded_objects_alive() -> tuple[int, int]:
    """(FSDP2 modules, DTensors) alive in this process, as the garbage collector sees every object."""
    import gc
    import warnings

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    gc.collect()
    with warnings.catch_warnings():   # isinstance on some lazily imported objects warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        return (sum(isinstance(o, FSDPModule) for o in objects), sum(isinstance(o, DTensor) for o in objects))


def build_rollout_name(rollout_cfg: Any, device: str) -> str:
    """`hf` or `vllm`: the engine `build_rollout` picks for this config on this device."""
    from verl.workers.rollout import resolve_rollout_name

    return resolve_rollout_name(rollout_cfg.get("name", "hf"), has_gpu=device == "cuda")
