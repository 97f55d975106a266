"""The rollout role of ActorRolloutRefWorker (verl/workers/fsdp_workers.py): its engine, where each
rank sits among the engines (the "rollout" mesh), generation phases and the colocated weight sync.

A generation phase is the engine awake with the actor's current weights: `rollout_wake_up` ..
`rollout_sleep` hold one open over a whole multi-turn rollout (calls nest; only the outermost wakes
and sleeps), and a generate call outside one opens a phase for itself alone. A colocated engine
(role actor_rollout / actor_rollout_ref) gets the actor's weights at the start of a phase when it
lacks their version; a pipeline's rollout pool (role rollout) already holds what was pushed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.single_controller.base.decorator import Dispatch, MeshRank, register
from verl.utils import batch_keys as K
from verl.workers.rollout import HFRollout, build_rollout
from verl.workers.sharding_manager.fsdp_hf import FSDPUnshardedForGeneration

# The rollout's data-parallel rank r of a run seeded s samples with s * stride + r (the ranks of
# one tensor-parallel engine share r, so they sample alike).
_SAMPLING_SEED_STRIDE = 1000
ROLLOUT_MESH = "rollout"


def rollout_mesh_rank(rank: int, world_size: int, tensor_parallel_size: int) -> MeshRank:
    """Where worker `rank` sits among the rollout engines: vLLM's tensor-parallel groups are runs of
    `tensor_parallel_size` consecutive ranks (external launcher); the first of each collects."""
    tp = int(tensor_parallel_size)
    if tp < 1 or world_size % tp != 0:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must be >= 1 and divide the "
                         f"{world_size} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    return MeshRank(rank // tp, world_size // tp, rank % tp == 0)


class RolloutRole:
    """Mixin of ActorRolloutRefWorker: reads its config, role flags (`_is_actor`, `_is_rollout`), rank,
    device, tokenizer, actor module and weights version; sets `rollout` and the rollout's mesh rank."""

    def _init_rollout_role(self, config: Any) -> None:
        """In __init__: the engine's tensor-parallel layout and this rank's place in the rollout mesh."""
        tp = int(config.rollout.get("tensor_model_parallel_size", 1)) if self._is_rollout else 1
        self._rollout_tp = tp
        self._rollout_tp_group: Any = None   # gloo group of this rank's TP engine (TP > 1), set in init_model
        self._rollout_rank = rollout_mesh_rank(self.rank, self.world_size, tp)
        if self._is_rollout:
            self.set_mesh_rank(ROLLOUT_MESH, self._rollout_rank)
        # Generation phases (engine awake with current weights): nested opens, counted wakes.
        self._phase_depth = 0
        self._phase_stack: ExitStack | None = None
        self._phases_begun = 0

    def _build_rollout_engine(self, attn: str | None) -> None:
        """In init_model, after the actor: the TP engines' gloo groups, then this rank's engine."""
        model_cfg = self.config.model
        if self._is_rollout and self._rollout_tp > 1:
            # Every rank creates every group, in the same order (new_group is collective).
            for first in range(0, self.world_size, self._rollout_tp):
                group = dist.new_group(list(range(first, first + self._rollout_tp)), backend="gloo")
                if first <= self.rank < first + self._rollout_tp:
                    self._rollout_tp_group = group
        if self._is_rollout:
            device_index = self.local_device_index() if self.device == "cuda" else None
            if self._is_actor:
                self.rollout = build_rollout(self.config.rollout, self.actor_module, self.tokenizer,
                                             model_path=model_cfg.path, seed=self._sampling_seed(), device=self.device,
                                             device_index=device_index, lora=self.lora)
                self.rollout_sharding_manager = FSDPUnshardedForGeneration(self.actor_module)
            else:
                self._build_rollout_pool_engine(attn, device_index)

    def _build_rollout_pool_engine(self, attn: str | None, device_index: int | None) -> None:
        """Role rollout: the engine with the model path's weights, in its compute dtype, and nothing else."""
        from verl.workers.rollout_pool import RolloutPoolEngine

        self._rollout_pool = RolloutPoolEngine.build(self.config, self.tokenizer, self.device, attn,
                                                     seed=self._sampling_seed(), device_index=device_index)
        self.rollout = self._rollout_pool.rollout

    def _sampling_seed(self, seed: int | None = None) -> int:
        """`seed` (default: rollout.seed) spread over the rollout's data-parallel ranks."""
        base = int(self.config.rollout.get("seed", 1)) if seed is None else int(seed)
        return base * _SAMPLING_SEED_STRIDE + self._rollout_rank.dp_rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Reads input_ids, attention_mask, position_ids (left-padded prompts) and meta_info
        eos_token_id, pad_token_id, do_sample, temperature, response_length, stop.
        Writes prompts, responses, input_ids, attention_mask, position_ids, rollout_log_probs.

        Rows are split over the rollout engines (a tensor-parallel engine's ranks get the same
        rows; one answers). Inside `rollout_wake_up` .. `rollout_sleep` the engine stays awake;
        a call outside them wakes it for this call only."""
        self._require(self._is_rollout, "generate_sequences")
        prompts = prompts.to(self.device)
        prompts.meta_info.setdefault(K.META_EOS_TOKEN_ID, list(self.eos_token_ids))
        prompts.meta_info.setdefault(K.META_PAD_TOKEN_ID, self.tokenizer.pad_token_id)
        with self._in_generation_phase():
            output = self.rollout.generate_sequences(prompts)
        self._check_tensor_parallel_agreement(output)
        if not self._rollout_rank.collect:
            # The group's collecting rank returns the rows; the others' copies would only travel.
            return DataProto(meta_info=dict(output.meta_info))
        return output.to("cpu")

    def _check_tensor_parallel_agreement(self, output: DataProto) -> None:
        """The ranks of one tensor-parallel engine must have sampled the same ids: compare a checksum
        over the group (CPU, gloo) and stop at once on a mismatch instead of training on one rank's
        rows while the others diverge."""
        if self._rollout_tp_group is None:
            return
        ids = output.batch[K.RESPONSES].detach().to("cpu", torch.int64)
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64).reshape(ids.shape)
        mine = torch.tensor([int((ids * weights).sum()), ids.numel()], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self._rollout_tp)]
        dist.all_gather(every, mine, group=self._rollout_tp_group)
        if any(not torch.equal(other, mine) for other in every):
            raise RuntimeError(f"rank {self.rank}: the {self._rollout_tp} ranks of one vLLM tensor-parallel engine "
                               f"sampled different ids (checksums {[o.tolist() for o in every]}); their random "
                               "states or schedules diverged")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_wake_up(self, seed: int | None = None) -> int | None:
        """Begin a rollout: the engine wakes with the actor's current weights and stays awake for
        every generate call until `rollout_sleep` (a multi-turn rollout wakes it once, not per turn).
        Calls nest: only the outermost pair wakes and sleeps. Returns (outermost call, vLLM engine)
        the bytes its latest weight sync sent (`rollout/weight_sync_bytes`: the adapter's with
        lora_sync=adapter, else the full weights'); None otherwise.

        `seed` (the driver's, from the run seed and step): a tensor-parallel engine's ranks reseed
        their sampling RNG from it and their data-parallel rank, so they draw the same tokens
        whatever random state each restored from a checkpoint (even one saved with another TP)."""
        self._require(self._is_rollout, "rollout_wake_up")
        if self._phase_depth == 0:
            if seed is not None and self._rollout_tp > 1:
                torch.manual_seed(self._sampling_seed(seed))
            self._phases_begun = 0
            stack = ExitStack()
            stack.enter_context(self._generation_phase())
            self._phase_stack = stack
            self._phase_depth += 1
            return getattr(getattr(self, "rollout", None), "last_sync_bytes", None)
        self._phase_depth += 1
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_sleep(self) -> dict[str, Any] | None:
        """End a rollout begun by `rollout_wake_up`. The outermost call puts the engine to sleep and
        returns the rollout's engine figures: `engine_wake_ups`, how many times it woke during the
        rollout (1 for a whole multi-turn rollout: `rollout/engine_wake_ups`; more means a generate
        call began a phase of its own), and for a vLLM engine that sleeps (GPU) the seconds its
        wake_up and sleep calls took (`rollout_wake_s`, `rollout_sleep_s`) and the bytes its sleep
        backed up to host (`sleep_host_bytes`; vLLMRollout.phase_stats). A nested call returns None."""
        self._require(self._is_rollout, "rollout_sleep")
        if self._phase_depth == 0:
            raise RuntimeError("rollout_sleep without a rollout_wake_up")
        self._phase_depth -= 1
        if self._phase_depth > 0:
            return None
        stack, self._phase_stack = self._phase_stack, None
        stack.close()
        woke, self._phases_begun = self._phases_begun, 0
        stats = getattr(getattr(self, "rollout", None), "phase_stats", None)
        return {"engine_wake_ups": woke, **(stats() if stats is not None else {})}

    @contextmanager
    def _in_generation_phase(self) -> Iterator[None]:
        """The open generation phase, or one for this call alone."""
        if self._phase_depth > 0:
            yield
            return
        with self._generation_phase():
            yield

    def _async_call(self, prompts: DataProto, method: str) -> tuple[dict, int]:
        """What an async-mode call on this rank starts from: the call's meta_info with the EOS and pad ids
        defaulted, and one draw of the rank's seeded RNG (each request's seed derives from it). Refused on a
        worker without the rollout, and with TP > 1."""
        self._require(self._is_rollout, method)
        if self._rollout_tp > 1:
            raise NotImplementedError(
                "actor_rollout_ref.rollout.mode=async with tensor_model_parallel_size>1: each rank steps its "
                "engine on its own, so the ranks of one engine would diverge; use mode=sync or TP=1")
        meta = dict(prompts.meta_info)
        meta.setdefault(K.META_EOS_TOKEN_ID, list(self.eos_token_ids))
        meta.setdefault(K.META_PAD_TOKEN_ID, self.tokenizer.pad_token_id)
        return meta, int(torch.randint(0, 2**31 - 1, (1,)))

    def _log_probs_meta(self) -> dict:
        """Whether this engine's log-probs are the actor's quantity, for the driver (rollout correction)."""
        return {K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR: bool(getattr(self.rollout, "log_probs_match_actor", True))}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_trajectories(self, prompts: DataProto) -> DataProto:
        """Async rollout of this rank's rows, one coroutine per trajectory (search_r1.llm_agent.async_generation).

        Reads input_ids / attention_mask (the prompts, left-padded) and meta_info: the sampling
        keys of generate_sequences plus 'agent_config' (the driver's GenerationConfig as a dict).
        Writes non-tensors 'agent_rows' (each row's turns, masks and stop reason) and
        'agent_stats' (its counters), and the tensor 'num_turns'."""
        meta, call_seed = self._async_call(prompts, "generate_trajectories")
        from search_r1.llm_agent import generation
        from search_r1.llm_agent.agent_loops import run_worker_shard
        from search_r1.llm_agent.tensor_helper import real_tokens

        gen_config = generation.GenerationConfig(**meta.pop(generation.META_AGENT_CONFIG))
        ids = real_tokens(prompts.batch[K.INPUT_IDS].long(), prompts.batch[K.ATTENTION_MASK].long())
        with self._in_generation_phase():
            rows, stats, _ = run_worker_shard(self.tokenizer, gen_config, self.rollout.step_engine, meta, ids,
                                              call_seed, generation.eos_token_ids(meta),
                                              generation.row_fields(prompts, len(ids)))
        return DataProto.from_dict(
            tensors={"num_turns": torch.tensor([row.n_turns for row in rows], dtype=torch.long)},
            non_tensors={generation.AGENT_ROWS: rows, generation.AGENT_STATS: [dict(c) for c in stats]},
            meta_info=self._log_probs_meta())

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh=ROLLOUT_MESH)
    def generate_agent_samples(self, prompts: DataProto) -> DataProto:
        """Async mode with `openai_agent`: this rank's rows' agents, each against an OpenAI-compatible endpoint
        this worker serves over its engine's continuous batching (search_r1.llm_agent.openai_endpoint.rollout).

        Reads the non-tensor 'agent_fields' (each row's fields), meta_info 'openai_agent' (the agent's settings)
        and the sampling keys of generate_sequences. Writes non-tensors 'agent_results' (each row's RowResult:
        its samples' token ids and log-probs as the engine gave them) and 'agent_endpoint_counters'."""
        meta, call_seed = self._async_call(prompts, "generate_agent_samples")
        from search_r1.llm_agent import generation
        from search_r1.llm_agent.openai_endpoint import rollout as agent_rollout

        cfg = dict(meta.pop(agent_rollout.AGENT_SETTINGS))
        fields = list(prompts.non_tensor_batch[agent_rollout.AGENT_FIELDS])
        with self._in_generation_phase():
            results, counters = agent_rollout.agent_shard(self.tokenizer, cfg, self.rollout.step_engine(meta), fields,
                                                          generation.eos_token_ids(meta), call_seed)
        column = np.empty(len(results), dtype=object)
        column[:] = results
        shard_counters = np.empty(len(results), dtype=object)
        shard_counters[:] = [dict(counters) if i == 0 else {} for i in range(len(results))]
        return DataProto.from_dict(
            tensors={agent_rollout.AGENT_ROW: prompts.batch[agent_rollout.AGENT_ROW]},
            non_tensors={agent_rollout.AGENT_RESULTS: column, agent_rollout.AGENT_ENDPOINT_COUNTERS: shard_counters},
            meta_info=self._log_probs_meta())

    @contextmanager
    def _generation_phase(self) -> Iterator[None]:
        """The rollout engine ready with the actor's current weights, in eval mode; put back after."""
        fsdp_cfg = self.config.actor.fsdp_config
        self._phases_begun += 1
        if self._rollout_pool is not None:   # role rollout: the engine already holds the pushed weights
            with self._rollout_pool.generation_phase(self._weights_version):
                yield
            return
        if isinstance(self.rollout, HFRollout):
            self._onload(self.actor_module, None, fsdp_cfg)
            was_training = self.actor_module.training
            self.actor_module.eval()
            try:
                with self.rollout_sharding_manager:
                    yield
            finally:
                self.actor_module.train(was_training)
                self._offload(self.actor_module, None, fsdp_cfg)
        else:
            self.rollout.wake_up(self._load_rollout_weights)
            try:
                yield
            finally:
                self.rollout.sleep()

    def _load_rollout_weights(self) -> None:
        """Load the actor's weights into the engine unless it already has this version. The tensors
        are a pipeline push's (weight_sync.local_push over lora_push's state: the actor's weights, or a
        LoRA actor's merged ones): each shard cast to the engine's dtype before its gather, a tied
        tensor gathered once; every rank streams them in the same order (a gather is a collective).
        lora_sync=adapter sends the adapter alone instead (verl/workers/lora_role.py)."""
        from verl.workers.lora_push import lora_push_manifest, lora_push_state, push_mode
        from verl.workers.weight_sync import local_push

        fsdp_cfg = self.config.actor.fsdp_config
        if self.rollout.synced_version != self._weights_version:
            self._onload(self.actor_module, None, fsdp_cfg)
            if not self._sync_lora_adapter():
                mode = push_mode(self.lora, adapter_engine=False)   # full, or LoRA's merged weights
                manifest = lora_push_manifest(self.actor_module, self.rollout.weight_dtype, mode)
                self.rollout.sync_weights(local_push(lora_push_state(self.actor_module, mode), manifest),
                                          version=self._weights_version)
            self._offload(self.actor_module, None, fsdp_cfg)
