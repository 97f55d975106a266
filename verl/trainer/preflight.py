"""Preflight: check a composed trainer config in seconds, with no Ray, worker or weights.

    python -m verl.trainer.main_ppo <the run's overrides...> +trainer.preflight=true
    bash train_grpo.sh <overrides...> +trainer.preflight=true        # through a launcher

The same entry point and overrides as the run, so the config is composed exactly as the run
would compose it. Checked: the cluster settings (`check_cluster_settings`), every
`validate_config` rule (keys, batch sizes, TP, the optional packages the run imports), and the
per-worker batch sizes the workers will compute (`normalize_actor_batch_sizes` /
`normalize_critic_batch_sizes` from verl/workers/fsdp_workers.py, called on copies) for
`trainer.nnodes x trainer.n_gpus_per_node` workers. Prints a short report; exit status 0 when
the run would start, 1 otherwise. scripts/slurm/ray_on_slurm.sh runs it before it starts any
Ray node or the retrieval server. Not checked yet: data files, the retriever, memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from verl.trainer import config_check as cc


@dataclass
class PreflightReport:
    """What preflight found: `lines` describe the run, `errors` say why it would not start."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        head = "preflight (no Ray, no workers, no weights):"
        tail = ("preflight OK" if self.ok else
                f"preflight FAILED ({len(self.errors)} problem(s)):\n  - " + "\n  - ".join(self.errors))
        return "\n".join([head, *(f"  {line}" for line in self.lines), tail])

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise cc.ConfigError(self.render())


def host_has_gpu(config: DictConfig) -> bool | None:
    """Whether the workers will have GPUs, as far as this machine can tell: `trainer.device`, else
    this machine's CUDA; None (unknown) when it has none but the run joins a cluster, whose
    nodes may (a CPU head node can drive a GPU cluster)."""
    device = config.trainer.device
    if device in ("cuda", "cpu"):
        return device == "cuda"
    from verl.utils.device import is_cuda_available

    if is_cuda_available():
        return True
    return None if cc.cluster_address(config) else False


def _per_worker_sizes(cfg: DictConfig, world: int, report: PreflightReport) -> None:
    """The workers' own division of the global batch sizes, on copies of their config sub-trees."""
    from verl.workers.fsdp_workers import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    role = "actor_rollout_ref" if cc.need_reference_policy(cfg) else "actor_rollout"
    actor = copy.deepcopy(cfg.actor_rollout_ref)
    try:
        normalize_actor_batch_sizes(actor, role, world)
        report.lines.append(
            f"actor per worker: mini-batch {actor.actor.ppo_mini_batch_size} rows, micro-batch "
            f"{actor.actor.ppo_micro_batch_size}, log-prob micro-batch {actor.rollout.log_prob_micro_batch_size}; "
            f"{cc.optimizer_steps_per_training_step(cfg)} optimizer step(s) per training step")
    except ValueError as exc:
        report.errors.append(f"actor worker batch sizes over {world} workers: {exc}")
    if cc.need_critic(cfg):
        critic = copy.deepcopy(cfg.critic)
        try:
            normalize_critic_batch_sizes(critic, world)
            report.lines.append(
                f"critic per worker: mini-batch {critic.ppo_mini_batch_size} rows, micro-batch "
                f"{critic.ppo_micro_batch_size}, forward micro-batch {critic.forward_micro_batch_size}; "
                f"{cc.optimizer_steps_per_training_step(cfg, 'critic')} optimizer step(s) per training step")
        except ValueError as exc:
            report.errors.append(f"critic worker batch sizes over {world} workers: {exc}")


def run_preflight(config: DictConfig, has_gpu: bool | None = None) -> PreflightReport:
    """Check `config` as the run would (on a resolved copy; `config` is not changed).

    `has_gpu`: whether the workers have GPUs; by default `host_has_gpu(config)`.
    """
    report = PreflightReport()
    try:
        cc.check_cluster_settings(config)
    except ValueError as exc:
        report.errors.append(str(exc))
    cfg = copy.deepcopy(config)
    OmegaConf.resolve(cfg)
    if has_gpu is None:
        has_gpu = host_has_gpu(cfg)
    trainer, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    world = cc.world_size(cfg)
    host = {True: "GPU", False: "CPU", None: "unknown from here (GPU-dependent checks skipped)"}[has_gpu]
    report.lines.append(f"workers: trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
                        f" = {world}; trainer.device={trainer.device}, host {host}; "
                        f"trainer.ray_address={trainer.ray_address}")
    engine = str(rollout.name)
    if engine == "auto" and has_gpu is not None:
        from verl.workers.rollout import resolve_rollout_name

        engine = f"auto -> {resolve_rollout_name('auto', has_gpu)}"
    report.lines.append(f"rollout: {engine}, mode={rollout.get('mode', 'sync')}, "
                        f"tensor_model_parallel_size={rollout.tensor_model_parallel_size}; "
                        f"{cfg.data.train_batch_size} prompts x {cc.samples_per_prompt(cfg)} samples = "
                        f"{cc.rollouts_per_step(cfg)} rollouts per step ({cfg.algorithm.adv_estimator})")
    report.lines.append(f"loggers: {', '.join(cc.logger_backends(cfg))}")
    if cfg.do_search:
        try:
            url, _, setting, _ = cc.retrieval_endpoint(cfg)
        except (OSError, ValueError):   # a bad tool config: config_errors below says what is wrong
            url, setting = "?", "retrieval_service_url"
        report.lines.append(f"retriever: {setting}={url} (not contacted here; the run waits up to "
                            f"retriever.health_wait_s={cfg.retriever.health_wait_s} s for its /health)")
    if cc.tool_protocol(cfg):
        mt = rollout.multi_turn
        report.lines.append(f"tool protocol: {mt.tool_config_path}; max_assistant_turns={mt.max_assistant_turns}, "
                            f"max_user_turns={mt.max_user_turns}; prompts <= data.max_prompt_length="
                            f"{cfg.data.max_prompt_length}, all turns <= data.max_response_length="
                            f"{cfg.data.max_response_length} tokens")
    report.errors.extend(cc.config_errors(cfg, has_gpu))
    if world >= 1:
        _per_worker_sizes(cfg, world, report)
    return report


def preflight_main(config: DictConfig) -> int:
    """`+trainer.preflight=true`: print the report; 0 when the run would start, else 1."""
    report = run_preflight(config)
    print(report.render(), flush=True)
    return 0 if report.ok else 1
