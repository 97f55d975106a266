"""Which accelerator this process uses, in one place, so CPU-only runs take the same code paths."""

from __future__ import annotations

import torch


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device_name() -> str:
    """"cuda" when a CUDA device is visible to this process, else "cpu"."""
    return "cuda" if is_cuda_available() else "cpu"


def get_torch_device():
    """The torch device module (torch.cuda, or torch.cpu) matching get_device_name()."""
    return getattr(torch, get_device_name())


def get_dist_backend() -> str:
    """torch.distributed backend for this device: nccl on CUDA, gloo on CPU."""
    return "nccl" if is_cuda_available() else "gloo"


def get_visible_devices_keyword() -> str:
    """The environment variable that restricts which accelerators a process sees."""
    return "CUDA_VISIBLE_DEVICES"
