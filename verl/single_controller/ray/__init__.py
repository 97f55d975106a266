from verl.single_controller.ray.base import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerPlace,
    create_colocated_worker_cls,
    worker_death,
)

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "WorkerDiedError", "WorkerPlace",
           "create_colocated_worker_cls", "worker_death"]
