"""Entry point for PPO / GRPO training (the Ray driver, i.e. the single controller).

    python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=... \\
        actor_rollout_ref.model.path=... trainer.n_gpus_per_node=2 +trainer.val_before_train=false

Hydra composes `config/ppo_trainer.yaml` with the overrides (struct mode: an unknown key
fails); `validate_config` rejects contradictions before anything starts. Ray is started
locally (on a machine with no GPU, `trainer.n_gpus_per_node` CPU worker processes) or
joined at `trainer.ray_address` ("auto" or host:port, e.g. under Slurm). The driver loop
runs in this process; workers are Ray actors. Joining a cluster (or `RAY_ADDRESS`) waits at most
`trainer.ray_wait_s` for `trainer.nnodes` nodes of `trainer.n_gpus_per_node` workers each
(docs/multinode.md). Unlike the original, the driver is not a Ray task, which keeps it
importable and testable: `run_ppo(config)`.

Before Ray starts: the config is validated (keys, batch sizes, the optional packages the run
imports), and with `do_search=true` the retrieval server's /health must answer within
`retriever.health_wait_s` (in the tool protocol, the server of the tool config's
`retrieval_service_url`). With `retriever.serve=ray` the driver instead starts the server as a Ray
Serve application on the cluster once Ray is up (one replica per node), before any worker, and
deletes it at the end (search_r1/search/ray_serve.py). `+trainer.preflight=true` stops after the checks (verl/trainer/preflight.py):
exit status 0/1 in seconds, with no Ray, worker or weights.

veRL's recipes compose too (example/tool_recipe/): `--config-path <dir> --config-name <recipe>`
with a recipe whose defaults list holds ppo_trainer, and veRL's `trainer.val_before_train=...`
without `+` (`normalize_overrides`). A key ppo_trainer.yaml does not declare is refused, saying so.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf

from verl.trainer.config_check import check_cluster_settings, check_runtime, validate_config
from verl.trainer.config_schema import ConfigError, check_override_keys, normalize_overrides, trainer_flag
from verl.trainer.run_config import Pools, Protocol, Trainer

if TYPE_CHECKING:   # the trainer's module (torch, tensordict) is imported by what builds one: preflight does not
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "config"
# Every worker's environment unless the user's own says otherwise (`worker_env`); why each is set, and
# which of veRL's variables (verl/trainer/constants_ppo.py) are not: docs/multinode.md "Worker environment".
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",            # one process per device: no OpenMP pool per worker fighting over cores
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # no Rust thread pool (and no fork-after-use warning) in workers
    "NCCL_DEBUG": "WARN",               # an NCCL failure prints NCCL's own reason, not only torch's error code
    "VLLM_LOGGING_LEVEL": "WARN",       # every engine's per-wake INFO lines would flood the driver's log
}


def worker_env(environ: Mapping[str, str] | None = None, config: DictConfig | None = None) -> dict[str, str]:
    """The `env_vars` of the workers' Ray runtime_env: WORKER_ENV, where a variable set in the driver's
    environment keeps the driver's value. Ray's runtime_env env_vars override what a worker inherits from
    its node's raylet, so this is how a user's `export NCCL_DEBUG=INFO` (before `python -m
    verl.trainer.main_ppo`) reaches every worker on every node instead of being replaced by the default.
    With a vLLM rollout that keeps a LoRA base across level-1 sleeps (`config`: rollout.name vllm or auto,
    lora_rank > 0, rollout.lora_sync=adapter), torch's pinned-allocator setting too (`pinned_alloc_conf`)."""
    environ = os.environ if environ is None else environ
    env = {key: environ.get(key, default) for key, default in WORKER_ENV.items()}
    if config is not None and level_one_sleep(config):
        env.update(pinned_alloc_conf(environ))
    return env


def level_one_sleep(config: DictConfig) -> bool:
    """Whether the vLLM engines sleep at level 1 (the LoRA base kept in pinned host memory): a vLLM
    rollout (name vllm, or auto: vLLM on a GPU host) with LoRA on and rollout.lora_sync=adapter."""
    rollout = config.actor_rollout_ref.rollout
    return (str(rollout.get("name", "auto")) != "hf" and int(config.actor_rollout_ref.model.get("lora_rank", 0) or 0) > 0
            and str(rollout.get("lora_sync", "adapter")) == "adapter")


def pinned_alloc_conf(environ: Mapping[str, str]) -> dict[str, str]:
    """torch's pinned-allocator setting for level-1 sleep, merged into the user's own value:
    `pinned_max_round_threshold_mb:16,pinned_max_cached_size_mb:16` (verl.utils.host_memory_plan.PINNED_ALLOC_SETTINGS).

    vLLM's level-1 sleep backs each weight segment up with a pinned host tensor. By default torch's pinned
    allocator rounds every block up to a power of two (pinned_max_round_threshold defaults to SIZE_MAX):
    up to 2x host memory, which cannot be swapped (Qwen2.5-7B, TP=1: 26.8 GiB instead of 14.2 a rank).
    The round threshold alone is unsafe: a block above it keeps its exact size yet is cached in its
    power-of-two bucket, and the bucket's next request of a larger size in the same bucket gets it back
    (ATen/core/CachingHostAllocator.h get_free_block: no size check), so the next sleep's copy overruns it.
    With the cache capped at the same 16 MiB, blocks above it are freed instead of cached: exact sizes,
    nothing reused wrongly; each sleep pins its large backups anew (time in timing_s/rollout_sleep).
    torch reads PYTORCH_ALLOC_CONF, else its older name PYTORCH_CUDA_ALLOC_CONF: the settings go into the
    one the user set (PYTORCH_ALLOC_CONF when neither), with the user's other settings; a key the user
    gave is kept. Set in the runtime_env, so before CUDA initialises in any worker."""
    from verl.utils.host_memory_plan import PINNED_ALLOC_SETTINGS

    name = ("PYTORCH_CUDA_ALLOC_CONF" if "PYTORCH_CUDA_ALLOC_CONF" in environ and "PYTORCH_ALLOC_CONF" not in environ
            else "PYTORCH_ALLOC_CONF")
    value = environ.get(name, "").strip().strip(",")
    added = [f"{key}:{mb}" for key, mb in PINNED_ALLOC_SETTINGS.items() if key not in value]
    return {name: ",".join(p for p in (value, *added) if p)}


def resolve_checkpoint_dir(config: DictConfig) -> str:
    """`trainer.default_local_dir` as an absolute path (`~` expanded), set in `config` (in place) and
    returned: resolved once, here in the driver, before any worker exists, so that every rank writes
    where the driver reads instead of resolving a relative path against its own working directory."""
    path = os.path.abspath(os.path.expanduser(str(config.trainer.default_local_dir)))
    config.trainer.default_local_dir = path
    return path


def compose_config(overrides: list[str] | None = None, config_name: str = "ppo_trainer",
                   config_dir: str | Path | None = None) -> DictConfig:
    """The config `python -m verl.trainer.main_ppo [--config-path <config_dir> --config-name <config_name>]
    <overrides>` would see (for tests and scripts). `config_dir` (default verl/trainer/config) may be
    relative to the working directory, as may a recipe's `hydra.searchpath` (veRL's `file://verl/trainer/config`:
    run from the repository root)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = normalize_overrides(list(overrides or []))
    check_override_keys(overrides)
    GlobalHydra.instance().clear()
    directory = Path(config_dir).resolve() if config_dir is not None else CONFIG_DIR
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _has_gpu(config: DictConfig) -> bool:
    """Whether the workers train on GPUs: decided from the Ray cluster's resources once Ray is up
    (a CPU-only head node may drive a GPU cluster), else from this machine (the local cluster
    `_init_ray` starts sees the same GPUs)."""
    if config.trainer.device == "cpu":
        return False
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    from verl.utils.device import is_cuda_available

    return bool(is_cuda_available())


def wait_for_retriever(config: DictConfig) -> str:
    """Block until the retrieval server answers, for at most `retriever.health_wait_s` (under Slurm the
    server may still be loading its index); returns the url that answered. The server is `retriever.url`,
    or in the tool protocol the tool config's `retrieval_service_url` (`retrieval_endpoint`).

    GET <url base>/health, every 2 s; a server without /health (404/405, e.g. the original Search-R1
    server) passes when one POST /retrieve answers. A RuntimeError names the url's setting and what was tried.
    """
    import requests

    from search_r1.search.client import RetrievalClient, RetrievalError

    url, timeout, setting, where = Protocol.from_config(config).retrieval_endpoint(config)
    wait_s = float(config.retriever.health_wait_s)
    client = RetrievalClient(url, topk=1, timeout=timeout, max_retries=0)
    health = client.health_url
    start = time.monotonic()
    deadline, next_log = start + wait_s, start + 30.0
    tries, last = 0, ""
    try:
        while True:
            tries += 1
            try:
                response = requests.get(health, timeout=max(1.0, min(10.0, deadline - time.monotonic())))
            except requests.RequestException as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 200:
                    logger.info("retrieval server at %s answered /health after %.1f s", url, time.monotonic() - start)
                    return health
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code in (404, 405):
                    try:
                        client.retrieve(["health check"], topk=1)
                        logger.info("retrieval server at %s has no /health; POST /retrieve answered", url)
                        return url
                    except RetrievalError as exc:
                        last += f"; POST {url}: {exc}"
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_log:
                logger.info("waiting for the retrieval server at %s (%.0f s left): %s", url, deadline - now, last)
                next_log = now + 30.0
            time.sleep(min(2.0, deadline - now))
    finally:
        client.close()
    raise RuntimeError(
        f"do_search=true but the retrieval server at {setting}={url} did not answer: GET {health} tried "
        f"{tries} time(s) over {time.monotonic() - start:.0f} s (retriever.health_wait_s={wait_s:g}); last: {last}. "
        f"Start it (bash retrieval_launch.sh, docs/retriever.md) or fix {where}. No worker was started.")


def deploy_retriever(config: DictConfig) -> None:
    """`retriever.serve=ray`: start the retrieval server as a Ray Serve application on the cluster, one
    replica per node by default, and wait (at most `retriever.health_wait_s`) until every replica serves
    (search_r1/search/ray_serve.py)."""
    import ray

    from search_r1.search.ray_serve import ServeSettings, deploy
    from search_r1.search.serve_checks import nodes_from_ray, replica_gpu_error

    settings = ServeSettings.from_config(config.retriever)
    # The cluster's nodes are known now: a replica must not take a GPU the workers (placed after it) need.
    nodes = ray.nodes()
    custom = {k: v for k, v in settings.replica_resources.items() if k not in ("num_cpus", "num_gpus")}
    error = replica_gpu_error(settings.replica_resources.get("num_gpus", 0.0), custom,
                              per_node_need(config, nodes).get("GPU", 0.0), nodes_from_ray(nodes))
    if error:
        raise ConfigError(error + " No retrieval replica and no worker was started.")
    deploy(settings)


REPLICAS_FILE = "retrieval_replicas.json"


def record_replicas(config: DictConfig, app_name: str) -> None:
    """Write each live replica's /health (node, counters, callers by node) to `<log dir>/retrieval_replicas.json`
    before the application is deleted: what served the run's searches, from where."""
    import json

    from search_r1.search.ray_serve import replica_health, wait_until_running
    from verl.trainer.ppo.ray_trainer import run_log_dir

    path = run_log_dir(config) / REPLICAS_FILE
    try:
        # a replica Serve is restarting (one died during the run) is recorded once it serves
        if not wait_until_running(app_name, timeout_s=60.0):
            logger.warning("not every retrieval replica runs after 60 s; recording those that answer")
        health = replica_health(app_name, timeout_s=30.0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(health, indent=1, sort_keys=True))
        logger.info("retrieval replicas at the end of the run (%s): %s", path, {
            node[:8]: h["counters"]["queries"] for node, h in health.items()})
    except Exception as err:   # a summary; the run's outcome must not depend on it
        logger.warning("could not record the retrieval replicas' counters: %s", err)


def local_serve_cpus(config: DictConfig) -> int:
    """CPUs a local Ray needs beyond the workers for the retrieval replica (`retriever.serve=ray`)."""
    if not Protocol.from_config(config).serve_retriever:
        return 0
    replicas = config.retriever.replicas
    return math.ceil(float(config.retriever.replica_resources.num_cpus) * (1 if replicas is None else int(replicas)))


def per_node_need(config: DictConfig, nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Resources one node must have for its `trainer.n_gpus_per_node` workers: GPUs (and a CPU each)
    on a GPU cluster or with trainer.device=cuda, CPUs only with trainer.device=cpu or when no live
    node has a GPU (CPU workers)."""
    workers = float(config.trainer.n_gpus_per_node)
    device = config.trainer.device
    any_gpu = any(node.get("Resources", {}).get("GPU", 0) > 0 for node in nodes)
    if device == "cuda" or (device != "cpu" and any_gpu):
        return {"CPU": workers, "GPU": workers}
    return {"CPU": workers}


def wait_for_cluster(config: DictConfig) -> list[str]:
    """Block (at most `trainer.ray_wait_s`) until the joined cluster has `trainer.nnodes` nodes with
    the workers' resources each; a RuntimeError names what is missing. Returns the node ids."""
    from verl.single_controller.ray.base import wait_for_nodes

    nnodes, per_node = int(config.trainer.nnodes), int(config.trainer.n_gpus_per_node)
    return wait_for_nodes(
        nnodes, lambda nodes: per_node_need(config, nodes), timeout_s=float(config.trainer.ray_wait_s),
        what=f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node} (trainer.device={config.trainer.device})")


RAY_AUTH_MODE = "RAY_AUTH_MODE"   # Ray's switch for token authentication: token | disabled


def _init_ray(config: DictConfig, use_gpu: bool) -> bool:
    """Start or join Ray; returns True when this call started it (so it shuts it down). Joining a
    cluster waits (bounded) until it has the nodes the workers need."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": worker_env(config=config)}
    address = Trainer.from_config(config).cluster_address
    if address:
        ray.init(address=address, runtime_env=runtime_env)
        try:
            node_ids = wait_for_cluster(config)
        except BaseException:
            ray.shutdown()
            raise
        logger.info("joined the Ray cluster at %s: %d node(s) fit the workers (%s)", address, len(node_ids),
                    ", ".join(n[:8] for n in node_ids))
    else:
        # A local cluster is this machine's processes only: Ray 2.60 would otherwise turn on token
        # auth by default, warn on every run and write ~/.ray/auth_token. An explicit
        # RAY_AUTH_MODE (e.g. token) still wins; joining a cluster (above) keeps the cluster's mode.
        os.environ.setdefault(RAY_AUTH_MODE, "disabled")
        # One CPU per worker process plus one for the driver's own tasks.
        ray.init(num_cpus=Pools.from_config(config).total_workers + 1 + local_serve_cpus(config), num_gpus=None if use_gpu else 0,
                 include_dashboard=False, runtime_env=runtime_env)
    return True


def build_trainer(config: DictConfig, reward_fn: Any = None, val_reward_fn: Any = None) -> RayPPOTrainer:
    """Resolve and validate `config` (in place), load the tokenizer, map roles to worker classes
    and pools; workers not yet spawned."""
    from transformers import AutoTokenizer

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, ResourcePoolManager, Role
    from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
    from verl.workers.rollout import resolve_rollout_name

    # Every `${...}` becomes its value now, as in veRL / Search-R1: the colocated workers divide
    # their batch sizes in place, and an interpolation (critic.ppo_mini_batch_size ->
    # actor.ppo_mini_batch_size) would otherwise read the actor's already divided value.
    OmegaConf.resolve(config)
    resolve_checkpoint_dir(config)
    use_gpu = _has_gpu(config)
    run = validate_config(config, has_gpu=use_gpu)
    # rollout.name=auto: vLLM where there is a GPU and vllm, the HF loop otherwise (the CPU default).
    config.actor_rollout_ref.rollout.name = resolve_rollout_name(config.actor_rollout_ref.rollout.name, use_gpu)
    check_runtime(config, has_gpu=use_gpu)
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    default_reward = reward_fn is None
    if default_reward:
        from verl.workers.reward_manager import build_reward_managers

        # Validation reports plain EM (or the custom function) through the training reward's scorers.
        reward_fn, default_val_fn = build_reward_managers(config, tokenizer)
        val_reward_fn = val_reward_fn or default_val_fn

    layout = run.pools.layout()
    train_pool = "train_pool" if "train_pool" in layout else "global_pool"
    role_worker_mapping: dict[Role, type] = {Role.ActorRollout: ActorRolloutRefWorker}
    mapping = {Role.ActorRollout: train_pool}
    if "rollout_pool" in layout:   # trainer.pipeline: the rollout on a pool of its own
        role_worker_mapping[Role.Rollout] = ActorRolloutRefWorker
        mapping[Role.Rollout] = "rollout_pool"
    if run.algorithm.need_critic:
        role_worker_mapping[Role.Critic] = CriticWorker
        mapping[Role.Critic] = train_pool
    pools = ResourcePoolManager(resource_pool_spec=layout, mapping=mapping, use_gpu=use_gpu)
    trainer = RayPPOTrainer(config, tokenizer, role_worker_mapping, pools, reward_fn=reward_fn,
                            val_reward_fn=val_reward_fn)
    if default_reward and not config.get("custom_reward_function", {}).get("path"):
        from verl.utils.reward_score import validate_data_sources

        # Fail before any worker starts, not at the first reward of the first step.
        validate_data_sources(set(trainer.train_dataset.data_source) | set(trainer.val_dataset.data_source))
    return trainer


def run_ppo(config: DictConfig, reward_fn: Any = None, val_reward_fn: Any = None) -> list[dict[str, float]]:
    """Train per `config`; returns the per-step metrics. `reward_fn` replaces the rule reward (tests)."""
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    if trainer_flag(config, "preflight") is True:
        from verl.trainer.preflight import run_preflight

        run_preflight(config).raise_if_failed()
        return []
    check_cluster_settings(config)
    # Seconds of checks before anything is waited for or started (the GPU-dependent ones again
    # in build_trainer, once the workers' host is known).
    OmegaConf.resolve(config)
    run = validate_config(config)
    serving = run.protocol.serve_retriever
    if config.do_search and not serving and run.protocol.uses_retrieval_server():
        wait_for_retriever(config)
    trainer, started_ray, served_app = None, False, None
    try:
        if run.trainer.cluster_address:
            # Joining a cluster: its resources, not this node's, say whether the workers have GPUs.
            started_ray = _init_ray(config, use_gpu=True)
            trainer = build_trainer(config, reward_fn=reward_fn, val_reward_fn=val_reward_fn)
        else:
            # Config, data and reward checks run before a local Ray starts: a bad run fails in seconds.
            trainer = build_trainer(config, reward_fn=reward_fn, val_reward_fn=val_reward_fn)
            started_ray = _init_ray(config, use_gpu=_has_gpu(config))
        if serving:
            # named before the (long) deploy, so that an interrupt during it still deletes the application
            served_app = str(config.retriever.serve_app_name)
            deploy_retriever(config)
        trainer.init_workers()
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.shutdown()
        if served_app is not None:
            from search_r1.search.ray_serve import undeploy

            record_replicas(config, served_app)
            undeploy(served_app)
        if started_ray:
            import ray

            ray.shutdown()


@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO)
    if trainer_flag(config, "preflight") is True:
        from verl.trainer.preflight import preflight_main

        raise SystemExit(preflight_main(config))
    logger.info("config:\n%s", OmegaConf.to_yaml(config))
    run_ppo(config)


def cli(argv: list[str] | None = None) -> None:
    """`python -m verl.trainer.main_ppo ...`: the command line normalized (`normalize_overrides`) and its
    keys checked (`check_override_keys`) before Hydra composes it."""
    args = normalize_overrides(sys.argv[1:] if argv is None else argv)
    try:
        check_override_keys(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    sys.argv = [sys.argv[0], *args]
    main()


if __name__ == "__main__":
    cli()
