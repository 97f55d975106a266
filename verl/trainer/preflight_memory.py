"""Preflight's memory checks (verl/trainer/preflight.py runs them): the per-GPU plan
(verl/utils/memory_plan.py) plus `trainer.gpu_memory_reserve_gib` against `trainer.gpu_memory_gib`,
the per-node host plan (verl/utils/host_memory_plan.py) against `trainer.host_memory_gib`, and the
checkpoint folder's disk."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from verl.trainer.preflight_report import PreflightReport
    from verl.utils.memory_plan import MemoryPlan

# ray_on_slurm.sh sets it to "job": preflight runs on the job's first node, where the run writes.
JOB_RETRIEVER_ENV = "SEARCH_R1_PREFLIGHT_RETRIEVER"


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def device_memory_gib(cfg: DictConfig) -> tuple[float | None, str]:
    """(GiB per GPU, where it came from): trainer.gpu_memory_gib, else this machine's CUDA device. A
    card's marketed size ("80") is read as the GiB such a card exposes (memory_plan.EXPOSED_GIB)."""
    from verl.utils.memory_plan import EXPOSED_GIB

    value = OmegaConf.select(cfg, "trainer.gpu_memory_gib", default=None)
    if value is not None:
        gib = float(value)
        if gib in EXPOSED_GIB:
            return EXPOSED_GIB[gib], (f"trainer.gpu_memory_gib={gib:g}: an '{gib:g} GB' card exposes "
                                      f"{EXPOSED_GIB[gib]:g} GiB")
        return gib, "trainer.gpu_memory_gib"
    from verl.utils.device import is_cuda_available

    if is_cuda_available():
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 1024 ** 3, "this machine's GPU 0"
    return None, ""


def planned_elsewhere(cfg: DictConfig) -> bool:
    """Whether this check plans a GPU run on other machines: this one has no GPU, and the config says
    the workers will (`trainer.device=cuda`, or `trainer.gpu_memory_gib` given for the fits verdict).
    Outside the launcher's own job (ray_on_slurm.sh runs preflight on the job's first node)."""
    from verl.utils.device import is_cuda_available

    if os.environ.get(JOB_RETRIEVER_ENV) == "job" or is_cuda_available():
        return False
    return cfg.trainer.device == "cuda" or OmegaConf.select(cfg, "trainer.gpu_memory_gib", default=None) is not None


def gpu_reserve_gib(cfg: DictConfig, report: PreflightReport) -> float:
    """trainer.gpu_memory_reserve_gib: GiB per GPU every verdict keeps free (memory_plan.DEFAULT_GPU_RESERVE_GIB
    when unset); a bad value is an error naming the key (and the default is counted)."""
    from verl.utils.memory_plan import DEFAULT_GPU_RESERVE_GIB, RESERVE_KEY

    value = OmegaConf.select(cfg, RESERVE_KEY, default=None)
    if value is None:
        return DEFAULT_GPU_RESERVE_GIB
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = -1.0
    if isinstance(value, bool) or not gib >= 0:
        report.error(f"{RESERVE_KEY}={value!r} must be a number of GiB per GPU >= 0 (default "
                     f"{DEFAULT_GPU_RESERVE_GIB:g}: the CUDA context, NCCL and cuBLAS workspaces, allocator slack)",
                     RESERVE_KEY)
        return DEFAULT_GPU_RESERVE_GIB
    return gib


def check_memory_and_disk(cfg: DictConfig, report: PreflightReport) -> MemoryPlan | None:
    """The per-GPU plan against the GPU's memory (`fits`); the checkpoint folder and its disk (an
    error where the run writes its checkpoints, a warning when planning a GPU run from a machine
    without GPUs: its disk is not the run's). Returns the plan (None when there is none)."""
    from verl.utils.memory_plan import GIB, RESERVE_KEY, plan_memory

    ckpt_dir = Path(str(cfg.trainer.default_local_dir))
    parent = _existing_parent(ckpt_dir)
    if not os.access(parent, os.W_OK):
        report.error(f"trainer.default_local_dir={ckpt_dir}: {parent} is not writable: point it at a folder you "
                     "can write", "trainer.default_local_dir")
    try:
        gib, source = device_memory_gib(cfg)
    except (TypeError, ValueError):
        report.error(f"trainer.gpu_memory_gib={cfg.trainer.gpu_memory_gib!r} must be a number of GiB per GPU "
                     "(e.g. 80) or null", "trainer.gpu_memory_gib")
        gib, source = None, ""
    if gib is not None and gib <= 0:
        report.error(f"trainer.gpu_memory_gib={gib:g} must be > 0", "trainer.gpu_memory_gib")
        gib = None
    try:
        plan = plan_memory(cfg, device_gib=gib)
    except (OSError, ValueError, KeyError) as exc:
        if str(exc).startswith("actor_rollout_ref.model.target_modules"):   # LoRA the model cannot take (an MoE's experts)
            report.error(str(exc), "actor_rollout_ref.model.target_modules")
            return None
        key = "critic.model.path" if "critic" in str(exc) else "actor_rollout_ref.model.path"
        report.fits, report.fit_message = None, f"no memory plan: {key}: {exc}"
        return None
    report.memory_plan_gib = plan.phase_gib()
    name, largest = plan.largest()
    report.largest_phase = name
    active = plan.actor_active_params
    params = f"{plan.actor_params / 1e9:.2f} B params" + (
        f", {active / 1e9:.2f} B active" if active and active != plan.actor_params else "")
    report.lines.append(f"memory plan per GPU (model {params}, {plan.world} GPUs, rows "
                        f"of {plan.sequence_length} tokens): "
                        + ", ".join(f"{k} {v:.1f}" for k, v in report.memory_plan_gib.items()) + " GiB")
    for phase in plan.phases:
        if phase.name == name:
            report.lines.append(f"largest: {name} {largest:.1f} GiB" + _itemised(phase))
    report.lines.extend(f"note: {n}" for n in plan.notes)
    if gib is None:
        report.fits = None
        report.fit_message = ("set trainer.gpu_memory_gib (GiB per GPU, e.g. 80) for a fits verdict: this machine "
                              "has no GPU to read it from" + ("" if report.gpu_run else
                                                              "; CPU workers: no GPU memory applies"))
    else:
        reserve = report.gpu_reserve_gib = gpu_reserve_gib(cfg, report)
        need = max(p.total for p in plan.phases) / GIB + reserve
        report.fits = need <= gib
        report.fit_message = (f"largest phase {name} {largest:.1f} GiB + reserve {reserve:g} GiB ({RESERVE_KEY}: "
                              f"CUDA context, NCCL/cuBLAS workspaces, allocator slack) = {need:.1f} GiB "
                              f"{'<=' if report.fits else '>'} {gib:.1f} GiB ({source})")
        if not report.fits:
            report.fit_message += (": set actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload, "
                                   "more GPUs (trainer.n_gpus_per_node, trainer.nnodes), smaller micro-batches, "
                                   "or enable_gradient_checkpointing")
    if int(cfg.trainer.save_freq) > 0:
        each = plan.checkpoint_bytes(bool(cfg.trainer.save_hf_model))
        need = each * int(cfg.trainer.max_ckpt_to_keep)
        free = shutil.disk_usage(parent).free
        report.lines.append(f"checkpoints: {ckpt_dir}: {cfg.trainer.max_ckpt_to_keep} x {each / GIB:.1f} GiB = "
                            f"{need / GIB:.1f} GiB needed, {free / GIB:.1f} GiB free")
        if need > free:
            message = (f"trainer.max_ckpt_to_keep={cfg.trainer.max_ckpt_to_keep} checkpoints of {each / GIB:.1f} GiB "
                       f"need {need / GIB:.1f} GiB but {parent} has {free / GIB:.1f} GiB free")
            if planned_elsewhere(cfg):
                report.warn(f"{message} on this machine, which has no GPU and so is not where this GPU run writes "
                            f"them: give trainer.default_local_dir {need / GIB:.0f} GiB on the run's disk",
                            "trainer.max_ckpt_to_keep")
            else:
                report.error(f"{message}: lower it or point trainer.default_local_dir at a bigger disk",
                             "trainer.max_ckpt_to_keep")
    return plan


def _itemised(phase) -> str:
    """' = a 1.0 + b 2.0 (estimated)', with the peak that binds and the others when it has several."""
    from verl.utils.memory_plan import GIB

    parts = [f"{k} {v / GIB:.1f}" for k, v in phase.certain.items()]
    parts += [f"{k} {v / GIB:.1f} (estimated)" for k, v in phase.estimated.items()]
    text = " = " + " + ".join(parts)
    if phase.moments:
        others = ", ".join(f"{n} {m.total / GIB:.1f}" for n, m in phase.moments.items() if n != phase.binding)
        text = f" at its {phase.binding} ({others} GiB){text}"
    return text


HOST_KEY = "trainer.host_memory_gib"


def host_memory_gib(cfg: DictConfig, report: PreflightReport) -> float | None:
    """trainer.host_memory_gib (GiB per node), or None; a bad value is an error naming the key."""
    value = OmegaConf.select(cfg, "trainer.host_memory_gib", default=None)
    if value is None:
        return None
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = 0.0
    if isinstance(value, bool) or gib <= 0:
        report.error(f"trainer.host_memory_gib={value!r} must be a number of GiB per node > 0 (e.g. 2048) or null",
                     "trainer.host_memory_gib")
        return None
    return gib


def check_host_memory(cfg: DictConfig, report: PreflightReport, device_plan: MemoryPlan | None) -> None:
    """The per-node host plan (the node of global rank 0) against trainer.host_memory_gib: its figures
    always, and an error naming the phase and the key when it does not fit (null: against the node's
    memory, `node_memory_gib`, and the message says which; no verdict only from a machine that is not
    a node of the run)."""
    from verl.utils.host_memory_plan import host_fit, plan_host_memory

    gib = host_memory_gib(cfg, report)
    source = ""
    if gib is None and not any(e["key"] == HOST_KEY for e in report.errors):
        gib, source = node_memory_gib(cfg)   # null: the node's own memory, and say which
    # CPU workers compute on the host; a GPU memory size given means the plan is for GPU workers
    cpu_workers = not report.gpu_run and OmegaConf.select(cfg, "trainer.gpu_memory_gib", default=None) is None
    if cpu_workers and device_plan is None:
        return                                   # no config.json: check_memory_and_disk said so
    try:
        plan = plan_host_memory(cfg, cpu_workers=cpu_workers, device_plan=device_plan)
    except (OSError, ValueError, KeyError) as exc:
        report.host_message = f"no host memory plan: {exc}"
        return
    report.host_memory_plan_gib = plan.phase_gib()
    name, largest = plan.largest()
    report.host_largest_phase = name
    rollout = f" + {plan.rollout_ranks} rollout-pool ranks" if plan.rollout_ranks else ""
    report.lines.append(f"host memory plan per node (the node of global rank 0: {plan.train_ranks} worker ranks"
                        f"{rollout}): " + ", ".join(f"{k} {v:.1f}" for k, v in report.host_memory_plan_gib.items())
                        + " GiB")
    phase = next(p for p in plan.phases if p.name == name)
    report.lines.append(f"host largest: {name} {largest:.1f} GiB" + _itemised(phase))
    report.lines.extend(f"host note: {n}" for n in plan.notes)
    report.host_fits, report.host_message = host_fit(plan.phases, gib)
    if source:
        report.host_message += f" ({source})"
    if report.host_fits is False:
        report.error(report.host_message, HOST_KEY)


def on_a_gpu_node() -> bool:
    """Whether this machine is taken for a node of the run: it has a GPU (the launcher's job runs
    preflight on its first GPU node)."""
    from verl.utils.device import is_cuda_available

    return is_cuda_available()


def node_memory_gib(cfg: DictConfig) -> tuple[float | None, str]:
    """(GiB, where from) of a node's memory when trainer.host_memory_gib is null: this machine's where it is
    a node of the run (it has a GPU: the launcher's job runs preflight on its first node; preflight starts
    no Ray, so a Ray session this process may hold is not asked): the least of MemTotal (psutil), the
    cgroup's limit and Slurm's SLURM_MEM_PER_NODE, since a job is killed at its limit, not at the node's
    size; (None, why) otherwise: a machine without a GPU checks configs for GPU nodes elsewhere."""
    from verl.utils.memory_plan import GIB

    if not on_a_gpu_node():
        return None, (f"{HOST_KEY}=null and this machine has no GPU, so it is not taken for a node of the run: "
                      f"give {HOST_KEY} (GiB per node) for a verdict")
    total, source = machine_memory_bytes()
    return total / GIB, f"{HOST_KEY}=null: this machine's {source}, {total / GIB:.1f} GiB"


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory_bytes(environ: dict[str, str] | None = None, cgroup_files: tuple[str, ...] | None = None
                         ) -> tuple[int, str]:
    """(bytes, which) of the memory a job on this machine may use: the least of MemTotal (psutil), a cgroup
    memory limit (v2 memory.max, v1 memory.limit_in_bytes; "max" or a huge v1 value: none) and Slurm's
    SLURM_MEM_PER_NODE (MiB)."""
    import psutil

    environ = dict(os.environ) if environ is None else environ
    found = [(int(psutil.virtual_memory().total), "MemTotal (psutil)")]
    for path in CGROUP_LIMITS if cgroup_files is None else cgroup_files:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < found[0][0]:
            found.append((int(text), f"cgroup memory limit ({path})"))
    if str(environ.get("SLURM_MEM_PER_NODE", "")).isdigit():
        found.append((int(environ["SLURM_MEM_PER_NODE"]) * 1024 ** 2, "Slurm job's SLURM_MEM_PER_NODE"))
    return min(found)
