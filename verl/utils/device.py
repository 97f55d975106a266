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
    """torch.distributed backend: on CUDA, NCCL for CUDA tensors and gloo for CPU tensors
    (`"cpu:gloo,cuda:nccl"`), so a collective on a CPU tensor still works; gloo on CPU."""
    return dist_backend_for("cuda" if is_cuda_available() else "cpu")


def dist_backend_for(device: str | torch.device) -> str:
    """The process-group backend string for a process computing on `device`."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def empty_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the driver (no-op without CUDA).

    Called after offload, generation and reshard, so memory a phase freed is usable by
    another process on the same GPU (a faiss-gpu retrieval server, a colocated engine)."""
    if is_cuda_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    """Wait for the queued CUDA work of this process (no-op without CUDA)."""
    if is_cuda_available():
        torch.cuda.synchronize()


def get_visible_devices_keyword() -> str:
    """The environment variable that restricts which accelerators a process sees."""
    return "CUDA_VISIBLE_DEVICES"
