"""LoRA in ActorRolloutRefWorker (verl/workers/fsdp_workers.py), `actor_rollout_ref.model.lora_rank > 0`:
the actor trains PEFT-style adapters over a frozen base (verl/utils/lora.py); the reference is the
same module with its adapters off, or with the starting adapter swapped in (`ref.lora_reference`; no
second model either way); a colocated vLLM engine gets either the adapter
alone (`rollout.lora_sync=adapter`, served over the base it loaded once) or the merged weights.
A pipeline's push picks its tensors in verl/workers/lora_push.py.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.lora import FrozenAdapter, LoraSpec, adapter_disabled, adapter_state


class LoraRole:
    """Mixin of ActorRolloutRefWorker: reads its config, role flags, actor (module, optimizer, policy)
    and rollout; `lora` is the actor's LoraSpec (None without LoRA)."""

    lora: LoraSpec | None = None
    _start_adapter: FrozenAdapter | None = None   # ref.lora_reference=start_adapter, read at the first pass

    def _init_lora(self, model_cfg: Any) -> None:
        """In init_model, before the actor is built: PEFT's adapters in the actor; none elsewhere."""
        self.lora = LoraSpec.from_model_config(model_cfg) if self._is_actor else None

    def _base_ref_log_prob(self, data: DataProto) -> torch.Tensor:
        """The reference's log-probs of a LoRA actor: no reference weights, the actor's base model with
        its adapter bypassed (ref.lora_reference=base), or with lora_adapter_path's adapter swapped in
        (start_adapter)."""
        self._onload(self.actor_module, None, self.config.actor.fsdp_config)
        with self._lora_reference():
            log_probs, _ = self.actor.compute_log_prob(data)
        self._offload(self.actor_module, None, self.config.actor.fsdp_config)
        return log_probs

    def _lora_reference(self) -> AbstractContextManager[None]:
        if self.config.ref.get("lora_reference", "base") != "start_adapter":
            return adapter_disabled(self.actor_module)
        if self._start_adapter is None:   # from the file: a resumed run's reference is still its start
            self._start_adapter = FrozenAdapter(self.lora, self.actor_module)
        return self._start_adapter.swapped_in(self.actor_module)

    def _sync_lora_adapter(self) -> bool:
        """A colocated engine's weight load under lora_sync=adapter (the actor onloaded): only the adapter
        travels, the engine keeps the frozen base it loaded. False otherwise: the caller pushes the full
        weights (with LoRA merged: W + scaling * B @ A, verl/workers/lora_push.py)."""
        if getattr(self.rollout, "lora_sync", None) != "adapter":
            return False
        self.rollout.sync_adapter(adapter_state(self.actor_module), version=self._weights_version)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lora_report(self) -> dict[str, Any]:
        """What LoRA left in this rank's actor (tests, debugging; no collective): the names that require
        grad, the optimizer's parameter count, the frozen ones' dtypes and whether any holds a grad,
        and whether a reference model was built."""
        from verl.utils.lora import is_adapter_param

        self._require(self._is_actor, "lora_report")
        named = list(self.actor_module.named_parameters())
        optimized = {id(p) for group in self.actor_optimizer.param_groups for p in group["params"]}
        return {
            "trainable": sorted(n for n, p in named if p.requires_grad),
            "optimizer_params": sorted(n for n, p in named if id(p) in optimized),
            "optimizer_state_params": sorted(n for n, p in named if p in self.actor_optimizer.state),
            "adapters": sorted(n for n, _ in named if is_adapter_param(n)),
            "frozen_dtypes": sorted({str(p.dtype) for n, p in named if not is_adapter_param(n)}),
            "frozen_with_grad": sorted(n for n, p in named if not is_adapter_param(n) and p.grad is not None),
            "ref_module": self.ref_module is not None,
            # the vLLM engine's side of it (lora_sync, adapters served, weight loads, bytes); None for HF
            "rollout": self.rollout.lora_state() if hasattr(getattr(self, "rollout", None), "lora_state") else None,
        }
