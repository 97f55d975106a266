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

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, open_dict
from tqdm import tqdm

from verl.protocol import DataProto
from verl.trainer.config_agent import uses_own_loops
from verl.trainer.config_schema import interpolations
from verl.trainer.ppo import core_algos, remax, rollout_correction
from verl.trainer.ppo import metric_utils as mu
from verl.trainer.ppo.checkpointing import CheckpointedTraining
from verl.trainer.ppo.dumps import DumpConfig, TrajectoryDumps
from verl.trainer.ppo.dynamic_sampling import DynamicSamplingTraining
from verl.trainer.ppo.pipeline import PipelinedTraining
from verl.trainer.ppo.registry import worker_config_with_custom_algorithms
from verl.trainer.ppo.resource_pools import ResourcePoolManager, Role
from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts
from verl.trainer.ppo.rollout_setup import (
    GEN_INPUT_KEYS,
    ValKwargs,
    check_search_failures,
    generation_config,
    trim_shared_left_padding,
)
from verl.trainer.ppo.validation_metrics import rows_infos, validation_metrics
from verl.trainer.run_config import RunConfig
from verl.utils import batch_keys as K
from verl.utils.dataset.rl_dataset import RLHFDataset, build_dataloader, chat_template_kwargs
from verl.utils.profiler import ProfilerConfig, StepProfiler
from verl.utils.tokenizer import eos_token_ids
from verl.utils.tracking import Tracking

logger = logging.getLogger(__name__)

def run_log_dir(config: DictConfig) -> Path:
    """Where the run's logs go: `trainer.log_dir`, else `<trainer.default_local_dir>/logs`."""
    trainer = config.trainer
    return Path(trainer.get("log_dir") or Path(trainer.default_local_dir) / "logs")


# the LLM judge's counters summed over a validation pass (as val/reward/judge_*)
JUDGE_COUNTS = ("reward/judge_items", "reward/judge_calls", "reward/judge_cache_hits", "reward/judge_failures")


class RayPPOTrainer(PipelinedTraining, CheckpointedTraining, DynamicSamplingTraining):
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
        # trainer.rollout_data_dir / validation_data_dir: the step files the viewer reads (dumps.py)
        self.dumps = TrajectoryDumps(DumpConfig.from_config(config), tokenizer, frozenset(self._eos_token_ids))
        self._worker_groups: list[Any] = []
        self._gen_managers: dict[bool, Any] = {}
        # global_profiler (tool torch): chrome traces of the chosen steps, driver and workers (verl/utils/profiler.py)
        self._profiler = StepProfiler(ProfilerConfig.from_config(config), self._profiled_groups)
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
                      chat_template_kwargs=chat_template_kwargs(self.config),
                      return_raw_chat=bool(data.get("return_raw_chat", False)) or uses_own_loops(self.config))
        self.train_dataset = RLHFDataset(data.train_files, self.tokenizer, data_num=data.train_data_num, **common)
        self.val_dataset = RLHFDataset(data.val_files, self.tokenizer, data_num=data.val_data_num, **common)
        # dynamic sampling (algorithm.filter_groups) draws data.gen_batch_size prompts per generation batch
        loader_batch, loader_key = self.run.sampling.gen_batch_size, "data.gen_batch_size"
        if not self.run.sampling.enable or loader_batch == data.train_batch_size:
            loader_key = "data.train_batch_size"
        if len(self.train_dataset) < loader_batch:
            raise ValueError(f"data.train_files: {len(self.train_dataset)} usable prompts, fewer than "
                             f"{loader_key}={loader_batch}")
        self.train_dataloader = build_dataloader(self.train_dataset, loader_batch, train=True,
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

    def worker_configs(self) -> dict[str, DictConfig]:
        """The config sub-trees the workers receive, by worker-group prefix; each must be resolved.

        The colocated actor and critic unpickle their sub-trees as one tree and divide their batch
        sizes in place: an interpolation left in the critic's (`${actor_rollout_ref.actor.
        ppo_mini_batch_size}`) would read the actor's already divided value. `run_ppo` resolves the
        whole config; this refuses a config that was not.
        """
        configs = {"actor_rollout": worker_config_with_custom_algorithms(
            self.config.actor_rollout_ref, self.config.get("custom_algorithms", {}).get("path"))}
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
    def _gen_meta(self, validation: bool, greedy: bool = False) -> dict[str, Any]:
        """A generate call's meta_info: the rollout's sampling; greedy for ReMax's baseline (`greedy`);
        for validation, rollout.val_kwargs' (greedy by default)."""
        rollout = self.config.actor_rollout_ref.rollout
        meta = {
            K.META_EOS_TOKEN_ID: list(self._eos_token_ids),
            K.META_PAD_TOKEN_ID: self.tokenizer.pad_token_id,
            K.META_DO_SAMPLE: bool(rollout.do_sample) and not (validation or greedy),
            K.META_TEMPERATURE: float(rollout.temperature),
            K.META_RESPONSE_LENGTH: int(self.config.data.max_response_length),
        }
        if validation:
            meta.update(ValKwargs.from_config(rollout).sampling_meta())
        if self.config.do_search:
            meta[K.META_STOP] = list(rollout.stop)
        return meta

    def _generation_manager(self, validation: bool) -> Any:
        """One manager per mode, kept for the run so its retrieval client's connection pool is reused."""
        if validation in self._gen_managers:
            return self._gen_managers[validation]
        from search_r1.llm_agent.agent_loops import AgentLoopGenerationManager

        manager = AgentLoopGenerationManager(tokenizer=self.tokenizer, actor_rollout_wg=self.rollout_wg,
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
        synced = [b for b in (self.rollout_wg.rollout_wake_up(seed) or []) if b is not None]
        if synced and gen_meta is not None:
            gen_meta["weight_sync_bytes"] = max(synced)   # per engine: every engine gets the same weights
        yield
        ended = [r for r in self.rollout_wg.rollout_sleep() if r is not None]
        if ended and gen_meta is not None:
            # per engine, the slowest rank (the step waits for it); every engine holds the same model
            for key in ("engine_wake_ups", "rollout_wake_s", "rollout_sleep_s", "sleep_host_bytes"):
                values = [r[key] for r in ended if r.get(key) is not None]
                if values:
                    gen_meta[key] = max(values)

    def _generate(self, batch: DataProto, validation: bool, step: int | None = None,
                  greedy: bool = False) -> tuple[DataProto, dict[str, Any]]:
        """Generate for every row of `batch` (for training step `step` + 1; default the current);
        returns (batch with the rollout keys, generation meta_info). `greedy`: sampling off on the
        training path (ReMax's baseline rollout)."""
        gen_batch = batch.pop(batch_keys=list(GEN_INPUT_KEYS))
        if self.config.do_search:   # the rows' fields too (not popped): an agent loop's run gets them
            gen_batch.non_tensor_batch = dict(batch.non_tensor_batch)
        gen_batch.meta_info = self._gen_meta(validation, greedy)
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
        if self.config.get("openai_agent") and self.config.openai_agent.get("path"):
            from search_r1.llm_agent.openai_endpoint.rollout import select_samples

            # openai_agent: failed rows dropped, split ones repeated (docs/agent.md "Train an agent you already wrote")
            batch = select_samples(batch, gen_meta)
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
        """token_level_scores (the rule reward, overlong shaping: reward_shaping.py) unless dynamic sampling
        scored the batch already; then token_level_rewards."""
        if K.TOKEN_LEVEL_SCORES not in batch.batch.keys():
            metrics.update(score_rollouts(self.reward_fn, batch, OverlongBuffer.from_config(self.config),
                                          int(self.config.data.max_response_length)))
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
            norm_adv_by_std_in_grpo=bool(algo.norm_adv_by_std_in_grpo), kept_mask=batch.batch[K.RESPONSE_MASK],
            config=algo, **remax.estimator_batch_keys(batch))
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
        """Tokens sampled from a cut rolling context out of the losses (rollout_correction.mask_cut_context)."""
        rollout_correction.mask_cut_context(batch, metrics)

    def _apply_rollout_correction(self, batch: DataProto, metrics: dict[str, float]) -> None:
        """algorithm.rollout_correction on this batch (rollout_correction.correct_batch); a pipelined
        run's `rollout_is: auto` (the default) is token IS unless another correction is chosen."""
        cfg = rollout_correction.RolloutCorrectionConfig.from_config(
            self.config.algorithm.get("rollout_correction"), pipelined=self.pipelined)
        rollout_correction.correct_batch(batch, cfg, metrics)

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
        baselines_P = None
        if remax.enabled(self.config):
            with mu.timer("gen_max", timing):
                baselines_P = remax.greedy_baselines(self, batch, step)
        batch = batch.repeat(repeat_times=samples, interleave=True)
        with mu.timer("gen", timing):
            batch, gen_meta = self._generate(batch, validation=False, step=step)
        if baselines_P is not None:
            remax.add_baselines(batch, baselines_P, samples)
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
            batch.batch[K.OLD_LOG_PROBS] = rollout_correction.require_rollout_log_probs(batch).float().clone()
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
        if self.dumps.cfg.rollout_dir is not None:
            with mu.timer("dump", timing):   # before the checkpoint: a run resumed from this step has its file
                self.dumps.write_rollout(batch, self.global_step)
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

    # ------------------------------------------------------------------ validation
    def _validate(self) -> dict[str, float]:
        """Generation on every validation row, rollout.val_kwargs.n samples each (greedy by default); the
        mean score per data source, and veRL's val-core / val-aux metrics over the samples of each prompt."""
        scores: list[torch.Tensor] = []
        sources: list[str] = []
        uids: list[str] = []
        answers: list[str | None] = []   # the val reward's extracted answer per row (maj@k votes on it)
        n_samples = ValKwargs.from_config(self.config.actor_rollout_ref.rollout).n
        gen_metrics: list[dict[str, float]] = []
        row_metrics: list[dict[str, float]] = []   # the val reward's per-row F1 / judge verdict, if it keeps them
        judge_counts: dict[str, float] = {}
        # One wake for the whole validation pass, not one per batch (or per turn); a pipelined run's
        # rollout pool between two rollouts, with the newest weights.
        pool = self._producer.rollout_pool() if self._producer is not None else nullcontext()
        with pool, self._engines_awake(None, validation=True):
            for batch in tqdm(self.val_dataloader, desc="validation", unit="batch", leave=False,
                              disable=not self.config.trainer.progress_bar):
                batch.non_tensor_batch[K.UID] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
                if n_samples > 1:   # the samples of a prompt share its uid
                    batch = batch.repeat(repeat_times=n_samples, interleave=True)
                batch, gen_meta = self._generate(batch, validation=True)
                gen_metrics.append(mu.compute_env_metrics(gen_meta))
                scores_BR = self.val_reward_fn(batch)
                if isinstance(scores_BR, DataProto):
                    scores_BR = scores_BR.batch[K.TOKEN_LEVEL_SCORES]
                scores.append(scores_BR.sum(-1).float().cpu())
                self.dumps.add_validation(batch, scores[-1], self.val_reward_fn)
                sources.extend(batch.non_tensor_batch[K.DATA_SOURCE].tolist())
                uids.extend(batch.non_tensor_batch[K.UID].tolist())
                breakdowns = getattr(self.val_reward_fn, "last_breakdowns", None) or [None] * len(batch)
                answers.extend(getattr(b, "answer", None) for b in breakdowns)
                row_metrics.extend(getattr(self.val_reward_fn, "last_row_metrics", None) or [{}] * len(batch))
                for key, value in (getattr(self.val_reward_fn, "last_metrics", None) or {}).items():
                    if key in JUDGE_COUNTS:   # the judge's calls, cache hits and failures over the pass
                        judge_counts[key] = judge_counts.get(key, 0.0) + value
        self.dumps.end_validation(self.global_step)
        if not scores:
            return {}
        metrics = mu.score_by_data_source(torch.cat(scores), sources)
        metrics.update(mu.row_metrics_by_data_source(row_metrics, sources))
        metrics.update(validation_metrics(sources, uids, rows_infos(torch.cat(scores).tolist(), row_metrics, answers)))
        metrics.update({f"val/{key}": value for key, value in judge_counts.items()})
        for key in {k for m in gen_metrics for k in m}:
            values = [m[key] for m in gen_metrics if key in m]
            metrics[f"val/{key}"] = float(np.mean(values))
        return metrics

    # ------------------------------------------------------------------ loop
    def _profiled_groups(self) -> list[tuple[str, Any]]:
        """The worker groups whose processes a profiled step traces (a colocated critic shares the actor's)."""
        groups = [("actor_rollout", self.actor_rollout_wg)]
        if self._rollout_pool_wg is not None:
            groups.append(("rollout", self._rollout_pool_wg))
        return groups

    def _tracker(self) -> Tracking:
        trainer = self.config.trainer
        backends = [trainer.logger] if isinstance(trainer.logger, str) else list(trainer.logger)
        return Tracking(trainer.project_name, trainer.experiment_name, backends,
                        config=self.config, log_dir=str(run_log_dir(self.config)))

    def fit(self) -> list[dict[str, float]]:
        """Train until total_training_steps; returns the per-step metrics (also sent to the loggers)."""
        tracker = self._tracker()
        try:
            resumed = self.load_checkpoint()
            self.dumps.start(self.global_step, tracker)
            if resumed is not None and self.pipelined:
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
            # the pass over the training data the step's (last) batch came from; a resumed run starts at the
            # pass of its step (with dynamic sampling, steps and batches differ: the passes count from there)
            epoch = self.global_step // len(self.train_dataloader)
            while self.global_step < self.total_training_steps:
                drawn = 0
                for batch in self.train_dataloader:
                    drawn += 1
                    # dynamic sampling: None while the step's groups are still being collected
                    self._profiler.begin(self.global_step + 1)
                    metrics = self._sampling_step(batch) if self.run.sampling.enable else self.train_step(batch)
                    self._profiler.end(self.global_step)
                    if metrics is None:
                        continue
                    metrics["train/epoch"] = float(epoch)
                    # from the previous step's end (the same clock as a pipelined run's steps)
                    metrics.update(clock.lap())
                    tracker.log(metrics, step=self.global_step)
                    self.history.append({"step": self.global_step, **metrics})
                    bar.update(1)
                    if self.global_step >= self.total_training_steps:
                        break
                epoch += drawn > 0   # a resumed loader at the end of its pass draws nothing before the next
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
            self._profiler.abort()   # a step that failed midway still leaves its traces
            tracker.finish()
