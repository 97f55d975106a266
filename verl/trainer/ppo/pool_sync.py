"""The driver's side of a pipelined run's weight push: join the two pools' weight-sync group, push.

The workers' side is `verl/workers/weight_sync.py` (the group, the manifest, send and receive) and
`verl/workers/rollout_pool.py` (the rollout rank's engine taking each tensor as it arrives).

    manifest = join_weight_sync(actor_rollout_wg, rollout_wg)   # once, after both pools' init_model
    sent = push_weights(actor_rollout_wg, rollout_wg)           # bytes; manifest.nbytes each time
"""

from __future__ import annotations

from typing import Any

from verl.workers.weight_sync import PushManifest


def join_weight_sync(train_wg: Any, rollout_wg: Any) -> PushManifest:
    """Build the group of the train pool's rank 0 and every rollout rank. A push carries the dtype
    the rollout engines hold their weights in; the manifest (tensor names and shapes, in push order)
    comes from the train pool's actor, for the push mode the engines take (verl/workers/lora_push.py:
    `full`; with LoRA `adapter` or `merged`). Returns it."""
    dtypes = set(rollout_wg.rollout_weight_dtype())
    if len(dtypes) != 1:
        raise RuntimeError(f"the rollout pool's engines hold weights in different dtypes: {sorted(map(str, dtypes))}")
    modes = set(rollout_wg.rollout_push_mode())
    if len(modes) != 1:
        raise RuntimeError(f"the rollout pool's engines take different pushes: {sorted(modes)}")
    # with LoRA the engine decides what travels: the adapter alone (vLLM serving it) or the merged weights
    manifest: PushManifest = train_wg.weight_push_manifest(dtypes.pop(), modes.pop())[0]
    host, port = train_wg.weight_sync_endpoint()[0]
    size = 1 + rollout_wg.world_size
    # both pools at once: joining blocks until every member is there
    rollout_wg._resolve(train_wg.join_weight_sync(host, port, size, manifest)
                        + rollout_wg.join_weight_sync(host, port, size, manifest))
    return manifest


def push_weights(train_wg: Any, rollout_wg: Any) -> int:
    """The train pool's weights to the rollout pool (both pools at once: one broadcast per tensor);
    returns the bytes the sender broadcast (each rollout rank received exactly those)."""
    sends = train_wg.send_weights()
    results = rollout_wg._resolve(sends + rollout_wg.receive_weights())
    sent, received = sum(results[:len(sends)]), results[len(sends):]
    if any(r != sent for r in received):
        raise RuntimeError(f"weight push: the sender broadcast {sent} bytes, the rollout ranks received {received}")
    return sent
