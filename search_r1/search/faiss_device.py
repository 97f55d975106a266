"""Where a dense index is searched (FAISS on GPU or CPU): the launchers' one decision.

The original launcher always passed ``--faiss_gpu``. On a host whose FAISS is the CPU-only
build that flag cannot work, and dropping it quietly means a 21M x 768 Flat index (wiki-18,
e5) is scanned on CPU for every batch of every rollout turn. So on a GPU host a CPU-only
FAISS is an error unless the user asks for CPU search. The launchers
(``retrieval_launch.sh``) run

    python -m search_r1.search.faiss_device        # prints gpu or cpu, or exits 2 saying why

and add ``--faiss_gpu`` to the server's command line when it prints ``gpu``.

Environment:
  faiss_device               auto (default) | gpu | cpu -- the launchers' variable, like file_path;
                             cpu searches on CPU even on a GPU host
  SEARCH_R1_ASSUME_GPU_HOST  1: act as if this host had a GPU. For tests only (they check the
                             GPU-host decision on a machine without one); never set it in a job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

FAISS_DEVICES = ("auto", "gpu", "cpu")
ASSUME_GPU_HOST_ENV = "SEARCH_R1_ASSUME_GPU_HOST"
INSTALL_HINT = (
    "install FAISS with GPU support (pip uninstall faiss-cpu && pip install faiss-gpu-cu12, or "
    "conda install -c pytorch -c nvidia faiss-gpu; docs/retriever.md 'FAISS on GPU')"
)


class FaissDeviceError(RuntimeError):
    """The requested or implied FAISS device cannot be used on this host."""


def choose_faiss_device(has_gpu: bool, faiss_gpus: int, requested: str = "auto") -> str:
    """``"gpu"`` or ``"cpu"`` for searching a dense index; raises ``FaissDeviceError`` when the
    choice would silently be the wrong one.

    ``has_gpu``: this host has a GPU; ``faiss_gpus``: GPUs the installed FAISS sees
    (``faiss.get_num_gpus()``, 0 for the CPU-only build); ``requested``: ``faiss_device``.
    """
    if requested not in FAISS_DEVICES:
        raise ValueError(f"faiss_device must be one of {', '.join(FAISS_DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    if faiss_gpus > 0:
        return "gpu"
    if requested == "gpu":
        raise FaissDeviceError(f"faiss_device=gpu, but the installed FAISS sees no GPU; {INSTALL_HINT}")
    if has_gpu:
        raise FaissDeviceError(
            "this host has a GPU but the installed FAISS is the CPU-only build, so the dense index "
            f"would be searched on CPU (a wiki-18 Flat index: 21M x 768 scanned per batch); {INSTALL_HINT}, "
            "or set faiss_device=cpu to search on CPU anyway"
        )
    return "cpu"


def is_gpu_host() -> bool:
    """``nvidia-smi`` is installed or a GPU is visible to torch (``SEARCH_R1_ASSUME_GPU_HOST=1``: yes)."""
    if os.environ.get(ASSUME_GPU_HOST_ENV) == "1" or shutil.which("nvidia-smi") is not None:
        return True
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def faiss_gpu_count() -> int:
    """GPUs the installed FAISS can use (0 for the CPU-only build)."""
    import faiss

    return int(getattr(faiss, "get_num_gpus", lambda: 0)())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print gpu or cpu: where the launcher's FAISS index is searched.")
    p.add_argument("--requested", default=os.environ.get("faiss_device") or "auto",
                   help="auto | gpu | cpu (default: $faiss_device, else auto)")
    args = p.parse_args(argv)
    try:
        faiss_gpus = faiss_gpu_count()
        device = choose_faiss_device(faiss_gpus > 0 or is_gpu_host(), faiss_gpus, args.requested)
    except (FaissDeviceError, ValueError) as err:
        print(f"retrieval launcher: {err}", file=sys.stderr)
        return 2
    print(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
