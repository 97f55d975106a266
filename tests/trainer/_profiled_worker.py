"""A worker with one registered method doing torch work (its own module so Ray workers can import it)."""

from __future__ import annotations

import torch

from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.worker import Worker


class ProfiledWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def matmul_work(self) -> float:
        x = torch.ones(64, 64)
        return float((x @ x).sum())
