"""The FSDP workers split into one module per concern (issue 43 item 16) keep their public face:
the classes import from verl/workers/fsdp_workers.py (configs, Ray and scripts name that path), expose
the same registered methods with the same dispatch, and travel to Ray actors by reference."""

from __future__ import annotations

import pickle
from pathlib import Path

import cloudpickle

from verl.single_controller.base.decorator import Dispatch
from verl.single_controller.base.worker_group import registered_methods
from verl.workers import fsdp_workers
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

ACTOR_METHODS = {
    "compute_log_prob", "compute_ref_log_prob", "device_peak_flops", "generate_agent_samples", "generate_sequences",
    "generate_trajectories",
    "get_model_flops_info", "get_state_fingerprint", "init_model", "join_weight_sync", "load_checkpoint",
    "lora_report", "receive_weights", "rollout_pool_state", "rollout_push_mode", "rollout_sleep", "rollout_wake_up",
    "rollout_weight_dtype", "save_checkpoint", "send_weights", "update_actor", "weight_push_manifest",
    "weight_sync_endpoint", "write_checkpoint_probe",
}
CRITIC_METHODS = {"compute_values", "init_model", "load_checkpoint", "save_checkpoint", "update_critic"}
WORKERS = Path(fsdp_workers.__file__).parent
BASE_METHODS = {"get_dist_info", "get_mesh_rank", "get_rank_zero_addr_port",   # every Worker's
                "start_profile", "stop_profile"}


def test_workers_keep_their_registered_methods_and_dispatch() -> None:
    actor = registered_methods(ActorRolloutRefWorker)
    assert set(actor) == ACTOR_METHODS | BASE_METHODS
    assert set(registered_methods(CriticWorker)) == CRITIC_METHODS | BASE_METHODS
    # the rollout calls split over the rollout engines' mesh; a push's calls run on both pools at once
    assert actor["generate_sequences"].dispatch_mode == Dispatch.DP_COMPUTE_PROTO
    assert actor["generate_sequences"].mesh == actor["generate_trajectories"].mesh == fsdp_workers.ROLLOUT_MESH
    assert actor["generate_agent_samples"].mesh == fsdp_workers.ROLLOUT_MESH
    assert actor["generate_agent_samples"].dispatch_mode == Dispatch.DP_COMPUTE_PROTO
    assert not actor["send_weights"].blocking and not actor["receive_weights"].blocking
    assert actor["update_actor"].dispatch_mode == Dispatch.DP_COMPUTE_PROTO


def test_worker_classes_pickle_by_reference_for_ray() -> None:
    for cls in (ActorRolloutRefWorker, CriticWorker):
        assert pickle.loads(pickle.dumps(cls)) is cls
        assert cloudpickle.loads(cloudpickle.dumps(cls)) is cls


def test_the_old_import_path_still_exports_every_name() -> None:
    from verl.workers.fsdp_base import FSDPWorkerBase
    from verl.workers.worker_config import normalize_actor_batch_sizes

    assert fsdp_workers._FSDPWorkerBase is FSDPWorkerBase
    assert fsdp_workers.normalize_actor_batch_sizes is normalize_actor_batch_sizes
    for name in fsdp_workers.__all__:
        assert hasattr(fsdp_workers, name), name


def test_each_worker_module_stays_small() -> None:
    modules = ["fsdp_workers", "fsdp_base", "critic_worker", "rollout_role", "weight_push_role", "lora_role",
               "worker_config"]
    sizes = {m: len((WORKERS / f"{m}.py").read_text().splitlines()) for m in modules}
    assert all(n < 400 for n in sizes.values()), sizes
