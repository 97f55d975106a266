"""The settings every part of a run derives from the composed config, as typed sections built once.

    run = RunConfig.from_config(cfg)          # ConfigError listing every bad value of its sections
    run.pools.world_size, run.pools.layout()  # the FSDP world, the Ray pools per node
    run.algorithm.need_critic, run.protocol.prompt_bound, run.batches.micro_rows(key), ...

Each section reads its keys once, checks their types and ranges on construction (as veRL's
`ActorConfig` / `AlgoConfig` dataclasses do) and answers the questions the trainer, the workers,
preflight and the memory plans ask of the config; callers read attributes instead of re-deriving
them. Rules that tie several sections together (a micro-batch dividing the world size, TP inside a
node, ...) are the list in `verl/trainer/config_check.py`, which builds a RunConfig first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl.trainer.config_schema import OPTIONAL_TRAINER_KEYS, ConfigError
from verl.utils.tracking import BACKENDS as LOGGERS

PIPELINES = ("sync", "one_step_off", "async")
DEVICES = ("auto", "cuda", "cpu")

# One setting, two names: Search-R1's global micro-batch (rows over all workers) and veRL's
# `<key>_per_gpu` (rows per worker). Both default to null; set one. Both null: this many rows in all,
# split over the workers and rounded down, at least one per worker (default_micro_per_worker).
MICRO_BATCH_DEFAULTS: dict[str, int] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": 8,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": 128,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": 128,
    "critic.ppo_micro_batch_size": 8,
}
CRITIC_FORWARD_MICRO = "critic.forward_micro_batch_size"   # null: the critic's update micro-batch


def default_micro_per_worker(key: str, workers: int) -> int:
    """Rows per worker of a MICRO_BATCH_DEFAULTS key when neither of its names is set: the default
    rows in all, split over the workers (rounded down, at least one), so any world size works."""
    return max(1, MICRO_BATCH_DEFAULTS[key] // max(workers, 1))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _build(errors: list[str], section: Any, *args: Any) -> Any:
    """`section.from_config(*args)`, its ConfigError's messages added to `errors` (None then)."""
    try:
        return section.from_config(*args)
    except ConfigError as err:
        errors.extend(err.messages)
        return None


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("invalid trainer config:\n  - " + "\n  - ".join(errors), errors)


@dataclass(frozen=True)
class Pools:
    """Worker processes and how they split: one pool, or a pipelined run's train and rollout pools."""

    nnodes: int
    per_node: int
    pipeline: str = "sync"
    rollout_pool: int = 0          # workers of a pipelined run's rollout pool (trainer.rollout_pool); 0: sync
    max_staleness: int = 1

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Pools:
        trainer, errors = cfg.trainer, []
        nnodes, per_node = trainer.nnodes, trainer.n_gpus_per_node
        for key, value in (("nnodes", nnodes), ("n_gpus_per_node", per_node)):
            if not _is_int(value) or value < 1:
                errors.append(f"trainer.{key}={value!r} must be an int >= 1")
        pipeline = str(trainer.get("pipeline", "sync"))
        if pipeline not in PIPELINES:
            errors.append(f"trainer.pipeline={pipeline!r} is unknown; choose one of {list(PIPELINES)}")
        staleness = trainer.get("max_staleness", 1)
        if not _is_int(staleness) or staleness < 1:
            errors.append(f"trainer.max_staleness={staleness!r} must be an int >= 1")
        size = trainer.get("rollout_pool")
        if size is not None and not _is_int(size):
            errors.append(f"trainer.rollout_pool={size!r} must be an int (workers) or null")
        _raise(errors)
        total = nnodes * per_node
        rollout = 0 if pipeline == "sync" else (max(1, total // 2) if size is None else int(size))
        if pipeline != "sync":
            if not 1 <= rollout < total:
                errors.append(f"trainer.pipeline={pipeline} needs trainer.rollout_pool in 1..{total - 1} (one worker "
                              f"at least for each pool out of trainer.nnodes*trainer.n_gpus_per_node={total}); "
                              f"got {rollout}")
            elif nnodes > 1 and rollout % per_node != 0:
                errors.append(f"trainer.rollout_pool={rollout} on trainer.nnodes={nnodes}: the rollout pool takes "
                              f"whole nodes, a multiple of trainer.n_gpus_per_node={per_node}")
        _raise(errors)
        return cls(nnodes, per_node, pipeline, rollout, staleness)

    @property
    def total_workers(self) -> int:
        """Worker processes of the run: GPUs in total, or on a CPU-only machine the CPU workers."""
        return self.nnodes * self.per_node

    @property
    def pipelined(self) -> bool:
        """`trainer.pipeline` is one_step_off or async: separate rollout and train pools."""
        return self.pipeline != "sync"

    @property
    def world_size(self) -> int:
        """Worker processes that train (the FSDP world every batch size divides over): all of them,
        or with a pipeline the train pool's."""
        return self.total_workers - self.rollout_pool

    @property
    def rollout_world_size(self) -> int:
        """Worker processes that generate: every worker, or with a pipeline the rollout pool's."""
        return self.rollout_pool if self.pipelined else self.world_size

    @property
    def world_size_key(self) -> str:
        """The keys the world size comes from, for messages."""
        return ("the train pool trainer.nnodes*trainer.n_gpus_per_node-trainer.rollout_pool" if self.pipelined
                else "trainer.nnodes*trainer.n_gpus_per_node")

    def layout(self) -> dict[str, list[int]]:
        """Workers per node of each pool: {"global_pool": ...}, or with a pipeline {"train_pool": ...,
        "rollout_pool": ...}: on one node both share it; on several the rollout pool takes whole nodes."""
        if not self.pipelined:
            return {"global_pool": [self.per_node] * self.nnodes}
        if self.nnodes == 1:
            return {"train_pool": [self.per_node - self.rollout_pool], "rollout_pool": [self.rollout_pool]}
        rollout_nodes = self.rollout_pool // self.per_node
        return {"train_pool": [self.per_node] * (self.nnodes - rollout_nodes),
                "rollout_pool": [self.per_node] * rollout_nodes}


@dataclass(frozen=True)
class Protocol:
    """How the rollout talks to the retriever: the original's tags or native tool calls (veRL's recipe)."""

    do_search: bool
    tool: bool                     # actor_rollout_ref.rollout.multi_turn.enable
    prompt_bound: int              # tokens an initial prompt may have
    prompt_bound_key: str          # data.max_prompt_length (tool protocol) or data.max_start_length (tags)
    shuffle_train: bool            # data.shuffle_train_dataloader (Search-R1) or data.shuffle (veRL)
    serve_retriever: bool          # retriever.serve=ray: the driver runs the retriever on Ray Serve
    tool_config: Any = None        # the tool protocol's parsed tool YAML (search_r1.llm_agent.tools.ToolConfig)
    tool_config_path: str = ""

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Protocol:
        data, errors = cfg.data, []
        both = {key: data.get(key) for key in ("shuffle_train_dataloader", "shuffle")}
        if None not in both.values() and bool(both["shuffle"]) != bool(both["shuffle_train_dataloader"]):
            errors.append(f"data.shuffle={both['shuffle']} and data.shuffle_train_dataloader="
                          f"{both['shuffle_train_dataloader']} are one setting (veRL's and Search-R1's names) with "
                          "two values: set one of them")
        shuffle = next((bool(v) for v in (both["shuffle_train_dataloader"], both["shuffle"]) if v is not None), True)
        multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
        tool = bool(multi_turn.get("enable", False))
        key = "data.max_prompt_length" if tool else "data.max_start_length"
        serve = cfg.retriever.get("serve")
        if serve not in (None, "ray"):
            errors.append(f"retriever.serve={serve!r} is unknown; choose null (a server you run at retriever.url) "
                          "or ray")
        tool_config, path = None, str(multi_turn.get("tool_config_path") or "")
        if tool and path:
            from search_r1.llm_agent.tools import load_tool_config

            prefix = "actor_rollout_ref.rollout.multi_turn"
            try:
                tool_config = load_tool_config(path)
            except (OSError, ValueError) as exc:
                errors.append(f"{prefix}.tool_config_path: {exc}")
        _raise(errors)
        return cls(do_search=bool(cfg.do_search), tool=tool, prompt_bound=int(OmegaConf.select(cfg, key)),
                   prompt_bound_key=key, shuffle_train=shuffle, serve_retriever=serve == "ray",
                   tool_config=tool_config, tool_config_path=path)

    def uses_retrieval_server(self) -> bool:
        """False only in the tool protocol when no tool of the tool config talks to our retrieval server."""
        return not self.tool or self.tool_config is None or bool(self.tool_config.search) or any(
            o["config"].get("retrieval_service_url") for o in self.tool_config.others)

    def retrieval_endpoint(self, cfg: DictConfig) -> tuple[str, float, str, str]:
        """(url, timeout s, the setting's name, where it is set) of the retrieval server the rollouts query:
        `retriever.url` in the tag protocol; in the tool protocol the search tool's `retrieval_service_url`
        in the tool config (`multi_turn.tool_config_path`)."""
        if self.tool:
            # the search tool's server; without one (e.g. only MCP tools or web providers), an open tool's;
            # none at all: KeyError (nothing of ours to wait for, `uses_retrieval_server`)
            found = [self.tool_config.search] if self.tool_config.search else []
            found += [o["config"] for o in self.tool_config.others if o["config"].get("retrieval_service_url")]
            search = found[0] if found else {}
            return (str(search["retrieval_service_url"]), float(search.get("timeout", cfg.retriever.timeout)),
                    "retrieval_service_url", f"retrieval_service_url in {self.tool_config_path}")
        return str(cfg.retriever.url), float(cfg.retriever.timeout), "retriever.url", "retriever.url"


@dataclass(frozen=True)
class Algorithm:
    """What the algorithm needs: a critic, a reference policy, how many samples per prompt."""

    adv_estimator: str
    use_kl_loss: bool
    use_kl_in_reward: bool         # algorithm.use_kl_in_reward; null: unless the actor has a KL loss
    bypass: bool                   # rollout correction's bypass mode: the engine's log-probs are the old ones
    n_agent: int                   # actor_rollout_ref.rollout.n_agent (Search-R1)
    n: int                         # actor_rollout_ref.rollout.n (veRL)
    correction: Any = None         # rollout_correction.RolloutCorrectionConfig (`rollout_is: auto` resolved)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Algorithm:
        from verl.trainer.ppo import rollout_correction

        algo, rollout, errors = cfg.algorithm, cfg.actor_rollout_ref.rollout, []
        import verl.trainer.ppo.core_algos  # noqa: F401  (registers the built-in estimators)
        from verl.trainer.ppo.registry import adv_estimator_names

        if algo.adv_estimator not in adv_estimator_names():
            errors.append(f"algorithm.adv_estimator={algo.adv_estimator!r} is unknown; choose one of "
                          f"{list(adv_estimator_names())} (or register your own in custom_algorithms.path)")
        samples = {}
        for key in ("n_agent", "n"):
            value = rollout.get(key, 1)
            if not _is_int(value) or value < 1:
                errors.append(f"actor_rollout_ref.rollout.{key}={value!r} must be >= 1")
            samples[key] = value
        node = algo.get("rollout_correction")
        correction_errors = rollout_correction.config_errors(node)
        errors.extend(correction_errors)
        _raise(errors)
        pipelined = str(cfg.trainer.get("pipeline", "sync")) != "sync"
        correction = rollout_correction.RolloutCorrectionConfig.from_config(node, pipelined=pipelined)
        use_kl_loss = bool(cfg.actor_rollout_ref.actor.use_kl_loss)
        in_reward = (not use_kl_loss) if algo.use_kl_in_reward is None else bool(algo.use_kl_in_reward)
        return cls(adv_estimator=str(algo.adv_estimator), use_kl_loss=use_kl_loss, use_kl_in_reward=in_reward,
                   bypass=correction.bypass_old_logprob_for_rollout, n_agent=int(samples["n_agent"]),
                   n=int(samples["n"]), correction=correction)

    @property
    def need_critic(self) -> bool:
        from verl.trainer.ppo.advantage_estimators import NEEDS_CRITIC

        return self.adv_estimator in NEEDS_CRITIC

    @property
    def need_reference_policy(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def samples_per_prompt(self) -> int:
        """Rollouts per prompt: `rollout.n_agent` (Search-R1's key) times `rollout.n` (veRL's)."""
        return self.n_agent * self.n


def _ulysses_size(cfg: DictConfig, micro_key: str, ws: int) -> int:
    """The Ulysses SP size of the section a micro-batch key belongs to (critic.*: the critic's, else the
    actor's), where it is a valid divisor of the world (config_check reports any other), else 1."""
    section = "critic" if micro_key.startswith("critic.") else "actor_rollout_ref.actor"
    size = OmegaConf.select(cfg, f"{section}.ulysses_sequence_parallel_size", default=1)
    return size if _is_int(size) and size >= 1 and ws % size == 0 else 1


@dataclass(frozen=True)
class Batches:
    """Rows per step, per mini-batch and per micro-batch, over all workers of the train pool."""

    world_size: int
    rollouts_per_step: int         # every prompt of the batch, repeated samples_per_prompt times
    mini_rollouts: Mapping[str, int]          # role -> rows per optimizer step (actor, critic)
    optimizer_steps: Mapping[str, int]        # role -> optimizer steps per training step
    micro: Mapping[str, int] = field(default_factory=dict)        # micro-batch key -> rows over all workers
    micro_given_as: Mapping[str, str] = field(default_factory=dict)   # key -> how it was given, for messages

    @classmethod
    def from_config(cls, cfg: DictConfig, pools: Pools, algorithm: Algorithm) -> Batches:
        errors, ws = [], pools.world_size
        micro: dict[str, int] = {}
        given: dict[str, str] = {}
        for key in (*MICRO_BATCH_DEFAULTS, CRITIC_FORWARD_MICRO):
            value, per_gpu = OmegaConf.select(cfg, key), OmegaConf.select(cfg, f"{key}_per_gpu")
            if value is not None and per_gpu is not None:
                errors.append(f"{key}={value} and {key}_per_gpu={per_gpu} are both set: {key} counts rows over all "
                              f"workers (Search-R1), {key}_per_gpu rows per worker (veRL); set one of them")
            elif per_gpu is not None and (not _is_int(per_gpu) or per_gpu < 1):
                errors.append(f"{key}_per_gpu={per_gpu!r} must be an int >= 1 or null")
            given[key] = f"{key}_per_gpu*world_size" if per_gpu is not None else key
            dp = ws // _ulysses_size(cfg, key, ws)   # per-worker rows are per data-parallel rank (world / SP)
            if per_gpu is not None and _is_int(per_gpu):
                micro[key] = per_gpu * dp
            elif value is not None:
                micro[key] = int(value)
            elif key == CRITIC_FORWARD_MICRO:
                micro[key] = micro["critic.ppo_micro_batch_size"]
            else:
                micro[key] = default_micro_per_worker(key, dp) * dp
        _raise(errors)
        rollouts = int(cfg.data.train_batch_size) * algorithm.samples_per_prompt
        mini = {"actor": int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * algorithm.n,
                "critic": int(cfg.critic.ppo_mini_batch_size) * int(cfg.critic.get("rollout_n", 1))}
        epochs = {"actor": int(cfg.actor_rollout_ref.actor.ppo_epochs), "critic": int(cfg.critic.ppo_epochs)}
        steps = {role: epochs[role] * -(-rollouts // mini[role]) if mini[role] > 0 else 0 for role in mini}
        return cls(world_size=ws, rollouts_per_step=rollouts, mini_rollouts=mini, optimizer_steps=steps,
                   micro=micro, micro_given_as=given)

    def micro_rows(self, key: str) -> int:
        """Rows of one micro-batch over all workers for a MICRO_BATCH_DEFAULTS key (or
        `critic.forward_micro_batch_size`): `<key>_per_gpu` x workers when that is set, else `<key>`,
        else the default (the critic's forward pass: its update micro-batch)."""
        return self.micro[key]

    def micro_key(self, key: str) -> str:
        """How the micro-batch of `key` was given, for messages: `<key>_per_gpu*world_size` or `<key>`."""
        return self.micro_given_as[key]


@dataclass(frozen=True)
class Trainer:
    """The driver's own settings: device, loggers, the cluster to join, the optional trainer flags."""

    device: str
    loggers: tuple[str, ...]
    cluster_address: str | None    # trainer.ray_address, else RAY_ADDRESS, else None (a local Ray)
    val_only: bool = False
    val_before_train: bool = True
    preflight: bool = False
    pipeline_wait_for_sync: bool = False

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Trainer:
        trainer, errors = cfg.trainer, []
        loggers = (trainer.logger,) if isinstance(trainer.logger, str) else tuple(str(n) for n in trainer.logger)
        for name in loggers:
            if name not in LOGGERS:
                errors.append(f"trainer.logger contains unknown backend {name!r}; choose from {list(LOGGERS)}")
        if trainer.device not in DEVICES:
            errors.append(f"trainer.device={trainer.device!r} is unknown; choose auto, cuda or cpu")
        flags = {}
        for key, default in OPTIONAL_TRAINER_KEYS.items():
            value = OmegaConf.select(cfg, f"trainer.{key}", default=default)
            if not isinstance(value, type(default)):
                errors.append(f"trainer.{key}={value!r} must be a {type(default).__name__}")
            flags[key] = value
        _raise(errors)
        address = trainer.ray_address or os.environ.get("RAY_ADDRESS") or None
        return cls(device=str(trainer.device), loggers=loggers,
                   cluster_address=str(address) if address is not None else None, **flags)

    def on_cuda(self, has_gpu: bool | None) -> bool | None:
        """Whether the workers train on CUDA: `trainer.device` decides, or with `auto` whether the
        workers' host has GPUs (`has_gpu`; None when not known, e.g. validating on another machine)."""
        if self.device == "cuda":
            return True
        if self.device == "cpu":
            return False
        return has_gpu


@dataclass(frozen=True)
class RunConfig:
    """Every section of a run's derived settings, built and checked together."""

    pools: Pools
    protocol: Protocol
    algorithm: Algorithm
    batches: Batches
    trainer: Trainer
    sampling: Any = None           # dynamic_sampling.FilterGroups: algorithm.filter_groups, data.gen_batch_size (DAPO)
    shaping: Any = None            # reward_shaping.OverlongBuffer: reward_model.overlong_buffer (DAPO)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RunConfig:
        """Build every section; a ConfigError lists the problems of all of them (the batches, which
        divide by the pools and multiply the samples per prompt, only once those two are sound)."""
        errors: list[str] = []
        pools = _build(errors, Pools, cfg)
        protocol = _build(errors, Protocol, cfg)
        algorithm = _build(errors, Algorithm, cfg)
        trainer = _build(errors, Trainer, cfg)
        batches = _build(errors, Batches, cfg, pools, algorithm) if pools and algorithm else None
        from verl.trainer.ppo.dynamic_sampling import FilterGroups
        from verl.trainer.ppo.reward_shaping import OverlongBuffer

        sampling, shaping = _build(errors, FilterGroups, cfg), _build(errors, OverlongBuffer, cfg)
        _raise(errors)
        return cls(pools=pools, protocol=protocol, algorithm=algorithm, batches=batches, trainer=trainer,
                   sampling=sampling, shaping=shaping)
