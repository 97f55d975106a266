"""The single controller: the PPO / GRPO loop, run in the driver, over Ray worker groups.

The driver sees the whole batch; heavy work (generation, log-probs, updates) is
dispatched to worker groups by registered methods. One step:

    prompts -> uid per prompt -> repeat n_agent * rollout.n (interleaved) -> generate (single turn, or the
    multi-turn search loop) -> response_mask -> balance across workers -> old log-prob ->
    ref log-prob -> values -> reward -> in-reward KL -> advantages -> critic update ->
    actor update -> validate (every test_freq) -> checkpoint (every save_freq)

Departures from the original Search-R1 trainer: the GRPO group key is a per-prompt
uuid (never a per-source index); validation is greedy, keeps every row and scores
with the training reward; checkpoints are atomic and carry the dataloader position,
driver RNG and KL-controller state, so a resumed run continues exactly.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, open_dict
from tqdm import tqdm

from verl.protocol import DataProto
from verl.trainer.config_schema import interpolations
from verl.trainer.ppo import checkpointing, core_algos, rollout_correction
from verl.trainer.ppo import metric_utils as mu
from verl.trainer.ppo.pool_sync import join_weight_sync, push_weights
from verl.trainer.run_config import Protocol, RunConfig
from verl.utils import batch_keys as K
from verl.utils.dataset.rl_dataset import RLHFDataset, build_dataloader
from verl.utils.tokenizer import eos_token_ids
from verl.utils.tracking import Tracking

logger = logging.getLogger(__name__)

GEN_INPUT_KEYS = (K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS)
# Tensors whose first P columns are the (left-padded) prompt.
PROMPT_ALIGNED_KEYS = (K.PROMPTS, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK)


def trim_shared_left_padding(batch: DataProto) -> DataProto:
    """Drop the prompt columns that are padding in every row.

    Prompts arrive left-padded to `data.max_prompt_length`; when the longest prompt of the
    batch is shorter, those columns are pure padding for every later forward pass (old and
    ref log-probs, values, updates). Cutting them changes no logit: positions come from the
    attention mask and padded keys are masked anyway.
    """
    prompt_mask = batch.batch[K.ATTENTION_MASK][:, : batch.batch[K.PROMPTS].shape[-1]]
    shared = int((prompt_mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-pad columns
    if shared == 0:
        return batch
    for key in PROMPT_ALIGNED_KEYS:
        if key in batch.batch.keys():
            batch.batch[key] = batch.batch[key][:, shared:].contiguous()
    return batch


class SearchFailureError(RuntimeError):
    """Too many of a rollout's searches failed (`retriever.max_failure_fraction`)."""


def check_search_failures(metrics: dict[str, float], config: DictConfig, where: str, prefix: str = "env/") -> None:
    """Stop the run when more than `retriever.max_failure_fraction` of a rollout's searches failed.

    A failed search is an observation the policy would be trained on (a failure notice instead of
    passages); a few are noise, most of a batch means the retrieval server is down or overloaded.
    `metrics` holds `<prefix>search_failure_fraction` (compute_env_metrics; absent without search).
    """
    fraction = metrics.get(f"{prefix}search_failure_fraction")
    limit = float(config.retriever.max_failure_fraction)
    if fraction is None or fraction <= limit:
        return
    from search_r1.search.client import RetrievalClient

    where_key = "retriever.url"
    url = str(config.retriever.url)
    protocol = Protocol.from_config(config)
    if protocol.serve_retriever:
        raise SearchFailureError(
            f"{prefix}search_failure_fraction={fraction:.3f} in the {where} exceeds retriever.max_failure_fraction="
            f"{limit:g}: the run stops instead of training on failed searches. The retrieval application "
            f"{config.retriever.serve_app_name!r} runs on Ray Serve (retriever.serve=ray): see `serve status` and its "
            "replicas' logs under the Ray session's logs/serve/")
    if protocol.tool:
        where_key = f"the search tool's retrieval_service_url ({protocol.tool_config_path})"
        url = str((protocol.tool_config.search or {}).get("retrieval_service_url", url))
    raise SearchFailureError(
        f"{prefix}search_failure_fraction={fraction:.3f} ({prefix}search_failures="
        f"{metrics.get(f'{prefix}search_failures', 0.0):g}) in the {where} exceeds "
        f"retriever.max_failure_fraction={limit:g}: the run stops instead of training on failed searches. "
        f"Check the retrieval server at {where_key}={url}: GET {RetrievalClient(url).health_url} and the "
        "server's log (retriever.max_failure_fraction=1.0 never stops)")


def _require_rollout_log_probs(batch: DataProto) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens (rollout correction, bypass mode), when they are
    the distribution the actor recomputes; a clear error otherwise."""
    if K.ROLLOUT_LOG_PROBS not in batch.batch.keys():
        raise RuntimeError("algorithm.rollout_correction needs the engine's log-probs of the sampled tokens, "
                           "and this rollout returned none")
    if not batch.meta_info.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True):
        raise RuntimeError(
            "algorithm.rollout_correction: vLLM returned log-probs renormalised over its top-p / top-k set "
            "(actor_rollout_ref.rollout.top_p < 1 or top_k > 0 at a temperature other than 1), not the "
            "distribution the actor recomputes; sample with top_p=1, top_k=-1 or turn the correction off")
    return batch.batch[K.ROLLOUT_LOG_PROBS]


def run_log_dir(config: DictConfig) -> Path:
    """Where the run's logs go: `trainer.log_dir`, else `<trainer.default_local_dir>/logs`."""
    trainer = config.trainer
    return Path(trainer.get("log_dir") or Path(trainer.default_local_dir) / "logs")


def generation_config(config: DictConfig, world_size: int) -> Any:
    """The generation manager's `GenerationConfig` for the trainer config.

    Tag protocol (the original's `<search>`): the data.* bounds per turn, `retriever.*`, `rollout.stop`.
    Tool protocol (`actor_rollout_ref.rollout.multi_turn.enable`, veRL's recipe): veRL's meanings —
    data.max_prompt_length bounds the prompt, data.max_response_length all turns and tool messages
    of a row together (also the cap of one turn), so the rolling context (prompt + that budget) is
    never cut; the search tool of `multi_turn.tool_config_path` gives the server, topk, timeout and
    concurrency (GenerationConfig splits the job-wide num_workers / rate_limit over the rollout
    workers); multi_turn.* bound the turns and
    tool answers. data.max_obs_length bounds one round of tool messages (tokens); max_turns is the
    tag protocol's and does not bound a tool-protocol row.
    """
    from search_r1.llm_agent.generation import GenerationConfig

    data, rollout = config.data, config.actor_rollout_ref.rollout
    protocol = Protocol.from_config(config)
    common = dict(
        max_turns=int(config.max_turns), max_obs_length=int(data.max_obs_length), num_gpus=world_size,
        no_think_rl=bool(config.algorithm.no_think_rl), retrieval_max_retries=int(config.retriever.max_retries),
        topk=int(config.retriever.topk), retrieval_timeout=float(config.retriever.timeout),
        mode=str(rollout.get("mode", "sync")),
        serve_app=str(config.retriever.serve_app_name) if protocol.serve_retriever else None)
    if not protocol.tool:
        return GenerationConfig(
            max_start_length=int(data.max_start_length), max_prompt_length=int(data.max_prompt_length),
            max_response_length=int(data.max_response_length), search_url=config.retriever.url,
            stop=tuple(rollout.stop), **common)
    multi_turn = rollout.multi_turn
    prompt, budget = int(data.max_prompt_length), int(data.max_response_length)
    # The search tool's url, topk and timeout replace retriever.*'s in GenerationConfig.__post_init__.
    return GenerationConfig(
        max_start_length=prompt, max_prompt_length=prompt + budget, max_response_length=budget,
        max_total_response_length=budget, protocol="tool", tool_config=protocol.tool_config.to_dict(),
        max_assistant_turns=multi_turn.max_assistant_turns, max_user_turns=multi_turn.max_user_turns,
        max_parallel_calls=int(multi_turn.max_parallel_calls),
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=str(multi_turn.tool_response_truncate_side), **common)


def rollout_pool_config(actor_rollout_ref: DictConfig) -> DictConfig:
    """A pipelined run's rollout workers' config: the actor_rollout_ref tree, with the vLLM engine kept
    awake between rollouts (`rollout.free_cache_engine=false`): no trainer shares those GPUs, and the
    engine's weights are the only copy there (pushes load into it; sleeping would discard them)."""
    config = copy.deepcopy(actor_rollout_ref)
    with open_dict(config):
        config.rollout.free_cache_engine = False
    return config


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


class RayPPOTrainer:
    """Owns the data, the worker groups, the reward functions, the logger and the step loop."""

    def __init__(
        self,
        config: DictConfig,
        tokenizer: Any,
        role_worker_mapping: dict[Role, type],
        resource_pool_manager: ResourcePoolManager,
        reward_fn: Any,
        val_reward_fn: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # One EOS set for the engine's stop ids and the manager's turn cut (verl/utils/tokenizer.py).
        self._eos_token_ids = eos_token_ids(tokenizer, config.actor_rollout_ref.model.path)
        self.role_worker_mapping = role_worker_mapping
        self.resource_pool_manager = resource_pool_manager
        self.reward_fn = reward_fn
        self.val_reward_fn = val_reward_fn
        # the run's derived settings, built once (verl/trainer/run_config.py)
        self.run = run = RunConfig.from_config(config)
        self.use_critic = run.algorithm.need_critic
        self.use_reference_policy = run.algorithm.need_reference_policy
        self.use_kl_in_reward = run.algorithm.use_kl_in_reward
        self.world_size = run.pools.world_size
        self.kl_ctrl = core_algos.get_kl_controller(config.algorithm.kl_ctrl)
        self.global_step = 0
        self.actor_rollout_wg: Any = None
        self._rollout_pool_wg: Any = None   # a pipelined run's rollout pool (see rollout_wg)
        self.critic_wg: Any = None
        self.pipelined = run.pools.pipelined
        # algorithm.rollout_correction bypass mode: old log-probs are the engine's, not recomputed
        self._bypass_old_log_prob = run.algorithm.bypass
        self.rollout_world_size = run.pools.rollout_world_size
        self._producer: Any = None      # a pipelined run's RolloutProducer while fit() runs
        self._rollout_version = 0       # pipelined: the steps done when the rollout pool's weights were sent
        self._trained_loader_state: dict[str, Any] | None = None   # pipelined: the batch last trained
        self.history: list[dict[str, float]] = []
        self._worker_groups: list[Any] = []
        self._gen_managers: dict[bool, Any] = {}
        self._create_dataloaders()
        self._flops_counter = self._make_flops_counter()
        self._peak_flops = 0.0   # per worker, asked of the workers once they exist (init_workers)

    # ------------------------------------------------------------------ setup
    def _create_dataloaders(self) -> None:
        data = self.config.data
        seed = int(data.get("seed", 1))
        # Tag protocol: prompts bounded by data.max_start_length; tool protocol (veRL): by data.max_prompt_length,
        # rendered with the tool schemas.
        protocol = self.run.protocol
        bound = protocol.prompt_bound
        tools = protocol.tool_config.schemas if protocol.tool else None
        common = dict(prompt_key=data.prompt_key, max_prompt_length=bound,
                      filter_overlong_prompts=data.filter_overlong_prompts, seed=seed,
                      truncation=str(data.get("truncation", "error")), tools=tools,
                      return_raw_chat=bool(data.get("return_raw_chat", False)))
        self.train_dataset = RLHFDataset(data.train_files, self.tokenizer, data_num=data.train_data_num, **common)
        self.val_dataset = RLHFDataset(data.val_files, self.tokenizer, data_num=data.val_data_num, **common)
        if len(self.train_dataset) < data.train_batch_size:
            raise ValueError(f"data.train_files: {len(self.train_dataset)} usable prompts, fewer than "
                             f"data.train_batch_size={data.train_batch_size}")
        self.train_dataloader = build_dataloader(self.train_dataset, data.train_batch_size, train=True,
                                                 seed=seed, shuffle=protocol.shuffle_train)
        self.val_dataloader = build_dataloader(self.val_dataset, data.val_batch_size, train=False)

        steps = len(self.train_dataloader) * int(self.config.trainer.total_epochs)
        if self.config.trainer.total_training_steps is not None:
            steps = min(steps, int(self.config.trainer.total_training_steps))
        self.total_training_steps = steps
        # The LR schedule (warm-up ratio, cosine) is sized by the trainer, before workers build optimizers.
        with open_dict(self.config):
            self.config.actor_rollout_ref.actor.optim.total_training_steps = steps
            self.config.critic.optim.total_training_steps = steps

    def _make_flops_counter(self) -> Any:
        try:
            from transformers import AutoConfig

            from verl.utils.flops_counter import FlopsCounter

            return FlopsCounter(AutoConfig.from_pretrained(self.config.actor_rollout_ref.model.path))
        except (ImportError, ValueError, OSError) as exc:
            logger.warning("perf/mfu/actor disabled: %s", exc)
            return None

    def init_workers(self) -> None:
        """Spawn the worker processes (actor+rollout+ref fused, critic colocated) and build the models."""
        from verl.single_controller.ray import (
            RayClassWithInitArgs,
            RayWorkerGroup,
            create_colocated_worker_cls,
        )

        self.resource_pool_manager.create_resource_pool()
        pool = self.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        actor_role = "actor_rollout_ref" if self.use_reference_policy else "actor_rollout"
        if self.pipelined:
            actor_role = "actor_ref" if self.use_reference_policy else "actor"
        configs = self.worker_configs()
        class_dict = {"actor_rollout": RayClassWithInitArgs(
            self.role_worker_mapping[Role.ActorRollout], config=configs["actor_rollout"], role=actor_role)}
        if self.use_critic:
            if self.resource_pool_manager.get_resource_pool(Role.Critic) is not pool:
                raise ValueError("the critic must share the actor's resource pool (colocated workers)")
            class_dict["critic"] = RayClassWithInitArgs(self.role_worker_mapping[Role.Critic], config=configs["critic"])
        worker_dict_cls = create_colocated_worker_cls(class_dict=class_dict)
        wg_dict = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker_dict_cls)
        spawned = wg_dict.spawn(prefix_set=class_dict.keys())
        self._worker_groups.append(wg_dict)
        if self.use_critic:
            self.critic_wg = spawned["critic"]
            self.critic_wg.init_model()
        # Actor last: with vLLM it sizes its KV cache from the memory left.
        self.actor_rollout_wg = spawned["actor_rollout"]
        self.actor_rollout_wg.init_model()
        if self.pipelined:
            self._init_rollout_pool(configs["actor_rollout"])
        if self._flops_counter is not None:
            self._peak_flops = min(self.actor_rollout_wg.device_peak_flops())

    @property
    def rollout_wg(self) -> Any:
        """The workers that generate: the actor's (sync), or a pipelined run's rollout pool."""
        return self._rollout_pool_wg if self._rollout_pool_wg is not None else self.actor_rollout_wg

    def _init_rollout_pool(self, config: DictConfig) -> None:
        """A pipelined run's rollout workers (role rollout: the engine alone, with the model's weights
        in its compute dtype; no FSDP copy, no optimizer) on their own pool, and the weight-sync group
        of the train pool's rank 0 and them. Pushes carry the engine's dtype (verl/workers/weight_sync.py)."""
        from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

        pool = self.resource_pool_manager.get_resource_pool(Role.Rollout)
        cls = RayClassWithInitArgs(self.role_worker_mapping[Role.Rollout], config=rollout_pool_config(config),
                                   role="rollout")
        self._rollout_pool_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls)
        self._worker_groups.append(self._rollout_pool_wg)
        self.rollout_wg.init_model()
        manifest = join_weight_sync(self.actor_rollout_wg, self.rollout_wg)
        logger.info("pipeline %s: train pool of %d worker(s), rollout pool of %d; a push sends %d tensors, %.3f GB in %s",
                    self.config.trainer.pipeline, self.world_size, self.rollout_wg.world_size, len(manifest.tensors),
                    manifest.nbytes / 1e9, manifest.dtype)

    def _push_weights(self) -> int:
        """The train pool's weights to the rollout pool; returns the bytes the sender broadcast."""
        return push_weights(self.actor_rollout_wg, self.rollout_wg)

    def worker_configs(self) -> dict[str, DictConfig]:
        """The config sub-trees the workers receive, by worker-group prefix; each must be resolved.

        The colocated actor and critic unpickle their sub-trees as one tree and divide their batch
        sizes in place: an interpolation left in the critic's (`${actor_rollout_ref.actor.
        ppo_mini_batch_size}`) would read the actor's already divided value. `run_ppo` resolves the
        whole config; this refuses a config that was not.
        """
        configs = {"actor_rollout": self.config.actor_rollout_ref}
        if self.use_critic:
            configs["critic"] = self.config.critic
        for name, node in configs.items():
            left = interpolations(node)
            if left:
                raise ValueError(f"the {name} worker config still holds interpolations {left[:3]}: "
                                 "call OmegaConf.resolve(config) before building the trainer (run_ppo does)")
        return configs

    def shutdown(self) -> None:
        """Kill the worker processes and give their bundles back (the Ray cluster may outlive us)."""
        for group in self._worker_groups:
            group.shutdown()
        self._worker_groups.clear()
        for pool in self.resource_pool_manager.resource_pool_dict.values():
            pool.release()

    # ------------------------------------------------------------------ generation
    def _gen_meta(self, validation: bool) -> dict[str, Any]:
        rollout = self.config.actor_rollout_ref.rollout
        meta = {
            K.META_EOS_TOKEN_ID: list(self._eos_token_ids),
            K.META_PAD_TOKEN_ID: self.tokenizer.pad_token_id,
            K.META_DO_SAMPLE: bool(rollout.do_sample) and not validation,
            K.META_TEMPERATURE: float(rollout.temperature),
            K.META_RESPONSE_LENGTH: int(self.config.data.max_response_length),
        }
        if self.config.do_search:
            meta[K.META_STOP] = list(rollout.stop)
        return meta

    def _generation_manager(self, validation: bool) -> Any:
        """One manager per mode, kept for the run so its retrieval client's connection pool is reused."""
        if validation in self._gen_managers:
            return self._gen_managers[validation]
        from search_r1.llm_agent.generation import LLMGenerationManager

        manager = LLMGenerationManager(tokenizer=self.tokenizer, actor_rollout_wg=self.rollout_wg,
                                       config=generation_config(self.config, self.rollout_world_size),
                                       is_validation=validation)
        self._gen_managers[validation] = manager
        return manager

    @contextmanager
    def _engines_awake(self, gen_meta: dict[str, Any] | None, validation: bool,
                       step: int | None = None) -> Iterator[None]:
        """The rollout engines awake for a whole rollout (every turn; every validation batch), asleep
        after it; the outermost phase records how often they woke in gen_meta['engine_wake_ups']
        (when a gen_meta is given).

        The rollout's seed follows the run seed and the step (a tensor-parallel engine's ranks reseed
        from it). On an error the engines are not put to sleep: a rank may be stuck in a collective
        with the one that failed, and a sleep call would queue behind it; the run is ending."""
        step = self.global_step if step is None else step
        seed = (int(self.config.actor_rollout_ref.rollout.seed) * 1_000_003 + 2 * step
                + int(validation)) % (2**31 - 1)
        self.rollout_wg.rollout_wake_up(seed)
        yield
        woke = [w for w in self.rollout_wg.rollout_sleep() if w is not None]
        if woke and gen_meta is not None:
            gen_meta["engine_wake_ups"] = max(woke)

    def _generate(self, batch: DataProto, validation: bool, step: int | None = None) -> tuple[DataProto, dict[str, Any]]:
        """Generate for every row of `batch` (for training step `step` + 1; default the current);
        returns (batch with the rollout keys, generation meta_info)."""
        gen_batch = batch.pop(batch_keys=list(GEN_INPUT_KEYS))
        gen_batch.meta_info = self._gen_meta(validation)
        phase_meta: dict[str, Any] = {}
        with self._engines_awake(phase_meta, validation, step):
            if self.config.do_search:
                # The prompt columns: data.max_start_length (tags) or data.max_prompt_length (tool protocol).
                bound = self.run.protocol.prompt_bound
                initial_input_ids = gen_batch.batch[K.INPUT_IDS][:, -bound:].clone()
                output = self._generation_manager(validation).run_llm_loop(gen_batch, initial_input_ids)
            else:
                # The worker group pads a batch that does not divide by its size (validation) and unpads.
                output = self.rollout_wg.generate_sequences(gen_batch)
        gen_meta = {**output.meta_info, **phase_meta}
        output.meta_info = {}
        batch = batch.union(output)
        batch.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = bool(
            gen_meta.get(K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR, True))
        batch = trim_shared_left_padding(batch)
        responses = batch.batch[K.RESPONSES]
        use_loss_mask = self.config.actor_rollout_ref.actor.state_masking and K.LOSS_MASK in batch.batch.keys()
        batch.batch[K.RESPONSE_MASK] = (batch.batch[K.LOSS_MASK] if use_loss_mask
                                        else batch.batch[K.ATTENTION_MASK][:, -responses.shape[-1]:]).long()
        return batch, gen_meta

    # ------------------------------------------------------------------ step pieces
    def _balance_batch(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """Reorder rows so each worker's contiguous chunk holds about the same number of tokens."""
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

        seqlens = batch.batch[K.ATTENTION_MASK].sum(-1).tolist()
        partitions = get_seqlen_balanced_partitions(seqlens, k_partitions=self.world_size, equal_size=True)
        order = [row for part in partitions for row in sorted(part)]
        batch.reorder(torch.tensor(order))
        loads = [sum(seqlens[i] for i in part) for part in partitions]
        metrics["perf/seqlen_balance_max_over_mean"] = float(max(loads) / max(np.mean(loads), 1e-9))

    def _compute_reward(self, batch: DataProto, metrics: dict[str, float]) -> None:
        scores_BR = self.reward_fn(batch)
        if isinstance(scores_BR, DataProto):
            scores_BR = scores_BR.batch[K.TOKEN_LEVEL_SCORES]
        batch.batch[K.TOKEN_LEVEL_SCORES] = scores_BR.float()
        metrics.update(getattr(self.reward_fn, "last_metrics", {}) or {})
        if self.use_kl_in_reward:
            kl_mask = batch.batch[K.RESPONSE_MASK]
            if self._bypass_old_log_prob and K.CONTEXT_CUT_MASK in batch.batch.keys():
                # the engine's log-prob of a token sampled from a cut context is not comparable with
                # the reference's over the whole sequence: no KL penalty there (the loss skips it too)
                kl_mask = kl_mask * (1 - batch.batch[K.CONTEXT_CUT_MASK].to(kl_mask.dtype))
            rewards_BR, kl_metrics = core_algos.apply_kl_penalty(
                batch.batch[K.TOKEN_LEVEL_SCORES], batch.batch[K.OLD_LOG_PROBS], batch.batch[K.REF_LOG_PROB],
                kl_mask, self.kl_ctrl, self.config.algorithm.kl_penalty)
            batch.batch[K.TOKEN_LEVEL_REWARDS] = rewards_BR
            metrics.update(kl_metrics)
        else:
            batch.batch[K.TOKEN_LEVEL_REWARDS] = batch.batch[K.TOKEN_LEVEL_SCORES]

    def _compute_advantage(self, batch: DataProto, trajectory_mask: torch.Tensor) -> None:
        """Advantages and returns. The recursions (GAE, REINFORCE++ returns) run over `trajectory_mask`,
        the response_mask as rolled out, so a rejected or cut token is still a step of the trajectory
        and an outcome reward on it still reaches the tokens before it; whitening and GRPO/RLOO group
        membership read response_mask as the losses will (after rejection and the cut-context mask),
        so tokens out of the loss do not move the advantages of the kept ones."""
        algo = self.config.algorithm
        advantages_BR, returns_BR = core_algos.compute_advantage(
            algo.adv_estimator, batch.batch[K.TOKEN_LEVEL_REWARDS], trajectory_mask,
            values=batch.batch[K.VALUES] if self.use_critic else None,
            index=batch.non_tensor_batch[K.UID], gamma=float(algo.gamma), lam=float(algo.lam),
            norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo), kept_mask=batch.batch[K.RESPONSE_MASK])
        batch.batch[K.ADVANTAGES] = advantages_BR
        batch.batch[K.RETURNS] = returns_BR

    def _reward_masks_advantages(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """Reward (and in-reward KL), then the loss masks (cut context, rollout-correction rejection),
        then advantages: rejection before advantages, as veRL, so their statistics read the kept
        tokens only (the recursions still run over the trajectory as rolled out)."""
        self._compute_reward(batch, metrics)
        trajectory_mask = batch.batch[K.RESPONSE_MASK]
        self._mask_cut_context(batch, metrics)
        self._apply_rollout_correction(batch, metrics)
        self._compute_advantage(batch, trajectory_mask)

    def _mask_cut_context(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """Keep tokens sampled from a cut rolling context out of the actor and critic updates.

        When the rolling context dropped old turns, the policy sampled the later tokens from a
        shorter context than the full sequence that old log-probs, values and the update see, so
        their PPO ratio is not an importance ratio of the sampling policy. Advantages are computed
        after, with those tokens still steps of the recursion (the reward sits on the last policy
        token) but out of the whitening statistics; the losses skip them.
        """
        if K.CONTEXT_CUT_MASK not in batch.batch.keys():
            return
        cut_BR = batch.batch[K.CONTEXT_CUT_MASK].to(batch.batch[K.RESPONSE_MASK].dtype)
        response_mask = batch.batch[K.RESPONSE_MASK]
        metrics["env/context_cut_masked_tokens"] = float((response_mask * cut_BR).sum())
        batch.batch[K.RESPONSE_MASK] = response_mask * (1 - cut_BR)

    def _apply_rollout_correction(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """algorithm.rollout_correction: IS weights (pi_old / pi_rollout) for the actor's policy loss
        and rejected tokens out of response_mask (so out of the losses and, computed next, out of the
        advantages' statistics), from the engine's log-probs and the actor's recomputed ones. A
        pipelined run's `rollout_is: auto` (the default) is token IS unless another correction is
        chosen (RolloutCorrectionConfig.from_config)."""
        cfg = rollout_correction.RolloutCorrectionConfig.from_config(
            self.config.algorithm.get("rollout_correction"), pipelined=self.pipelined)
        if not cfg.enabled:
            return
        _require_rollout_log_probs(batch)
        # ratios over the tokens the engine sampled (loss_mask), also when state_masking=false puts
        # observations in response_mask
        policy = batch.batch[K.LOSS_MASK] if K.LOSS_MASK in batch.batch.keys() else None
        corr = rollout_correction.compute_rollout_correction(
            batch.batch[K.OLD_LOG_PROBS], batch.batch[K.ROLLOUT_LOG_PROBS], batch.batch[K.RESPONSE_MASK], cfg,
            policy_mask=policy)
        batch.batch[K.RESPONSE_MASK] = corr.response_mask
        if corr.weights is not None:
            batch.batch[K.ROLLOUT_IS_WEIGHTS] = corr.weights
        metrics.update(corr.metrics)

    def _mfu(self, batch: DataProto, seconds: float) -> dict[str, float]:
        if self._flops_counter is None or seconds <= 0 or not self._peak_flops:
            return {}
        seqlens = batch.batch[K.ATTENTION_MASK].sum(-1).tolist()
        achieved = self._flops_counter.estimate_step_flops(seqlens) / seconds
        epochs = int(self.config.actor_rollout_ref.actor.ppo_epochs)
        return {"perf/mfu/actor": achieved * epochs / (self._peak_flops * self.world_size)}

    def _update_metrics(self, worker_metrics: dict[str, Any], role: str) -> dict[str, float]:
        """Reduce an update's metrics; add `<role>/optimizer_steps`, the optimizer steps each worker took.

        Every rank appends one `<role>/grad_norm` per mini-batch (per PPO epoch), and the worker
        group concatenates the ranks' lists.
        """
        metrics = mu.reduce_metrics(worker_metrics)
        norms = worker_metrics.get(f"{role}/grad_norm")
        if norms is not None:
            metrics[f"{role}/optimizer_steps"] = len(norms) / self.world_size
        return metrics

    def train_step(self, batch: DataProto) -> dict[str, float]:
        """One PPO/GRPO iteration on one dataloader batch (prompts only); returns its metrics."""
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        with mu.timer("step", timing):
            batch = self._rollout(batch, self.global_step, metrics, timing)
            batch = self._train_on(batch, metrics, timing)
        return self._step_metrics(batch, metrics, timing)

    def _rollout(self, batch: DataProto, step: int, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """The rollout of training step `step` + 1: each prompt repeated, generated (searches and all)."""
        samples = self.run.algorithm.samples_per_prompt
        # uid before repeating: the samples of one prompt share it (the GRPO group).
        batch.non_tensor_batch[K.UID] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        batch = batch.repeat(repeat_times=samples, interleave=True)
        with mu.timer("gen", timing):
            batch, gen_meta = self._generate(batch, validation=False, step=step)
        metrics.update(mu.compute_env_metrics(gen_meta))
        metrics.update(mu.compute_rollout_metrics(gen_meta))
        check_search_failures(metrics, self.config, f"rollout of training step {step + 1}")
        return batch

    def _train_on(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> DataProto:
        """The rest of a step on a rolled-out batch: log-probs, values, reward, advantages, updates,
        then validation and checkpoint when due. Advances global_step; returns the batch with all keys."""
        if self.config.trainer.balance_batch:
            self._balance_batch(batch, metrics)
        batch.meta_info[K.META_GLOBAL_TOKEN_NUM] = batch.batch[K.ATTENTION_MASK].sum(-1).tolist()
        if self._bypass_old_log_prob:
            # bypass mode: the engine's log-probs are the PPO anchor; no forward for old log-probs
            batch.batch[K.OLD_LOG_PROBS] = _require_rollout_log_probs(batch).float().clone()
        else:
            with mu.timer("old_log_prob", timing):
                batch = batch.union(self.actor_rollout_wg.compute_log_prob(batch))
            metrics.update(mu.compute_rollout_log_prob_gap(batch))
        if self.use_reference_policy:
            with mu.timer("ref", timing):
                batch = batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
        if self.use_critic:
            with mu.timer("values", timing):
                batch = batch.union(self.critic_wg.compute_values(batch))
        with mu.timer("adv", timing):
            self._reward_masks_advantages(batch, metrics)
        if self.use_critic:
            with mu.timer("update_critic", timing):
                critic_out = self.critic_wg.update_critic(batch)
            metrics.update(self._update_metrics(critic_out.meta_info[K.META_METRICS], "critic"))
        # Steps count from 1 (global_step + 1 is this step), as in veRL and Search-R1: the actor
        # sits out the first critic_warmup - 1 steps.
        # A pipelined run sends no weights between the update and the step count that names them.
        with self._updating():
            if self.global_step + 1 >= int(self.config.trainer.critic_warmup):
                with mu.timer("update_actor", timing):
                    actor_out = self.actor_rollout_wg.update_actor(batch)
                metrics.update(self._update_metrics(actor_out.meta_info[K.META_METRICS], "actor"))
                metrics.update(self._mfu(batch, timing["update_actor"]))
            self.global_step += 1
            if self._producer is not None:
                self._producer.step_done(self.global_step)
        is_last = self.global_step >= self.total_training_steps
        test_freq = int(self.config.trainer.test_freq)
        val_metrics: dict[str, float] = {}
        if self.val_reward_fn is not None and test_freq > 0 and (is_last or self.global_step % test_freq == 0):
            with mu.timer("testing", timing):
                val_metrics = self._validate()
            metrics.update(val_metrics)
        save_freq = int(self.config.trainer.save_freq)
        if save_freq > 0 and (is_last or self.global_step % save_freq == 0):
            with mu.timer("save_checkpoint", timing):
                self.save_checkpoint()
        # After the checkpoint: this step trained on good searches; the failing server stops what follows.
        check_search_failures(val_metrics, self.config, f"validation at step {self.global_step}", "val/env/")
        return batch

    def _step_metrics(self, batch: DataProto, metrics: dict[str, float], timing: dict[str, float]) -> dict[str, float]:
        metrics.update(mu.compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(mu.compute_timing_metrics(batch, timing))
        metrics.update(mu.compute_throughput_metrics(batch, timing, self.world_size))
        return metrics

    def _updating(self) -> Any:
        """Around an actor update and the step count after it: a pipelined run pushes no weights meanwhile."""
        return self._producer.updating() if self._producer is not None else nullcontext()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> dict[str, float]:
        """Greedy generation on every validation row; mean score per data source."""
        scores: list[torch.Tensor] = []
        sources: list[str] = []
        gen_metrics: list[dict[str, float]] = []
        # One wake for the whole validation pass, not one per batch (or per turn); a pipelined run's
        # rollout pool between two rollouts, with the newest weights.
        pool = self._producer.rollout_pool() if self._producer is not None else nullcontext()
        with pool, self._engines_awake(None, validation=True):
            for batch in tqdm(self.val_dataloader, desc="validation", unit="batch", leave=False,
                              disable=not self.config.trainer.progress_bar):
                batch.non_tensor_batch[K.UID] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
                batch, gen_meta = self._generate(batch, validation=True)
                gen_metrics.append(mu.compute_env_metrics(gen_meta))
                scores_BR = self.val_reward_fn(batch)
                if isinstance(scores_BR, DataProto):
                    scores_BR = scores_BR.batch[K.TOKEN_LEVEL_SCORES]
                scores.append(scores_BR.sum(-1).float().cpu())
                sources.extend(batch.non_tensor_batch[K.DATA_SOURCE].tolist())
        if not scores:
            return {}
        metrics = mu.score_by_data_source(torch.cat(scores), sources)
        for key in {k for m in gen_metrics for k in m}:
            values = [m[key] for m in gen_metrics if key in m]
            metrics[f"val/{key}"] = float(np.mean(values))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    _checked_checkpoint_root: str | None = None   # the root every rank was seen writing into

    def verify_checkpoint_root(self) -> None:
        """Before the first save or load: every rank writes a marker into trainer.default_local_dir
        and this driver must see them all (verl/utils/checkpoint/shared_dir.py); SharedDirError
        naming the ranks and the key otherwise. Once per root."""
        from verl.utils.checkpoint.shared_dir import verify_shared_dir

        root = str(self.config.trainer.default_local_dir)
        if self._checked_checkpoint_root == root:
            return
        verify_shared_dir(root, self.actor_rollout_wg.write_checkpoint_probe)
        self._checked_checkpoint_root = root

    def save_checkpoint(self) -> Path:
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir)
        self.verify_checkpoint_root()
        tmp = checkpointing.begin_checkpoint(root, self.global_step)
        hf_path = str(tmp / "hf") if trainer.save_hf_model else None
        self.actor_rollout_wg.save_checkpoint(str(tmp / "actor"), self.global_step, hf_path)
        if self.use_critic:
            self.critic_wg.save_checkpoint(str(tmp / "critic"), self.global_step)
        # A pipelined run has drawn batches beyond the one trained: it records the position after that one.
        loader_state = (self._trained_loader_state if self._trained_loader_state is not None
                        else self.train_dataloader.state_dict())
        checkpointing.save_driver_state(tmp, self.global_step, loader_state,
                                        extra={"kl_coef": self.kl_ctrl.value})
        return checkpointing.finalize_checkpoint(root, self.global_step, int(trainer.max_ckpt_to_keep))

    def load_checkpoint(self) -> Path | None:
        """Resume per trainer.resume_mode; returns the folder loaded, or None for a fresh start."""
        trainer = self.config.trainer
        if int(trainer.save_freq) > 0:
            # at start-up, not after the first save_freq steps: a run that could never resume stops now
            self.verify_checkpoint_root()
        folder = checkpointing.find_resume_dir(trainer.default_local_dir, str(trainer.resume_mode))
        if folder is None:
            return None
        self.verify_checkpoint_root()   # the workers read their shards from where this driver found them
        state = checkpointing.load_driver_state(folder)
        try:
            self.actor_rollout_wg.load_checkpoint(str(folder / "actor"))
            if self.use_critic:
                self.critic_wg.load_checkpoint(str(folder / "critic"))
        except Exception as err:
            import ray

            if not isinstance(err, ray.exceptions.RayTaskError):
                raise   # a dead worker is explained by fit()
            raise RuntimeError(checkpointing.load_failure_message(folder, err)) from err
        self.global_step = state.global_step
        self.train_dataloader.load_state_dict(state.dataloader_state)
        checkpointing.restore_rng_state(state.rng_state)
        if "kl_coef" in state.extra:
            self.kl_ctrl.value = float(state.extra["kl_coef"])
        logger.info("resumed from %s at global_step %d", folder, self.global_step)
        return folder

    def _worker_death(self, err: BaseException) -> tuple[Exception, BaseException] | None:
        """A worker process's death (Ray's ActorDiedError, or the worker group's WorkerDiedError) as
        (an error naming its role, rank, pid and node, the last complete checkpoint and how to
        resume; Ray's original error, its cause); None for any other error."""
        from verl.single_controller.ray import WorkerDiedError, worker_death

        groups = [self.actor_rollout_wg, self.critic_wg]
        if self.rollout_wg is not self.actor_rollout_wg:
            groups.append(self.rollout_wg)
        death = worker_death(err, groups)
        if death is None:
            return None
        # The group's WorkerDiedError was raised from Ray's error: that one stays the cause.
        cause = err.__cause__ if isinstance(err, WorkerDiedError) and err.__cause__ is not None else err
        return WorkerDiedError(f"{death}. {self._resume_hint()}", death.place), cause

    def _resume_hint(self) -> str:
        """Where a new run of the same command would continue from, and what to pass for it."""
        trainer = self.config.trainer
        root = Path(trainer.default_local_dir).absolute()
        latest = checkpointing.latest_checkpoint(root)
        if latest is None:
            save_freq = int(trainer.save_freq)
            why = (f"trainer.save_freq={save_freq}" if save_freq > 0
                   else f"trainer.save_freq={save_freq} saves none; set trainer.save_freq=N to save every N steps")
            return (f"Last complete checkpoint: none under {root} ({why}); running the same command "
                    "starts again from step 0.")
        where = f"Last complete checkpoint: {latest} (step {checkpointing.step_of(latest)})."
        mode = str(trainer.resume_mode)
        if mode == "auto":
            return f"{where} Running the same command resumes from it (trainer.resume_mode=auto)."
        return (f"{where} To resume from it, run the same command with trainer.resume_mode=auto "
                f"(or trainer.resume_mode={latest}); this run had trainer.resume_mode={mode}.")

    # ------------------------------------------------------------------ pipeline
    def _drawn_batches(self) -> Iterator[tuple[DataProto, dict[str, Any]]]:
        """Every training batch from the dataloader's position on, epoch after epoch, each with the
        dataloader's state right after it was drawn."""
        while True:
            for batch in self.train_dataloader:
                yield batch, self.train_dataloader.state_dict()

    def _fit_pipelined(self, tracker: Tracking, bar: Any) -> None:
        """trainer.pipeline=one_step_off|async: the producer rolls out on the rollout pool while this
        thread trains (verl/trainer/ppo/pipeline.py)."""
        from verl.trainer.ppo.pipeline import RolloutProducer, staleness_bound

        bound = staleness_bound(self.config)
        self._producer = producer = RolloutProducer(self._rollout, self._push_weights, self.global_step,
                                                    self.total_training_steps, bound, self._rollout_version)
        if bool(self.config.actor_rollout_ref.rollout.get("partial", False)):
            # partial rollout: newer weights reach the rollout in flight between two turns
            self._generation_manager(validation=False).turn_version = producer.refresh
        producer.start(self._drawn_batches())
        clock = mu.StepClock()
        while self.global_step < self.total_training_steps:
            item, train_idle = producer.next_batch()
            if item is None:
                break
            if self.global_step - item.version > bound:
                producer.stats.dropped += 1
                logger.warning("dropped batch %d: sampled by version %d, %d steps stale (bound %d)", item.index,
                               item.version, self.global_step - item.version, bound)
                continue
            metrics, timing = item.metrics, item.timing
            metrics.update(producer.metrics(item, self.global_step, train_idle))
            self._trained_loader_state = item.loader_state
            with mu.timer("step", timing):
                batch = self._train_on(item.batch, metrics, timing)
            metrics = self._step_metrics(batch, metrics, timing)
            metrics["train/epoch"] = float((self.global_step - 1) // len(self.train_dataloader))
            metrics.update(clock.lap())
            tracker.log(metrics, step=self.global_step)
            self.history.append({"step": self.global_step, **metrics})
            bar.update(1)

    # ------------------------------------------------------------------ loop
    def _tracker(self) -> Tracking:
        trainer = self.config.trainer
        backends = [trainer.logger] if isinstance(trainer.logger, str) else list(trainer.logger)
        return Tracking(trainer.project_name, trainer.experiment_name, backends,
                        config=self.config, log_dir=str(run_log_dir(self.config)))

    def fit(self) -> list[dict[str, float]]:
        """Train until total_training_steps; returns the per-step metrics (also sent to the loggers)."""
        tracker = self._tracker()
        try:
            if self.load_checkpoint() is not None and self.pipelined:
                # the rollout pool still holds the model's own weights: validation and rollouts need the checkpoint's
                self._push_weights()
                self._rollout_version = self.global_step
            val_only = self.run.trainer.val_only
            if self.val_reward_fn is not None and (val_only or self.run.trainer.val_before_train):
                val_metrics = self._validate()
                check_search_failures(val_metrics, self.config, f"validation at step {self.global_step}", "val/env/")
                tracker.log(val_metrics, step=self.global_step)
                self.history.append({"step": self.global_step, **val_metrics})
            if val_only:
                return self.history
            bar = tqdm(total=self.total_training_steps, initial=self.global_step, desc="training steps",
                       disable=not self.config.trainer.progress_bar)
            if self.pipelined:
                self._fit_pipelined(tracker, bar)
            clock = mu.StepClock()
            while self.global_step < self.total_training_steps:
                for batch in self.train_dataloader:
                    metrics = self.train_step(batch)
                    metrics["train/epoch"] = float((self.global_step - 1) // len(self.train_dataloader))
                    # from the previous step's end (the same clock as a pipelined run's steps)
                    metrics.update(clock.lap())
                    tracker.log(metrics, step=self.global_step)
                    self.history.append({"step": self.global_step, **metrics})
                    bar.update(1)
                    if self.global_step >= self.total_training_steps:
                        break
            bar.close()
            return self.history
        except Exception as err:
            death = self._worker_death(err)
            if death is None:
                raise
            raise death[0] from death[1]
        finally:
            if self._producer is not None:
                self._producer.stop()
            tracker.finish()
