"""Start-up checks of the composed trainer config: one list of rules, each naming its keys.

`validate_config(cfg)` runs once, before any worker is built, so a contradiction in the command line
fails in a second with a message naming the keys instead of an hour later inside a worker. It first
builds the run's typed sections (`verl/trainer/run_config.py`: pools, protocol, algorithm, batches,
trainer; each checks its own values), then runs `RULES`, the checks that tie settings together. It
also finds (without importing them) the optional packages the run will import: the logger backends,
vLLM, flash-attn. Those that depend on the host (`rollout.name=auto` is vLLM on a GPU host;
flash-attn only packs on CUDA) are checked when `has_gpu` is known. `check_runtime(cfg, has_gpu)`
checks what the machine offers once the rollout engine is resolved (vLLM installed, GPUs present).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from verl.trainer.config_agent import check_agent_loops
from verl.trainer.config_check_policy_loss import check_policy_loss, load_custom_algorithms
from verl.trainer.config_lora import check_lora
from verl.trainer.config_open_tag import check_open_tag
from verl.trainer.config_schema import ConfigError, raise_if, undeclared_keys, unknown_key_message
from verl.trainer.run_config import CRITIC_FORWARD_MICRO, RunConfig
from verl.utils.attention import FLASH_ATTN_INSTALL
from verl.utils.tracking_backends import PACKAGES

logger = logging.getLogger(__name__)

ROLLOUT_NAMES = ("auto", "hf", "vllm")
# veRL's engines that this project does not ship (docs/rollout.md, "SGLang"): refused with the
# setting that gives the same rollout here.
SGLANG_NAMES = ("sglang", "sglang_async")
TRUNCATIONS = ("error", "left", "right", "middle")
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
# as verl.utils.torch_functional.LOSS_AGG_MODES (not imported: this module stays free of torch)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Logger backends that need a package: backend -> (module to find, how to install it).
LOGGER_PACKAGES: dict[str, tuple[str, str]] = PACKAGES
ASYNC_TP_MESSAGE = ("the async rollout steps each rank's engine on its own; a TP group's ranks would diverge; "
                    "use mode=sync or tensor_model_parallel_size=1")

# A rule: (the composed config, its typed sections, whether the workers' host has GPUs) -> problems.
Rule = Callable[[DictConfig, RunConfig, "bool | None"], list[str]]


# --------------------------------------------------------------------------- batches
def _divides(errors: list[str], what: str, big: int, big_key: str, small: int, small_key: str) -> None:
    if small <= 0 or big % small != 0:
        errors.append(f"{what}: {big_key}={big} is not divisible by {small_key}={small}")


def _check_mini_batch(errors: list[str], who: str, prefix: str, size: int, n_key: str, n: int, rollouts: int,
                      rollouts_key: str, ws: int, ws_key: str) -> None:
    """The mini-batch (size * n rollouts) fits in and divides the step's rollouts, and splits over the workers."""
    mini, mini_key = size * n, f"{prefix}.ppo_mini_batch_size*{n_key}"
    if mini < 1 or mini > rollouts or rollouts % mini != 0:
        errors.append(f"{prefix}.ppo_mini_batch_size={size} (x {n_key}={n}): a mini-batch of {mini} rollouts must "
                      f"divide {rollouts_key}={rollouts} (ppo_mini_batch_size counts rollouts, see docs/training.md)")
    _divides(errors, f"{who} mini-batch per worker", mini, mini_key, ws, ws_key)


def _check_micro_batch(errors: list[str], who: str, micro_key: str, mini_rollouts: int, micro: int,
                       ws: int, ws_key: str, dynamic_bsz: bool = False) -> None:
    """The micro-batch (`micro` rows in all, set by `micro_key`) splits evenly over the workers and,
    unless batches are packed by tokens (`dynamic_bsz`), fits in and divides the mini-batch."""
    _divides(errors, f"{who} micro-batch per worker", micro, micro_key, ws, ws_key)
    if dynamic_bsz:
        return
    if micro > mini_rollouts:
        errors.append(f"{micro_key}={micro} is larger than the mini-batch of {mini_rollouts} rollouts")
    if micro <= mini_rollouts and micro % ws == 0 and mini_rollouts % ws == 0:
        _divides(errors, f"{who} mini-batch per worker", mini_rollouts // ws,
                 f"{who} mini-batch rollouts/world_size", micro // ws, f"{micro_key}/world_size")


def _data_parallel(section: DictConfig, ws: int, ws_key: str) -> tuple[int, str]:
    """(data-parallel ranks, how to name them): the world over the section's Ulysses SP size (where valid)."""
    size = section.get("ulysses_sequence_parallel_size", 1)
    if isinstance(size, int) and not isinstance(size, bool) and size > 1 and ws % size == 0:
        return ws // size, f"{ws_key}/ulysses_sequence_parallel_size"
    return ws, ws_key


def check_batch_sizes(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """Batch sizes in rollouts (run.batches), split evenly over the train pool's workers."""
    errors: list[str] = []
    batches, ws, ws_key = run.batches, run.pools.world_size, run.pools.world_size_key
    rollouts, rollouts_key = batches.rollouts_per_step, "data.train_batch_size*rollout.n_agent*rollout.n"
    _divides(errors, "rollouts per step", rollouts, rollouts_key, ws, ws_key)
    actor = cfg.actor_rollout_ref.actor
    _check_mini_batch(errors, "actor", "actor_rollout_ref.actor", int(actor.ppo_mini_batch_size),
                      "actor_rollout_ref.rollout.n", run.algorithm.n, rollouts, rollouts_key, ws, ws_key)
    # The workers divide every micro-batch key by the world size, also under use_dynamic_bsz (which
    # then packs by tokens instead), so each must divide it; only the micro-in-mini rules are skipped.
    # Micro-batches split over the data-parallel ranks: world / ulysses_sequence_parallel_size.
    dp, dp_key = _data_parallel(actor, ws, ws_key)
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    _check_micro_batch(errors, "actor", batches.micro_key(key), batches.mini_rollouts["actor"],
                       batches.micro_rows(key), dp, dp_key, bool(actor.use_dynamic_bsz))
    for key in ("actor_rollout_ref.rollout.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size"):
        _divides(errors, "log-prob micro-batch per worker", batches.micro_rows(key), batches.micro_key(key), dp, dp_key)
    if run.algorithm.need_critic:
        critic = cfg.critic
        _check_mini_batch(errors, "critic", "critic", int(critic.ppo_mini_batch_size),
                          "critic.rollout_n", int(critic.get("rollout_n", 1)), rollouts, rollouts_key, ws, ws_key)
        key = "critic.ppo_micro_batch_size"
        dp, dp_key = _data_parallel(critic, ws, ws_key)
        _check_micro_batch(errors, "critic", batches.micro_key(key), batches.mini_rollouts["critic"],
                           batches.micro_rows(key), dp, dp_key, bool(critic.use_dynamic_bsz))
        _divides(errors, "critic forward micro-batch per worker", batches.micro_rows(CRITIC_FORWARD_MICRO),
                 batches.micro_key(CRITIC_FORWARD_MICRO), dp, dp_key)
    return errors


# --------------------------------------------------------------------------- Ulysses sequence parallelism
def check_sequence_parallel(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """ulysses_sequence_parallel_size (actor, ref, critic): packing on, a size that divides the train
    world (verl/workers/sp_groups.py); the head counts are checked by preflight and the workers."""
    errors: list[str] = []
    ws, ws_key = run.pools.world_size, run.pools.world_size_key
    sections = [("actor_rollout_ref.actor", "actor_rollout_ref.model"), ("actor_rollout_ref.ref", "actor_rollout_ref.model")]
    if run.algorithm.need_critic:
        sections.append(("critic", "critic.model"))
    sizes = {}
    for where, model in sections:
        size = OmegaConf.select(cfg, f"{where}.ulysses_sequence_parallel_size", default=1)
        size = 1 if size is None else size
        sizes[where] = size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            errors.append(f"{where}.ulysses_sequence_parallel_size={size!r} must be an int >= 1")
            continue
        if size == 1:
            continue
        if not OmegaConf.select(cfg, f"{model}.use_remove_padding", default=False):
            errors.append(f"{where}.ulysses_sequence_parallel_size={size} splits packed rows: set "
                          f"{model}.use_remove_padding=true, or the size to 1")
        if ws % size != 0:
            errors.append(f"{where}.ulysses_sequence_parallel_size={size} must divide {ws_key}={ws}")
    if sizes["actor_rollout_ref.ref"] != sizes["actor_rollout_ref.actor"] and run.algorithm.need_reference_policy:
        errors.append(f"actor_rollout_ref.ref.ulysses_sequence_parallel_size={sizes['actor_rollout_ref.ref']} must equal "
                      f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sizes['actor_rollout_ref.actor']}")
    return errors


# --------------------------------------------------------------------------- pipeline
def check_pipeline(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """A partial rollout needs another pool that trains (and the sync rollout, where weights arrive between turns)."""
    errors: list[str] = []
    if not bool(cfg.actor_rollout_ref.rollout.get("partial", False)):
        return errors
    if not run.pools.pipelined:
        errors.append("actor_rollout_ref.rollout.partial=true needs trainer.pipeline=one_step_off or async "
                      "(weights change mid-rollout only when another pool trains them)")
    if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "async":
        errors.append("actor_rollout_ref.rollout.partial=true needs actor_rollout_ref.rollout.mode=sync: the async "
                      "rollout's trajectories run inside the workers, where no weights arrive between turns")
    return errors


# --------------------------------------------------------------------------- algorithm
def check_algorithm(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    errors: list[str] = []
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if run.algorithm.need_critic and not cfg.critic.model.path:
        errors.append(f"algorithm.adv_estimator={run.algorithm.adv_estimator} needs a critic: set critic.model.path")
    if algo.kl_penalty not in KL_TYPES:
        errors.append(f"algorithm.kl_penalty={algo.kl_penalty!r} is unknown; choose one of {list(KL_TYPES)}")
    if actor.kl_loss_type not in KL_TYPES:
        errors.append(f"actor_rollout_ref.actor.kl_loss_type={actor.kl_loss_type!r} is unknown; choose one of {list(KL_TYPES)}")
    for key in ("actor_rollout_ref.actor.loss_agg_mode", "critic.loss_agg_mode"):
        mode = OmegaConf.select(cfg, key)
        if mode not in LOSS_AGG_MODES:
            errors.append(f"{key}={mode!r} is unknown; choose one of {list(LOSS_AGG_MODES)}")
    if algo.kl_ctrl.type not in ("fixed", "adaptive"):
        errors.append(f"algorithm.kl_ctrl.type={algo.kl_ctrl.type!r} is unknown; choose fixed or adaptive")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        logger.warning(
            "actor_rollout_ref.actor.use_kl_loss=True and algorithm.use_kl_in_reward=True: "
            "the KL to the reference is applied twice (as a loss and as a reward penalty)"
        )
    clip_ratio_c = actor.get("clip_ratio_c", 3.0)
    if isinstance(clip_ratio_c, bool) or not isinstance(clip_ratio_c, (int, float)) or not clip_ratio_c > 1:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_c={clip_ratio_c!r} must be a number > 1 (the dual-clip "
                      "bound: for a negative advantage A a token's loss is at most -A * clip_ratio_c; veRL's default 3)")
    if algo.no_think_rl:
        errors.append(
            "algorithm.no_think_rl=true is not supported: the generation manager keeps the model's "
            "<think> text (token-exact rollouts); set algorithm.no_think_rl=false"
        )
    return errors


def check_adv_estimator(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """The estimator's needs: samples per prompt, ReMax's sync trainer, the optimal token baseline's actor."""
    from verl.trainer.ppo import advantage_estimators

    return advantage_estimators.config_errors(cfg, run.algorithm.samples_per_prompt)


def check_dynamic_sampling(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """DAPO's algorithm.filter_groups (verl/trainer/ppo/dynamic_sampling.py): groups to filter, the sync
    loop, a metric known before the log-probs."""
    errors: list[str] = []
    sampling = run.sampling
    if not sampling.enable:
        if sampling.gen_batch_size != int(cfg.data.train_batch_size):
            errors.append(f"data.gen_batch_size={sampling.gen_batch_size} differs from data.train_batch_size="
                          f"{cfg.data.train_batch_size} but algorithm.filter_groups.enable=False: generation "
                          "batches larger than the train batch are for dynamic sampling only (set both, or null)")
        return errors
    if run.algorithm.samples_per_prompt < 2:
        errors.append("algorithm.filter_groups.enable=True needs groups: rollout.n * rollout.n_agent="
                      f"{run.algorithm.samples_per_prompt} sample per prompt leaves nothing to compare")
    if run.pools.pipelined and run.trainer.pipeline_wait_for_sync:
        errors.append("algorithm.filter_groups.enable=True with +trainer.pipeline_wait_for_sync=true: a pipeline "
                      "that waits for each update rolls out one batch a step, and dynamic sampling needs several; "
                      "use trainer.pipeline=sync for that")
    if sampling.metric == "seq_final_reward" and run.algorithm.use_kl_in_reward:
        errors.append("algorithm.filter_groups.metric=seq_final_reward with an in-reward KL "
                      "(algorithm.use_kl_in_reward): groups are filtered before the log-probs the penalty needs; "
                      "use seq_reward, acc or score")
    return errors


def check_bypass_mode(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """Rollout correction's bypass mode needs an engine log-prob for every token in the loss, of the
    distribution the actor trains."""
    errors: list[str] = []
    if not run.algorithm.bypass:
        return errors
    correction = cfg.algorithm.get("rollout_correction") or {}
    # the spelling the user wrote (veRL's newer bypass_mode, or bypass_old_logprob_for_rollout)
    bypass_key = "algorithm.rollout_correction." + (
        "bypass_mode" if correction.get("bypass_mode") else "bypass_old_logprob_for_rollout")
    if cfg.do_search and not cfg.actor_rollout_ref.actor.state_masking:
        errors.append(f"{bypass_key}=true (bypass mode) with actor_rollout_ref.actor.state_masking=false: the "
                      "observations are then in the loss, and the engine, which did not sample them, has no "
                      "log-prob of them to anchor their PPO ratio; keep state_masking=true or turn bypass mode off")
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm":
        from verl.workers.rollout.vllm_rollout import log_probs_mode

        if not log_probs_mode(rollout)[1]:
            errors.append(f"{bypass_key}=true (bypass mode) with vLLM sampling "
                          f"top_p={rollout.get('top_p')} / top_k={rollout.get('top_k')} at temperature "
                          f"{rollout.get('temperature')}: vLLM's log-probs are then renormalised over the kept "
                          "tokens, not the distribution the actor trains; sample with top_p=1 and top_k=-1 (or at "
                          "temperature 1), or turn bypass mode off")
    return errors


# --------------------------------------------------------------------------- rollout
def sglang_message(name: str) -> str:
    """Why `rollout.name=sglang` / `sglang_async` is refused, and the setting that gives that rollout here."""
    return (f"rollout.name={name} is not available in this project (see docs/rollout.md, 'SGLang'): use "
            "rollout.name=vllm (or hf); veRL's async agent loop corresponds to rollout.mode=async")


def check_rollout(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    errors: list[str] = []
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name in SGLANG_NAMES:
        errors.append(sglang_message(rollout.name))
    elif rollout.name not in ROLLOUT_NAMES:
        errors.append(f"actor_rollout_ref.rollout.name={rollout.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
    mode = rollout.get("mode", "sync")
    if mode not in ("sync", "async"):
        errors.append(f"actor_rollout_ref.rollout.mode={mode!r} is unknown; choose 'sync' or 'async'")
    elif mode == "async" and not cfg.do_search:
        errors.append("actor_rollout_ref.rollout.mode=async runs the multi-turn search loop; with do_search=false "
                      "every row is one generate call: use mode=sync")
    if not cfg.actor_rollout_ref.hybrid_engine:
        errors.append("actor_rollout_ref.hybrid_engine=False is not supported: actor, rollout and ref share one process")
    if cfg.actor_rollout_ref.actor.state_masking and not cfg.do_search:
        logger.info("actor_rollout_ref.actor.state_masking=True with do_search=False: no observations to mask")
    if cfg.do_search and not run.protocol.tool:
        if not cfg.retriever.url and not run.protocol.serve_retriever:
            errors.append("do_search=true needs retriever.url")
        if int(cfg.max_turns) < 0:
            errors.append(f"max_turns={cfg.max_turns} must be >= 0")
        if int(cfg.data.max_start_length) >= int(cfg.data.max_prompt_length):
            errors.append(
                f"do_search=true needs data.max_start_length={cfg.data.max_start_length} < "
                f"data.max_prompt_length={cfg.data.max_prompt_length} (the rolling context keeps the prompt "
                "plus recent turns)"
            )
    return errors


def check_profiler(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """global_profiler: the tool, the steps it profiles and where the traces go."""
    from verl.utils.profiler import ProfilerConfig

    return ProfilerConfig.errors(cfg)


def check_val_kwargs(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """rollout.val_kwargs: validation's samples per prompt and their sampling (veRL's keys)."""
    from verl.trainer.ppo.rollout_setup import ValKwargs

    rollout = cfg.actor_rollout_ref.rollout
    errors = ValKwargs.errors(rollout)
    if not errors:
        val = ValKwargs.from_config(rollout)
        if val.n > 1 and not (val.do_sample and val.temperature > 0):
            logger.warning("actor_rollout_ref.rollout.val_kwargs.n=%d with greedy decoding (do_sample=%s, "
                           "temperature=%g): the %d samples of a prompt are the same rollout",
                           val.n, val.do_sample, val.temperature, val.n)
    return errors


def check_max_model_len(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """vLLM's context (`rollout.max_model_len`, veRL's key) must hold the prompt and the response budget."""
    rollout = cfg.actor_rollout_ref.rollout
    value = rollout.get("max_model_len")
    if value is None:
        return []
    key = "actor_rollout_ref.rollout.max_model_len"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [f"{key}={value!r} must be an int >= 1 or null (= prompt_length + response_length)"]
    need = int(rollout.prompt_length) + int(rollout.response_length)
    if need > value:
        return [f"{key}={value} is shorter than a rollout's context: actor_rollout_ref.rollout.prompt_length="
                f"{rollout.prompt_length} + response_length={rollout.response_length} = {need} tokens "
                f"(data.max_prompt_length + data.max_response_length); raise {key} to >= {need} or set it to null"]
    return []


def check_multi_turn(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """`actor_rollout_ref.rollout.multi_turn.*` (veRL's keys and defaults): the tool protocol's settings
    (its tool YAML was read and checked by run_config.Protocol)."""
    from search_r1.llm_agent.tools import TOOL_FORMATS, TRUNCATE_SIDES

    errors: list[str] = []
    prefix = "actor_rollout_ref.rollout.multi_turn"
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if mt.format not in TOOL_FORMATS:
        errors.append(f"{prefix}.format={mt.format!r} is not supported; supported: {list(TOOL_FORMATS)} "
                      "(hermes: <tool_call>{json}</tool_call>, as Qwen2.5 writes it; qwen is its older name)")
    for key in ("max_assistant_turns", "max_user_turns"):
        value = mt.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            errors.append(f"{prefix}.{key}={value!r} must be an int >= 1 or null (no bound)")
    for key in ("max_parallel_calls", "max_tool_response_length"):
        value = mt.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            errors.append(f"{prefix}.{key}={value!r} must be an int >= 1")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        errors.append(f"{prefix}.tool_response_truncate_side={mt.tool_response_truncate_side!r} is unknown; "
                      f"choose one of {list(TRUNCATE_SIDES)}")
    if not mt.enable:
        return errors
    if not mt.tool_config_path:
        errors.append(f"{prefix}.enable=true needs {prefix}.tool_config_path (veRL's tool YAML, e.g. "
                      "example/tool_recipe/config/tool_config/search_tool_config.yaml)")
    if not cfg.do_search:
        errors.append(f"{prefix}.enable=true runs the tool loop against the retrieval server, but do_search=false "
                      f"turns the search loop off: set do_search=true or {prefix}.enable=false")
    return errors


def check_tensor_parallel(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """vLLM tensor parallelism: a TP group is TP consecutive workers of one node, inside one engine.

    The rollout then splits rows over world_size / TP data-parallel groups.
    """
    errors: list[str] = []
    rollout = cfg.actor_rollout_ref.rollout
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = rollout.tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return [f"{key}={tp!r} must be an int >= 1"]
    if tp == 1:
        return errors
    ws, per_node = run.pools.rollout_world_size, run.pools.per_node
    if ws % tp != 0:
        where = ("trainer.rollout_pool" if run.pools.pipelined
                 else "the world size trainer.nnodes*trainer.n_gpus_per_node")
        errors.append(f"{key}={tp} must divide {where}={ws}")
    if per_node % tp != 0:
        errors.append(f"{key}={tp} must divide trainer.n_gpus_per_node={per_node} (a TP group must not span nodes)")
    if rollout.name == "hf":
        errors.append(f"{key}={tp} needs the vLLM rollout; actor_rollout_ref.rollout.name=hf runs one HF "
                      "generate loop per worker: set actor_rollout_ref.rollout.name=vllm or "
                      f"{key}=1")
    elif rollout.name == "auto" and run.trainer.on_cuda(has_gpu) is False:
        errors.append(f"{key}={tp} needs the vLLM rollout, but actor_rollout_ref.rollout.name=auto is the HF "
                      f"loop on a run without GPUs: set actor_rollout_ref.rollout.name=vllm or {key}=1")
    if rollout.get("mode", "sync") == "async":
        errors.append(f"actor_rollout_ref.rollout.mode=async with {key}={tp}: {ASYNC_TP_MESSAGE}")
    return errors


# --------------------------------------------------------------------------- retriever
def check_retriever(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    errors: list[str] = []
    retriever = cfg.retriever
    fraction = retriever.max_failure_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
        errors.append(f"retriever.max_failure_fraction={fraction!r} must be a number in [0, 1] "
                      "(the share of a rollout's searches that may fail; 1.0 never stops the run)")
    wait = retriever.health_wait_s
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
        errors.append(f"retriever.health_wait_s={wait!r} must be a number of seconds >= 0")
    return errors



def check_retriever_serve(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """`retriever.serve=ray` and its settings (the server's own flags are checked by parsing them as it will)."""
    errors: list[str] = []
    if not run.protocol.serve_retriever:
        return errors
    retriever = cfg.retriever
    if not cfg.do_search:
        errors.append("retriever.serve=ray with do_search=false: nothing would call the retrieval application")
    if not retriever.server_args or not retriever.server_args.get("index_path"):
        errors.append("retriever.serve=ray needs retriever.server_args.index_path and .corpus_path (the replicas load "
                      "them on every node), e.g. +retriever.server_args.index_path=index/bm25")
    replicas = retriever.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
        errors.append(f"retriever.replicas={replicas!r} must be an int >= 1 or null (one per node)")
    if int(retriever.replica_max_ongoing_requests) < 1:
        errors.append(f"retriever.replica_max_ongoing_requests={retriever.replica_max_ongoing_requests} must be >= 1")
    from search_r1.search.ray_serve import check_server_args, import_serve

    server_args: dict | None = OmegaConf.to_container(retriever.server_args, resolve=True) or {}
    try:
        check_server_args(server_args)
    except ValueError as err:
        errors.append(str(err))
        server_args = None   # not a command line the replicas would start with: nothing to size
    if server_args is not None and server_args.get("faiss_gpu") and float(retriever.replica_resources.num_gpus) <= 0:
        errors.append("retriever.server_args.faiss_gpu=true needs retriever.replica_resources.num_gpus > 0: a replica "
                      "without a GPU of its own sees none (and a node whose GPUs all train has none to give)")
    elif server_args is not None:
        errors.extend(_replica_size_errors(cfg, run, server_args))
    try:
        import_serve()
    except ImportError as err:
        errors.append(str(err))
    if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "sync":
        logger.warning("retriever.serve=ray with rollout.mode=sync: the driver searches for every row, so only the "
                       "replica on the driver's node answers; rollout.mode=async spreads searches over the nodes")
    return errors


def _replica_size_errors(cfg: DictConfig, run: RunConfig, server_args: dict) -> list[str]:
    """A replica's CPUs must answer a turn's searches over a dense Flat index within retriever.timeout;
    a local run's replicas must not ask for a GPU the workers take (search_r1/search/serve_checks.py;
    on a joined cluster the driver checks the GPUs against ray.nodes() before it deploys)."""
    from search_r1.search import serve_checks

    errors: list[str] = []
    retriever = cfg.retriever
    rollouts = run.batches.rollouts_per_step
    if cfg.actor_rollout_ref.rollout.get("mode", "sync") == "sync":
        queries, why = rollouts, (f"rollout.mode=sync: the driver sends every row's search of a turn, "
                                  f"{rollouts} rollouts, to its own node's replica")
    else:
        replicas = int(retriever.replicas) if retriever.replicas is not None else run.pools.nnodes
        queries = -(-rollouts // max(1, replicas))
        why = f"rollout.mode=async: {rollouts} rollouts searching at once over {replicas} replica(s)"
    error = serve_checks.replica_cpu_error(server_args, float(retriever.replica_resources.num_cpus), queries,
                                           float(retriever.timeout), why)
    if error:
        errors.append(error)
    if run.trainer.cluster_address is None and float(retriever.replica_resources.num_gpus) > 0:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        on_gpu = run.trainer.device == "cuda" or (run.trainer.device == "auto" and gpus > 0)
        # a local Ray is this machine (custom resources are the deploy's to report: it has none)
        node = serve_checks.NodeGpus("this machine (a local Ray)", float(gpus), {})
        error = serve_checks.replica_gpu_error(float(retriever.replica_resources.num_gpus), {},
                                               float(run.pools.per_node) if on_gpu else 0.0, [node])
        if error:
            errors.append(error)
    return errors


# --------------------------------------------------------------------------- data, trainer, imports
def check_data(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    if cfg.data.truncation not in TRUNCATIONS:
        return [f"data.truncation={cfg.data.truncation!r} is unknown; choose one of {list(TRUNCATIONS)} "
                "(a prompt longer than the bound when data.filter_overlong_prompts=False)"]
    return []


def check_trainer(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    errors: list[str] = []
    trainer = cfg.trainer
    if trainer.total_training_steps is not None and int(trainer.total_training_steps) < 1:
        errors.append(f"trainer.total_training_steps={trainer.total_training_steps} must be >= 1 or null")
    if int(trainer.max_ckpt_to_keep) < 1:
        errors.append(f"trainer.max_ckpt_to_keep={trainer.max_ckpt_to_keep} must be >= 1")
    if cfg.reward_model.enable:
        errors.append("reward_model.enable=True (a model-based reward) is not supported; the reward is rule-based")
    from verl.trainer.ppo.dumps import dump_config_errors

    errors.extend(dump_config_errors(cfg))
    return errors


def check_rewards(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    from verl.workers.reward_manager import reward_config_errors

    return reward_config_errors(cfg)


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_imports(cfg: DictConfig, run: RunConfig, has_gpu: bool | None) -> list[str]:
    """Optional packages the run will import, found now instead of after minutes of start-up."""
    errors: list[str] = []
    for name in run.trainer.loggers:
        if name in LOGGER_PACKAGES:
            module, install = LOGGER_PACKAGES[name]
            if not is_installed(module):
                errors.append(f"trainer.logger contains {name!r} but the {module} package is not installed: "
                              f"`{install}`, or drop {name!r} from trainer.logger")
    name = cfg.actor_rollout_ref.rollout.name
    on_cuda = run.trainer.on_cuda(has_gpu)
    if not is_installed("vllm"):
        if name == "vllm":
            from verl.workers.rollout.vllm_rollout import MISSING_VLLM

            errors.append(MISSING_VLLM)
        elif name == "auto" and on_cuda:
            errors.append("actor_rollout_ref.rollout.name=auto is the vLLM rollout on a GPU run, but vllm is not "
                          "installed: `pip install -e .[gpu]`, or set actor_rollout_ref.rollout.name=hf to roll "
                          "out with the (much slower) HF generate loop")
    errors += _packing_kernel_errors(cfg, on_cuda, run.algorithm.need_critic)
    return errors


def _packing_kernel_errors(cfg: DictConfig, on_cuda: bool, need_critic: bool) -> list[str]:
    """Packing runs through the registered packed attention (verl/utils/attention.py): torch's
    varlen_attn on CUDA (no flash-attn needed), flash-attn's kernel when model.packing_kernel=flash_attn."""
    from verl.utils.attention import PACKING_KERNELS, VARLEN_ATTN_MISSING, has_varlen_attn

    errors = []
    for section in ["actor_rollout_ref.model"] + (["critic.model"] if need_critic else []):
        kernel = OmegaConf.select(cfg, f"{section}.packing_kernel", default="varlen_attn")
        if kernel not in PACKING_KERNELS:
            errors.append(f"{section}.packing_kernel={kernel!r}: expected one of {list(PACKING_KERNELS)}")
            continue
        if not (on_cuda and OmegaConf.select(cfg, f"{section}.use_remove_padding")):
            continue
        if kernel == "flash_attn" and not is_installed("flash_attn"):
            errors.append(f"{section}.packing_kernel=flash_attn on CUDA packs with flash-attn, which is not "
                          f"installed: `{FLASH_ATTN_INSTALL}` (docs/training.md), or set "
                          f"{section}.packing_kernel=varlen_attn (torch's kernel, no extra package)")
        elif kernel == "varlen_attn" and not has_varlen_attn():
            errors.append(f"{section}.use_remove_padding=True on CUDA: {VARLEN_ATTN_MISSING}")
    return errors


# Every rule runs on a config whose sections (run_config.RunConfig) were built; each returns its problems.
RULES: tuple[Rule, ...] = (
    check_pipeline,
    check_data,
    check_algorithm,
    check_adv_estimator,
    check_policy_loss,
    check_dynamic_sampling,
    check_bypass_mode,
    check_rollout,
    check_val_kwargs,
    check_profiler,
    check_max_model_len,
    check_multi_turn,
    check_agent_loops,
    check_tensor_parallel,
    check_retriever,
    check_retriever_serve,
    check_trainer,
    check_rewards,
    check_batch_sizes,
    check_sequence_parallel,
    check_imports,
    check_lora,
    check_open_tag,
)


def validate_config(cfg: DictConfig, has_gpu: bool | None = None) -> RunConfig:
    """Raise ConfigError listing every contradiction found, each naming its keys, and every
    optional package the run needs that is not installed, with its pip command; return the run's
    typed sections when there is none.

    `has_gpu`: whether the workers' host has GPUs (with `trainer.device=auto`); None when not
    known, which skips the checks that depend on it. Also switches struct mode on, so reading
    or setting an undeclared key fails.
    """
    run, errors = check(cfg, has_gpu)
    raise_if(errors)
    assert run is not None
    return run


def config_errors(cfg: DictConfig, has_gpu: bool | None = None) -> list[str]:
    """What `validate_config` finds wrong, one message per problem (empty when the config is valid)."""
    return check(cfg, has_gpu)[1]


def check(cfg: DictConfig, has_gpu: bool | None = None) -> tuple[RunConfig | None, list[str]]:
    """(the run's typed sections, or None when a section's own values are wrong; every problem found)."""
    OmegaConf.set_struct(cfg, True)
    errors: list[str] = [unknown_key_message(key) for key in undeclared_keys(cfg)]
    # first: the user's losses / estimators are choices the rules below accept
    errors.extend(load_custom_algorithms(cfg))
    try:
        run = RunConfig.from_config(cfg)
    except ConfigError as err:   # a section's own values: the rules read them, so they wait
        return None, errors + err.messages
    for rule in RULES:
        errors.extend(rule(cfg, run, has_gpu))
    return run, errors


def check_runtime(cfg: DictConfig, has_gpu: bool) -> None:
    """What this machine must offer for `cfg` once `rollout.name` is resolved; raises ConfigError
    naming the key."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        from verl.workers.rollout.vllm_rollout import MISSING_VLLM

        raise ConfigError(MISSING_VLLM)
    if int(rollout.tensor_model_parallel_size) > 1 and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} "
                          f"needs the vLLM rollout, but actor_rollout_ref.rollout.name resolved to {rollout.name!r}")
    if cfg.trainer.device == "cuda" and not has_gpu:
        raise ConfigError("trainer.device=cuda but no CUDA GPU is visible")


def check_cluster_settings(config: DictConfig) -> None:
    """Reject cluster settings that cannot work, naming the key, before anything starts."""
    wait = config.trainer.get("ray_wait_s")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ValueError(f"trainer.ray_wait_s must be a number of seconds >= 0, got {wait!r}")
    nnodes = config.trainer.nnodes
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"trainer.nnodes must be an int >= 1, got {nnodes!r}")
    address = config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or None
    if nnodes > 1 and address is None:
        raise ValueError(
            f"trainer.nnodes={nnodes} needs a Ray cluster of {nnodes} nodes, but trainer.ray_address is null "
            "and RAY_ADDRESS is unset (a local Ray is one node): start the cluster (docs/multinode.md) and "
            "pass trainer.ray_address=auto or host:port")
