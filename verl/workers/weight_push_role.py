"""A pipelined run's weight push (`trainer.pipeline` other than `sync`) in ActorRolloutRefWorker
(verl/workers/fsdp_workers.py): the train pool's actor sends its weights to the rollout pool's engines
over a group of their own. The push itself is verl/workers/weight_sync.py; what a LoRA actor sends,
verl/workers/lora_push.py; the rollout pool's engine, verl/workers/rollout_pool.py.

    host, port = train_wg.weight_sync_endpoint()[0]
    dtype, mode = rollout_wg.rollout_weight_dtype()[0], rollout_wg.rollout_push_mode()[0]
    manifest = train_wg.weight_push_manifest(dtype, mode)[0]
    train_wg.join_weight_sync(host, port, size, manifest); rollout_wg.join_weight_sync(...)   # together
    train_wg.send_weights(); rollout_wg.receive_weights()                                       # together
"""

from __future__ import annotations

from typing import Any

import torch

from verl.single_controller.base.decorator import Dispatch, register


class WeightPushRole:
    """Mixin of ActorRolloutRefWorker: reads its config, role flags, rank, device, actor module and
    rollout pool; holds the group (`_weight_sync`) and manifest (`_push_manifest`) once joined."""

    _weight_sync: Any = None     # WeightSyncGroup of a pipelined run (train rank 0, rollout ranks)
    _push_manifest: Any = None   # PushManifest: what a push sends, in which dtype (set on joining)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_sync_endpoint(self) -> tuple[str, int]:
        """(host, free port) for the weight-sync group's store; the driver takes the train rank 0's."""
        from verl.workers.weight_sync import endpoint

        return endpoint()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_weight_dtype(self) -> torch.dtype:
        """Rollout pool: the dtype its engine holds weights in, which a push carries."""
        self._require(self._rollout_pool is not None, "rollout_weight_dtype")
        return self._rollout_pool.dtype

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_push_mode(self) -> str:
        """Rollout pool: what a push must carry to its engine (verl/workers/lora_push.py): `full`,
        or with LoRA `adapter` (vLLM serving the adapter) or `merged`."""
        self._require(self._rollout_pool is not None, "rollout_push_mode")
        return self._rollout_pool.push_mode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_push_manifest(self, dtype: torch.dtype, mode: str = "full") -> Any:
        """Train pool: the PushManifest of what a push of `mode` sends (the actor's weights; with LoRA
        its adapter or its merged weights): names, full shapes, in push order, travelling in `dtype`
        (no collective)."""
        from verl.workers.lora_push import lora_push_manifest

        self._require(self._is_actor, "weight_push_manifest")
        return lora_push_manifest(self.actor_module, dtype, mode)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def join_weight_sync(self, host: str, port: int, size: int, manifest: Any) -> None:
        """Join the weight-sync group: the train pool's rank 0 as its rank 0 (the sender), rollout
        rank r as rank 1 + r; the train pool's other ranks only take part in the gathers. Every push
        sends `manifest` (a PushManifest); a rollout rank checks its engine takes it as it comes.
        Blocks until all `size` members joined (the driver calls both pools at once)."""
        from verl.workers.weight_sync import WeightSyncGroup

        if self._is_rollout and self._is_actor:
            raise RuntimeError(f"role {self.role!r} generates from its own weights: no weight sync")
        if self._rollout_pool is not None:
            self._rollout_pool.join(manifest)
        self._push_manifest = manifest
        if self._is_rollout:
            self._weight_sync = WeightSyncGroup(host, port, 1 + self.rank, size, self.device)
        elif self._is_actor and self.rank == 0:
            self._weight_sync = WeightSyncGroup(host, port, 0, size, self.device)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def send_weights(self) -> int:
        """Train pool: the actor's full weights (with LoRA: the adapter, or the merged weights, as the
        manifest's mode says), cast to the rollout engine's dtype, to every rollout rank; returns the
        bytes rank 0 sent (0 on the other ranks, which only gather)."""
        from verl.workers.lora_push import lora_push_state
        from verl.workers.weight_sync import send_state

        self._require(self._is_actor and self._push_manifest is not None, "send_weights")
        fsdp_cfg = self.config.actor.fsdp_config
        self._onload(self.actor_module, None, fsdp_cfg)
        manifest = self._push_manifest
        sent = send_state(self._weight_sync, lora_push_state(self.actor_module, manifest.mode), manifest, self.device)
        self._offload(self.actor_module, None, fsdp_cfg)
        return sent

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)   # the two pools' calls run together
    def receive_weights(self) -> int:
        """Rollout pool: the train pool's weights straight into the engine (vLLM's weight load, or
        the HF engine's parameters in place); returns the bytes received. Inside a rollout (a
        partial rollout's push between two turns) the engine stays awake and the next turn
        generates with the new weights."""
        self._require(self._rollout_pool is not None and self._weight_sync is not None, "receive_weights")
        version = self._weights_version + 1
        received = self._rollout_pool.receive(self._weight_sync, self._push_manifest, version)
        self._weights_version = version
        return received

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_pool_state(self) -> Any:
        """Rollout pool: a RolloutPoolState (versions, dtype, engine loads, FSDP modules / DTensors alive,
        the last push's order). For tests and debugging."""
        self._require(self._rollout_pool is not None, "rollout_pool_state")
        return self._rollout_pool.state(self._weights_version)
