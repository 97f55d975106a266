"""Preflight: check a composed trainer config in seconds, with no Ray, worker or weights.

    python -m verl.trainer.main_ppo <the run's overrides...> +trainer.preflight=true
    bash train_grpo.sh <overrides...> +trainer.preflight=true        # through a launcher

The same entry point and overrides as the run, so the config is composed exactly as the run
would compose it. Every check runs and every failure is collected (each `{key, message}`):
- the cluster settings and every `validate_config` rule (keys, batch sizes, TP, lengths, the
  optional packages the run imports: loggers, vllm, flash-attn only under model.packing_kernel=flash_attn;
  packing itself needs torch's varlen_attn on CUDA), and the per-worker batch sizes
  the workers will compute (`normalize_actor_batch_sizes` / `normalize_critic_batch_sizes`, on copies);
- the data files: readable, their columns, a scorer for every `data_source`, and (when the
  tokenizer is on this machine) how many prompts exceed the prompt bound;
- the retriever with `do_search`: `/health` within a few seconds, what it serves, one query's
  latency (a URL that does not answer is an error); under ray_on_slurm.sh, which starts its own
  server after this check (SEARCH_R1_PREFLIGHT_RETRIEVER=job), the index / corpus paths instead, and
  FAISS with GPU support when that server searches a dense index on GPU (`faiss_device`);
- the checkpoint folder writable, with disk for `trainer.max_ckpt_to_keep` checkpoints;
- a per-GPU memory plan per phase (verl/utils/memory_plan.py) against `trainer.gpu_memory_gib`
  (null: this machine's GPU memory; required on a GPU run when this machine has none), and a host
  memory plan per node (verl/utils/host_memory_plan.py) against `trainer.host_memory_gib` (null: the
  figures, no verdict); both in verl/trainer/preflight_memory.py.
Prints a one-screen report and writes JSON to `trainer.preflight_report` (null:
`<trainer.default_local_dir>/preflight.json`). Exit status 0 when the checks pass and the plan
fits (or the workers are CPU processes, where no GPU memory applies), else 1.
scripts/slurm/ray_on_slurm.sh runs it before it starts any Ray node or the retrieval server.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from verl.trainer import config_check as cc
from verl.trainer.preflight_memory import JOB_RETRIEVER_ENV, check_host_memory, check_memory_and_disk
from verl.trainer.preflight_report import PreflightReport, key_of
from verl.trainer.run_config import RunConfig

RETRIEVER_PROBE_S = 5.0      # bounded wait for /health here (the run itself waits retriever.health_wait_s)
# The launcher's retriever variables (example/retriever/_common.sh): any set means its own index, not the example.
RETRIEVER_VARS = ("file_path", "index_file", "corpus_file", "retriever_name", "retriever_path")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")

__all__ = ["PreflightReport", "key_of", "preflight_main", "run_preflight"]


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
    address = config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or None
    return None if address else False


def _sp(node: Any, world: int) -> int:
    """A section's Ulysses SP size where it divides the world, else 1 (config_check reports it)."""
    size = node.get("ulysses_sequence_parallel_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 and world % size == 0 else 1


def check_sequence_parallel_heads(cfg: DictConfig, run: RunConfig, report: PreflightReport) -> None:
    """Ulysses splits the attention heads over an SP group: both head counts of the model must divide by its size."""
    from verl.utils.memory_plan import read_model_config
    from verl.utils.ulysses import check_heads

    sections = [("actor_rollout_ref.actor", "actor_rollout_ref.model")]
    if run.algorithm.need_critic:
        sections.append(("critic", "critic.model"))
    for where, model_key in sections:
        size = _sp(OmegaConf.select(cfg, where), run.pools.world_size)
        if size == 1:
            continue
        try:
            model, source = read_model_config(str(OmegaConf.select(cfg, f"{model_key}.path")))
        except (OSError, ValueError):
            continue                              # check_memory_and_disk reports the missing config.json
        heads = int(model.get("num_attention_heads", 0) or 0)
        kv_heads = int(model.get("num_key_value_heads") or heads)
        try:
            check_heads(heads, kv_heads, size, key=f"{where}.ulysses_sequence_parallel_size")
        except ValueError as exc:
            report.error(f"{exc} ({source})", f"{where}.ulysses_sequence_parallel_size")


def _per_worker_sizes(cfg: DictConfig, run: RunConfig, report: PreflightReport) -> None:
    """The workers' own division of the global batch sizes, on copies of their config sub-trees."""
    from verl.workers.worker_config import normalize_actor_batch_sizes, normalize_critic_batch_sizes

    world = run.pools.world_size
    role = "actor_rollout_ref" if run.algorithm.need_reference_policy else "actor_rollout"
    actor = copy.deepcopy(cfg.actor_rollout_ref)
    try:   # data parallelism is over world / ulysses_sequence_parallel_size (config_check refuses one that does not divide)
        normalize_actor_batch_sizes(actor, role, world // _sp(cfg.actor_rollout_ref.actor, world))
        report.lines.append(
            f"actor per worker: mini-batch {actor.actor.ppo_mini_batch_size} rows, micro-batch "
            f"{actor.actor.ppo_micro_batch_size}, log-prob micro-batch {actor.rollout.log_prob_micro_batch_size}; "
            f"{run.batches.optimizer_steps['actor']} optimizer step(s) per training step")
    except ValueError as exc:
        report.error(f"actor worker batch sizes over {world} workers: {exc}", key_of(str(exc)))
    if run.algorithm.need_critic:
        critic = copy.deepcopy(cfg.critic)
        try:
            normalize_critic_batch_sizes(critic, world // _sp(cfg.critic, world))
            report.lines.append(
                f"critic per worker: mini-batch {critic.ppo_mini_batch_size} rows, micro-batch "
                f"{critic.ppo_micro_batch_size}, forward micro-batch {critic.forward_micro_batch_size}; "
                f"{run.batches.optimizer_steps['critic']} optimizer step(s) per training step")
        except ValueError as exc:
            report.error(f"critic worker batch sizes over {world} workers: {exc}", key_of(str(exc)))


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _local_tokenizer(path: str) -> Any:
    """The model's tokenizer if it is on this machine (no download), else None. A folder without
    tokenizer files (example/model_configs/*: config.json only) has none; transformers would build
    an empty one from config.json alone."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:   # no tokenizer files (a config-only folder), or not in the local cache
        return None


def check_data(cfg: DictConfig, run: RunConfig, report: PreflightReport) -> None:
    """Each data file readable with its columns, a scorer for every data_source; prompts over the bound
    counted when the tokenizer is on this machine."""
    import pyarrow.parquet as pq

    from verl.utils.dataset.rl_dataset import REQUIRED_COLUMNS
    from verl.utils.reward_score import SUPPORTED_DATA_SOURCES

    prompt_key = str(cfg.data.prompt_key)
    bound, bound_key = run.protocol.prompt_bound, run.protocol.prompt_bound_key
    tokenizer = _local_tokenizer(str(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path))
    for key in ("data.train_files", "data.val_files"):
        for path in _files(OmegaConf.select(cfg, key)):
            if not Path(path).is_file():
                report.error(f"{key}: {path} does not exist: build it (README.md, 'Your own data and corpus') "
                             f"or point {key} at it", key)
                continue
            try:
                table = pq.read_table(path)
            except Exception as exc:   # not parquet, unreadable: pyarrow's own message says which
                report.error(f"{key}: {path} is not a readable parquet file ({type(exc).__name__}: {exc})", key)
                continue
            missing = [c for c in (prompt_key, *REQUIRED_COLUMNS) if c not in table.column_names]
            if missing:
                report.error(f"{key}: {path} has no column(s) {missing} (columns: {table.column_names}); "
                              f"data.prompt_key={prompt_key}", key)
                continue
            sources = sorted({str(v) for v in table.column("data_source").to_pylist()})
            unknown = [s for s in sources if s not in SUPPORTED_DATA_SOURCES]
            if unknown:
                report.error(f"{key}: {path} has data_source {unknown} with no reward scorer (supported: "
                              f"{sorted(SUPPORTED_DATA_SOURCES)}): fix the rows' data_source or add a scorer in "
                              "verl/utils/reward_score", key)
            over = "not counted (no tokenizer on this machine for the model path)"
            if tokenizer is not None:
                from verl.utils.dataset.rl_dataset import chat_template_kwargs, prompt_to_text

                try:
                    kwargs = chat_template_kwargs(cfg)
                    lengths = [len(tokenizer(prompt_to_text(p, tokenizer, chat_template_kwargs=kwargs),
                                             add_special_tokens=False)["input_ids"])
                               for p in table.column(prompt_key).to_pylist()]
                    over = f"{sum(n > bound for n in lengths)} over {bound_key}={bound} tokens"
                except Exception as exc:   # a template this tokenizer cannot render: counted by the run
                    over = f"not counted ({type(exc).__name__}: {exc})"
            report.lines.append(f"data {key}: {path}: {table.num_rows} rows, sources {sources}; prompts {over}")


def check_serve_files(cfg: DictConfig, report: PreflightReport) -> None:
    """`retriever.serve=ray`: the index and corpus the replicas will load exist here (with a shared file
    system, on every node); the rest (flags, replicas) is in the config check."""
    args = cfg.retriever.server_args or {}
    found = []
    for key in ("index_path", "corpus_path"):
        value = args.get(key)
        if not value:
            continue
        if not Path(str(value)).exists():
            report.error(f"retriever.server_args.{key}={value}: not found here; every Serve replica loads it on its "
                         "own node", f"retriever.server_args.{key}")
        else:
            found.append(f"{key}={value} ({_size(Path(str(value)))})")
    replicas = cfg.retriever.replicas
    report.lines.append(f"retriever: Ray Serve application {cfg.retriever.serve_app_name!r}, "
                        f"{'one replica per node' if replicas is None else f'{replicas} replica(s)'}, started by the "
                        "driver" + (f"; {', '.join(found)}" if found else ""))


def check_retriever(cfg: DictConfig, run: RunConfig, report: PreflightReport) -> None:
    """With do_search: the server answers /health within RETRIEVER_PROBE_S, and one query; or, when the
    launcher starts its own server after preflight, the index and corpus it will load exist."""
    if not cfg.do_search:
        return
    if run.protocol.serve_retriever:
        check_serve_files(cfg, report)
        return
    try:
        url, timeout, setting, where = run.protocol.retrieval_endpoint(cfg)
    except KeyError:   # a search tool without retrieval_service_url: the tool config's own check says so
        return
    if os.environ.get(JOB_RETRIEVER_ENV) == "job":
        found = []
        for var in ("index_file", "corpus_file", "file_path"):
            value = os.environ.get(var)
            if value:
                if not Path(value).exists():
                    report.error(f"{var}={value}: not found; the job's retrieval server (retrieval_launch.sh) "
                                 "would fail to load it", var)
                else:
                    found.append(f"{var}={value} ({_size(Path(value))})")
        report.lines.append("retriever: started by the job after preflight (retrieval_launch.sh); "
                            + (", ".join(found) if found else "the example corpus or its own defaults"))
        check_job_faiss(report)
        return
    import requests

    from search_r1.search.client import RetrievalClient

    client = RetrievalClient(url, topk=1, timeout=min(timeout, RETRIEVER_PROBE_S), max_retries=0)
    deadline = time.monotonic() + min(RETRIEVER_PROBE_S, float(cfg.retriever.health_wait_s))
    last = ""
    try:
        while True:
            try:
                response = requests.get(client.health_url, timeout=max(0.5, deadline - time.monotonic()))
                if response.status_code == 200:
                    health = response.json()
                    start = time.monotonic()
                    client.retrieve(["preflight check"], topk=1)
                    serves = ", ".join(f"{k}={health[k]}" for k in ("retriever", "corpus_size", "device")
                                       if k in health)
                    report.lines.append(f"retriever: {setting}={url} answers: {serves or health}; one query "
                                        f"{(time.monotonic() - start) * 1000:.0f} ms")
                    return
                last = f"HTTP {response.status_code}"
            except Exception as exc:   # connection refused, timeout, a bad answer: all mean "not ready"
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
    finally:
        client.close()
    report.error(f"do_search=true but the retrieval server at {setting}={url} did not answer GET {client.health_url} "
                 f"within {RETRIEVER_PROBE_S:g} s ({last[:200]}): start it (bash retrieval_launch.sh) or fix {where}",
                 "retriever.url" if setting == "retriever.url" else where)


def job_server_is_dense(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the job's retrieval server (retrieval_launch.sh) will search a dense FAISS index: as the
    launcher decides, a retriever variable set (example/retriever/_common.sh `retriever_vars_set`; none:
    the example BM25 index) and retriever_name, default e5, not bm25. The trainer never imports FAISS."""
    if not any(env.get(var) for var in RETRIEVER_VARS):
        return False
    return (env.get("retriever_name") or "e5") != "bm25"


def check_job_faiss(report: PreflightReport) -> None:
    """The job's dense server searches on GPU when `faiss_device` is gpu, or auto on a GPU host: then FAISS
    must import with GPU support (`StandardGpuResources`, GPUs seen by `faiss.get_num_gpus()`), or
    retrieval_launch.sh would stop after the cluster started. The decision is the launcher's own
    (search_r1/search/faiss_device.py)."""
    if not job_server_is_dense():
        return
    from search_r1.search import faiss_device as fd

    requested = os.environ.get("faiss_device") or "auto"
    if requested not in fd.FAISS_DEVICES:
        report.error(f"faiss_device={requested!r}: must be one of {', '.join(fd.FAISS_DEVICES)} (the job's dense "
                     "retrieval server, retrieval_launch.sh, would stop)", "faiss_device")
        return
    wants_gpu = requested == "gpu" or (requested == "auto" and fd.is_gpu_host())
    try:
        import faiss
    except ImportError as err:
        hint = fd.INSTALL_HINT if wants_gpu else "pip install faiss-cpu"
        report.error(f"faiss_device={requested}: the job's dense retrieval server (retrieval_launch.sh, "
                     f"retriever_name={os.environ.get('retriever_name') or 'e5'}) needs FAISS, which does not "
                     f"import ({err}); {hint}", "faiss_device")
        return
    if not wants_gpu:
        return
    gpus = int(getattr(faiss, "get_num_gpus", lambda: 0)()) if hasattr(faiss, "StandardGpuResources") else 0
    if gpus > 0:
        report.lines.append(f"retriever: FAISS searches the dense index on GPU (faiss_device={requested}, "
                            f"{gpus} GPU(s) seen by FAISS)")
        return
    why = ("the installed FAISS is the CPU-only build" if not hasattr(faiss, "StandardGpuResources")
           else "the installed FAISS sees no GPU (faiss.get_num_gpus() = 0)")
    where = "faiss_device=gpu" if requested == "gpu" else "faiss_device=auto on this GPU host"
    report.error(f"{where}: the job's dense retrieval server (retrieval_launch.sh) searches the index with FAISS "
                 f"on GPU, but {why}; {fd.INSTALL_HINT}, or set faiss_device=cpu to search on CPU", "faiss_device")


def _size(path: Path) -> str:
    total = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{total / 1024 ** 3:.2f} GiB"


def check_context_length(cfg: DictConfig, report: PreflightReport) -> None:
    """vLLM refuses at engine start a context (`rollout.max_model_len`, or prompt + response length)
    longer than the model's `max_position_embeddings` (times a `rope_scaling` factor): say so now."""
    from verl.utils.memory_plan import read_model_config

    rollout = cfg.actor_rollout_ref.rollout
    if not (rollout.name == "vllm" or (rollout.name == "auto" and report.gpu_run)):
        return
    try:
        model, source = read_model_config(str(cfg.actor_rollout_ref.model.path))
    except (OSError, ValueError):
        return                                   # check_memory_and_disk reports the missing config.json
    positions = model.get("max_position_embeddings")
    if not isinstance(positions, int):
        return
    factor = (model.get("rope_scaling") or {}).get("factor") or 1
    limit = int(positions * factor)
    given = rollout.get("max_model_len")
    context = int(given) if given else int(rollout.prompt_length) + int(rollout.response_length)
    key = ("actor_rollout_ref.rollout.max_model_len" if given else
           "data.max_prompt_length+data.max_response_length")
    if context > limit:
        report.error(f"{key}={context} tokens is longer than the model's context: {source} has "
                     f"max_position_embeddings={positions}" + (f" x rope_scaling factor {factor}" if factor != 1 else "")
                     + f" = {limit}; vLLM would refuse it at engine start: lower it to <= {limit}",
                     key.split("+")[0])


def run_preflight(config: DictConfig, has_gpu: bool | None = None) -> PreflightReport:
    """Check `config` as the run would (on a resolved copy; `config` is not changed), every check
    run and every failure collected.

    `has_gpu`: whether the workers have GPUs; by default `host_has_gpu(config)`.
    """
    report = PreflightReport()
    try:
        cc.check_cluster_settings(config)
    except ValueError as exc:
        report.error(str(exc))
    cfg = copy.deepcopy(config)
    OmegaConf.resolve(cfg)
    if has_gpu is None:
        has_gpu = host_has_gpu(cfg)
    run, errors = cc.check(cfg, has_gpu)
    for message in errors:
        report.error(message)
    if run is None:          # a section's own values are wrong: the checks below would read them
        return report
    report.gpu_run = run.trainer.on_cuda(has_gpu) is not False
    trainer, rollout, pools = cfg.trainer, cfg.actor_rollout_ref.rollout, run.pools
    world = report.world_size = pools.world_size
    host = {True: "GPU", False: "CPU", None: "unknown from here (GPU-dependent checks skipped)"}[has_gpu]
    pool_line = (f" - trainer.rollout_pool={pools.rollout_pool} (trainer.pipeline={pools.pipeline}: the memory "
                 "plan's phase rollout_pool is a rollout GPU, the others a train GPU)" if pools.pipelined else "")
    report.lines.append(f"workers: trainer.nnodes={trainer.nnodes} x trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
                        f"{pool_line} = {world}; trainer.device={trainer.device}, host {host}; "
                        f"trainer.ray_address={trainer.ray_address}")
    engine = str(rollout.name)
    if engine == "auto" and has_gpu is not None:
        from verl.workers.rollout import resolve_rollout_name

        engine = f"auto -> {resolve_rollout_name('auto', has_gpu)}"
    report.lines.append(f"rollout: {engine}, mode={rollout.get('mode', 'sync')}, "
                        f"tensor_model_parallel_size={rollout.tensor_model_parallel_size}; "
                        f"{cfg.data.train_batch_size} prompts x {run.algorithm.samples_per_prompt} samples = "
                        f"{run.batches.rollouts_per_step} rollouts per step ({cfg.algorithm.adv_estimator})")
    report.lines.append(f"loggers: {', '.join(run.trainer.loggers)}")
    if run.sampling.enable:
        cap = run.sampling.max_num_gen_batches
        report.lines.append(f"dynamic sampling (algorithm.filter_groups): generation batches of data.gen_batch_size="
                            f"{run.sampling.gen_batch_size} prompts until {cfg.data.train_batch_size} prompts' groups "
                            f"differ in {run.sampling.metric}, at most {cap if cap > 0 else 'unbounded'} a step")
    if run.shaping.enable:
        report.lines.append(f"overlong shaping (reward_model.overlong_buffer): penalty from "
                            f"{int(cfg.data.max_response_length) - run.shaping.len} tokens, up to "
                            f"-{run.shaping.penalty_factor:g} at data.max_response_length={cfg.data.max_response_length}")
    if run.protocol.tool:
        mt = rollout.multi_turn
        report.lines.append(f"tool protocol: {mt.tool_config_path}; max_assistant_turns={mt.max_assistant_turns}, "
                            f"max_user_turns={mt.max_user_turns}; prompts <= data.max_prompt_length="
                            f"{cfg.data.max_prompt_length}, all turns <= data.max_response_length="
                            f"{cfg.data.max_response_length} tokens")
    _per_worker_sizes(cfg, run, report)
    check_sequence_parallel_heads(cfg, run, report)
    check_data(cfg, run, report)
    check_retriever(cfg, run, report)
    check_context_length(cfg, report)
    check_host_memory(cfg, report, check_memory_and_disk(cfg, report))
    return report


def report_path(config: DictConfig) -> Path:
    """trainer.preflight_report, else <trainer.default_local_dir>/preflight.json."""
    value = OmegaConf.select(config, "trainer.preflight_report", default=None)
    if value:
        return Path(str(value))
    return Path(str(OmegaConf.select(config, "trainer.default_local_dir"))) / "preflight.json"


def preflight_main(config: DictConfig) -> int:
    """`+trainer.preflight=true`: print the report, write its JSON; 0 when the run would start and fit, else 1."""
    report = run_preflight(config)
    path = report_path(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        report.report_path = str(path)
    except OSError as exc:
        report.error(f"trainer.preflight_report: cannot write {path} ({exc})", "trainer.preflight_report")
    print(report.render(), flush=True)
    return 0 if report.passed else 1
