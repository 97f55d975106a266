"""Where the workers run: the roles of a run and the Ray resource pools they are placed on.

    pools = ResourcePoolManager(resource_pool_spec=run.pools.layout(), mapping={Role.ActorRollout: "global_pool"})
    pools.create_resource_pool(); pool = pools.get_resource_pool(Role.ActorRollout)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Role(Enum):
    ActorRollout = "actor_rollout"        # actor + rollout (+ ref) fused in one worker; with a pipeline actor (+ ref)
    Rollout = "rollout"                   # a pipelined run's rollout pool (trainer.pipeline)
    Critic = "critic"


@dataclass
class ResourcePoolManager:
    """One pool of worker processes per name; every role is placed on a pool.

    On a machine with no GPU a "GPU" slot is a CPU worker process.
    """

    resource_pool_spec: dict[str, list[int]]          # pool name -> processes per node
    mapping: dict[Role, str]                           # role -> pool name
    use_gpu: bool = False
    resource_pool_dict: dict[str, Any] = field(default_factory=dict)

    def create_resource_pool(self) -> None:
        from verl.single_controller.ray import RayResourcePool

        for name, process_on_nodes in self.resource_pool_spec.items():
            # max_colocate_count=1: all roles of a pool share one process (FSDP wants that)
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes, use_gpu=self.use_gpu, max_colocate_count=1)

    def get_resource_pool(self, role: Role) -> Any:
        return self.resource_pool_dict[self.mapping[role]]
