"""`+trainer.preflight=true`: the run's own config, composed and checked in seconds, with no Ray,
worker or weights; every failure collected with its key, a per-GPU memory plan, a JSON report;
exit status 0 when the run would start and fit, 1 otherwise (verl/trainer/preflight.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import free_port
from tests.trainer._preflight_data import write_data
from verl.trainer import main_ppo
from verl.trainer.config_check import ConfigError
from verl.trainer.main_ppo import compose_config, run_ppo
from verl.trainer.preflight import run_preflight

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "example" / "model_configs"
QWEN_7B = str(CONFIGS / "qwen2.5-7b")
# 2 workers: 8 prompts x 1 sample, mini-batches of 4 rollouts, micro-batches of 2
SMALL = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size=2", "critic.ppo_micro_batch_size=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size=2", "actor_rollout_ref.ref.log_prob_micro_batch_size=2",
         "trainer.logger=[console]", "do_search=false", f"actor_rollout_ref.model.path={QWEN_7B}",
         f"critic.model.path={QWEN_7B}"]
# 2 nodes x 8 GPUs joined through Slurm, the PPO recipe (one critic row per worker)
TWO_BY_EIGHT = ["trainer.ray_address=auto", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                "data.train_batch_size=512", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                "actor_rollout_ref.actor.ppo_micro_batch_size=64", "critic.ppo_micro_batch_size=16",
                "trainer.logger=[console]", "do_search=false", f"actor_rollout_ref.model.path={QWEN_7B}",
                f"critic.model.path={QWEN_7B}", "trainer.gpu_memory_gib=80",
                "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true"]


@pytest.fixture
def data(tmp_path: Path) -> list[str]:
    return write_data(tmp_path / "data")


def keys(report) -> list[str]:
    return [e["key"] for e in report.errors]


def test_a_valid_config_passes_with_the_per_worker_sizes_the_workers_will_use(data: list[str]) -> None:
    cfg = compose_config([*SMALL, *data])
    report = run_preflight(cfg, has_gpu=False)
    assert report.ok and report.passed, report.render()
    text = report.render()
    assert "trainer.nnodes=1 x trainer.n_gpus_per_node=2 = 2" in text
    assert "rollout: auto -> hf" in text
    # normalize_actor/critic_batch_sizes' own results: 4 rollouts / 2 workers, 2 rows / 2 workers
    assert "actor per worker: mini-batch 2 rows, micro-batch 1, log-prob micro-batch 1; 2 optimizer step(s)" in text
    assert "critic per worker: mini-batch 2 rows, micro-batch 1, forward micro-batch 1" in text
    assert "4 rows, sources ['nq']; prompts not counted (no tokenizer" in text      # config-only model folder
    # CPU workers: the plan is shown, no GPU memory applies (fits undecided, exit 0)
    assert report.fits is None and "memory plan per GPU (model 7.62 B params" in text
    assert text.endswith("preflight OK")
    # the workers divided copies: the caller's config is untouched, interpolations included
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert OmegaConf.is_interpolation(cfg.critic, "ppo_mini_batch_size")


def test_a_micro_batch_that_does_not_divide_the_world_fails_naming_the_key(data: list[str]) -> None:
    report = run_preflight(compose_config([*TWO_BY_EIGHT, *data, "critic.ppo_micro_batch_size=8"]))
    assert not report.ok and not report.passed
    text = report.render()
    assert "preflight FAILED" in text
    assert "critic.ppo_micro_batch_size=8 is not divisible by trainer.nnodes*trainer.n_gpus_per_node=16" in text
    assert "critic.ppo_micro_batch_size" in keys(report)
    # the critic worker's own division (normalize_critic_batch_sizes), reported with the world size
    assert "critic worker batch sizes over 16 workers: critic.ppo_micro_batch_size=8 (x1) is not divisible by " \
           "the 16 data-parallel workers" in text
    good = run_preflight(compose_config([*TWO_BY_EIGHT, *data]))
    assert good.passed and good.fits is True, good.render()


def test_every_failure_is_collected_not_only_the_first(data: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    report = run_preflight(compose_config([*SMALL, *data, "trainer.nnodes=2", "trainer.logger=[console,wandb]",
                                           f"data.val_files={tmp_path / 'missing.parquet'}"]), has_gpu=False)
    found = keys(report)
    assert "trainer.nnodes" in found and "trainer.logger" in found and "data.val_files" in found, report.render()
    assert any("`pip install -e .[wandb]`" in e["message"] for e in report.errors)
    assert any(f"{tmp_path / 'missing.parquet'} does not exist" in e["message"] for e in report.errors)


def test_a_data_source_with_no_scorer_fails_naming_the_file_and_source(tmp_path: Path) -> None:
    data = write_data(tmp_path / "data", source="my_new_dataset")
    report = run_preflight(compose_config([*SMALL, *data]), has_gpu=False)
    assert "data.train_files" in keys(report), report.render()
    assert "data_source ['my_new_dataset'] with no reward scorer" in report.render()


def test_a_retriever_url_that_does_not_answer_is_an_error_naming_retriever_url(data: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    start = time.monotonic()
    report = run_preflight(compose_config([*SMALL, *data, "do_search=true", f"retriever.url={url}"]), has_gpu=False)
    assert time.monotonic() - start < 20
    assert "retriever.url" in keys(report), report.render()
    assert f"retriever.url={url} did not answer" in report.render()


@pytest.mark.parametrize("where", ["this machine", "planned elsewhere", "the slurm job"])
def test_checkpoints_that_do_not_fit_the_disk_fail_where_the_run_writes_them(
        data: list[str], monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import shutil

    from verl.trainer import preflight, preflight_memory
    from verl.utils import device

    monkeypatch.setattr(device, "is_cuda_available", lambda: False)
    monkeypatch.setattr(preflight_memory.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(100 * 2 ** 30, 99 * 2 ** 30, 2 ** 30))  # 1 GiB free
    overrides = [*SMALL, *data, "trainer.save_freq=10", "trainer.max_ckpt_to_keep=2"]
    if where != "this machine":     # a GPU run's memory verdict asked for: this CPU machine only plans it
        overrides.append("trainer.gpu_memory_gib=200")   # 7B on 2 GPUs without offload fits 200 GiB
    if where == "the slurm job":
        monkeypatch.setenv(preflight.JOB_RETRIEVER_ENV, "job")
    report = run_preflight(compose_config(overrides), has_gpu=where != "this machine")
    assert "2 x " in report.render() and "GiB free" in report.render()
    if where == "planned elsewhere":
        assert report.errors == [] and report.passed, report.render()
        assert [w["key"] for w in report.warnings] == ["trainer.max_ckpt_to_keep"]
        assert "not where this GPU run writes them" in report.render()
        assert report.to_json()["warnings"] == report.warnings
    else:
        assert keys(report) == ["trainer.max_ckpt_to_keep"] and not report.passed, report.render()
        assert report.warnings == []


def test_a_vllm_context_longer_than_the_models_positions_is_an_error(data: list[str]) -> None:
    # Qwen2.5-3B's config.json: max_position_embeddings=32768; vLLM refuses a longer max_model_len.
    qwen_3b = str(CONFIGS / "qwen2.5-3b")
    vllm = [*SMALL, *data, "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.model.path={qwen_3b}",
            f"critic.model.path={qwen_3b}"]
    report = run_preflight(compose_config([*vllm, "actor_rollout_ref.rollout.max_model_len=40000"]), has_gpu=True)
    assert "actor_rollout_ref.rollout.max_model_len" in keys(report)
    assert "max_position_embeddings=32768 = 32768" in report.render()
    report = run_preflight(compose_config([*vllm, "data.max_prompt_length=30000", "data.max_response_length=4000"]),
                           has_gpu=True)
    assert "data.max_prompt_length" in keys(report)
    assert "data.max_prompt_length+data.max_response_length=34000 tokens" in report.render()
    # within the model's positions, or the HF rollout (no such limit): no such error
    report = run_preflight(compose_config([*vllm, "actor_rollout_ref.rollout.max_model_len=32768"]), has_gpu=True)
    assert "actor_rollout_ref.rollout.max_model_len" not in keys(report)
    report = run_preflight(compose_config([*vllm, "actor_rollout_ref.rollout.name=hf",
                                           "actor_rollout_ref.rollout.max_model_len=40000"]), has_gpu=False)
    assert "actor_rollout_ref.rollout.max_model_len" not in keys(report)


def test_72b_on_one_80gb_gpu_without_offload_does_not_fit(data: list[str]) -> None:
    big = str(CONFIGS / "qwen2.5-72b")
    report = run_preflight(compose_config([
        *data, f"actor_rollout_ref.model.path={big}", "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "do_search=false",
        "trainer.logger=[console]", "trainer.gpu_memory_gib=80"]), has_gpu=True)
    assert report.ok and report.fits is False and not report.passed, report.render()
    assert report.largest_phase == "actor_update" and report.memory_plan_gib["actor_update"] > 80
    assert "DOES NOT FIT" in report.render() and "fsdp_config.param_offload" in report.fit_message
    # on a GPU run with no GPU memory known, fits is undecided and the message says what to set
    undecided = run_preflight(compose_config([*SMALL, *data]), has_gpu=True)
    assert undecided.fits is None and not undecided.passed
    assert "set trainer.gpu_memory_gib" in undecided.render()


def test_run_ppo_with_preflight_checks_and_returns_without_starting_anything(
        monkeypatch: pytest.MonkeyPatch, data: list[str]) -> None:
    def must_not_run(*args, **kwargs):
        raise AssertionError("preflight started part of the run")

    for name in ("build_trainer", "_init_ray", "wait_for_retriever"):
        monkeypatch.setattr(main_ppo, name, must_not_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_ppo(compose_config([*SMALL, *data, "+trainer.preflight=true", "trainer.device=cpu"])) == []
    with pytest.raises(ConfigError, match=r"preflight FAILED[\s\S]*actor_rollout_ref.actor.ppo_micro_batch_size=3"):
        run_ppo(compose_config([*SMALL, *data, "+trainer.preflight=true", "trainer.device=cpu",
                                "actor_rollout_ref.actor.ppo_micro_batch_size=3"]))


def _entry_point(tmp_path: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides, "+trainer.preflight=true",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def test_the_entry_point_exits_0_or_1_with_the_report_and_its_json(tmp_path: Path, data: list[str]) -> None:
    ok, seconds = _entry_point(tmp_path / "ok", [*TWO_BY_EIGHT, *data])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "preflight OK" in ok.stdout
    assert "host unknown from here" in ok.stdout      # joining a cluster from a machine with no GPU
    print(f"preflight of a 2 x 8 config through python -m verl.trainer.main_ppo: {seconds:.1f} s")
    assert seconds < 240                               # seconds on an idle machine; generous for a busy CI box
    report = json.loads((tmp_path / "data" / "ckpt" / "preflight.json").read_text())   # <default_local_dir>/
    assert report["ok"] is True and report["fits"] is True and report["world_size"] == 16
    bad_json = tmp_path / "bad.json"
    bad, _ = _entry_point(tmp_path / "bad", [*TWO_BY_EIGHT, *data, "critic.ppo_micro_batch_size=8",
                                             f"trainer.preflight_report={bad_json}"])
    assert bad.returncode == 1
    assert "preflight FAILED" in bad.stdout and "critic.ppo_micro_batch_size=8" in bad.stdout
    assert "Traceback" not in bad.stderr
    report = json.loads(bad_json.read_text())
    assert report["ok"] is False and "critic.ppo_micro_batch_size" in [e["key"] for e in report["errors"]]


def _launch(tmp_path: Path, script: str, model: str, *overrides: str, env: dict[str, str] | None = None
            ) -> tuple[subprocess.CompletedProcess, dict, float]:
    """`BASE_MODEL=example/model_configs/<model> bash <script> ... +trainer.preflight=true` through the real
    script (no GPU here: BASE_MODEL set, so not the demo)."""
    name = f"preflight-test-{uuid.uuid4().hex[:8]}"
    run_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "BASE_MODEL": f"example/model_configs/{model}", "DATA_DIR": str(tmp_path / "data"),
               "EXPERIMENT_NAME": name, **(env or {})}
    write_data(tmp_path / "data")
    report_file = tmp_path / "preflight.json"
    start = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", script, "+trainer.preflight=true", "trainer.gpu_memory_gib=80",
             f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.preflight_report={report_file}",
             *overrides],
            cwd=REPO, env=run_env, capture_output=True, text=True, timeout=300)
    finally:
        (REPO / f"{name}.log").unlink(missing_ok=True)     # the scripts tee their output into the repo root
    seconds = time.monotonic() - start
    assert report_file.is_file(), proc.stdout + proc.stderr
    return proc, json.loads(report_file.read_text()), seconds


def _train_ppo(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict, float]:
    return _launch(tmp_path, "train_ppo.sh", "qwen2.5-7b", *overrides, env={"N_GPUS": "8"})


def test_train_ppo_sh_with_the_7b_config_passes_preflight_without_search(tmp_path: Path) -> None:
    # PYTHONPROFILEIMPORTTIME: every module the launcher's Python imports is named in its output
    proc, report, seconds = _launch(tmp_path, "train_ppo.sh", "qwen2.5-7b", "do_search=false",
                                    env={"N_GPUS": "8", "PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # preflight checks the config without the trainer's module or the batch type: verl.protocol imports
    # tensordict, and with it torch._dynamo (~2 s of CPU of a ~7 s preflight)
    imported = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stdout + proc.stderr, re.M))
    assert {"verl.trainer.preflight", "verl.trainer.run_config"} <= imported, sorted(imported)[:20]
    assert not imported & {"verl.trainer.ppo.ray_trainer", "verl.protocol", "tensordict", "torch._dynamo",
                           # the host memory plan reads the HF export's file bound, not the checkpoint manager
                           "verl.utils.checkpoint.fsdp_checkpoint_manager", "torch.distributed.checkpoint"}
    assert "run_demo" not in proc.stdout and "preflight OK" in proc.stdout
    assert set(report) >= {"ok", "fits", "world_size", "errors", "memory_plan_gib", "largest_phase"}
    assert report["ok"] is True and report["fits"] is True and report["world_size"] == 8 and report["errors"] == []
    # 3 checkpoints of 178 GiB: planned from this GPU-less machine, its disk is not the run's (a
    # warning when it is too small, never the exit status)
    assert "checkpoints: " in proc.stdout and "3 x 178.3 GiB = 535.0 GiB needed" in proc.stdout
    # PPO: in-reward KL (use_kl_in_reward null with gae) needs the reference policy
    assert set(report["memory_plan_gib"]) == {"actor_update", "actor_log_prob", "reference_log_prob", "critic_values",
                                              "critic_update", "rollout", "checkpoint_save"}
    print(f"bash train_ppo.sh preflight (7B, 8 GPUs, no search): {seconds:.1f} s")


def test_train_ppo_sh_passes_preflight_against_a_real_bm25_retrieval_server(tmp_path: Path) -> None:
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from tests.trainer._search_model import build_bm25_retriever, write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    with serve_in_background(create_app(build_bm25_retriever(corpus, tmp_path / "index"))) as url:
        proc, report, _ = _train_ppo(tmp_path, f"retriever.url={url}/retrieve")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True and report["fits"] is True
    assert f"retriever: retriever.url={url}/retrieve answers: retriever=bm25" in proc.stdout


def test_prompts_over_the_bound_are_counted_when_the_tokenizer_is_on_this_machine(data: list[str]) -> None:
    warm = str(REPO / "example" / "demo_warmstart")    # a shipped model folder with its tokenizer
    report = run_preflight(compose_config([*SMALL, *data, f"actor_rollout_ref.model.path={warm}",
                                           f"critic.model.path={warm}", "data.max_start_length=10"]), has_gpu=False)
    assert "4 rows, sources ['nq']; prompts 4 over data.max_start_length=10 tokens" in report.render(), report.render()
    report = run_preflight(compose_config([*SMALL, *data, f"actor_rollout_ref.model.path={warm}",
                                           f"critic.model.path={warm}"]), has_gpu=False)
    assert "prompts 0 over data.max_start_length=2048 tokens" in report.render()


def test_under_slurm_a_missing_index_path_of_the_jobs_own_server_is_an_error(
        data: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ray_on_slurm.sh starts the retrieval server after preflight: its paths are checked, not its URL
    monkeypatch.setenv("SEARCH_R1_PREFLIGHT_RETRIEVER", "job")
    monkeypatch.setenv("index_file", str(tmp_path / "no_index"))
    monkeypatch.setenv("corpus_file", data[0].split("=", 1)[1])
    report = run_preflight(compose_config([*SMALL, *data, "do_search=true"]), has_gpu=False)
    assert keys(report) == ["index_file"], report.render()
    assert f"index_file={tmp_path / 'no_index'}: not found" in report.render()
    assert "retriever: started by the job after preflight" in report.render()


# The other launch commands the docs give, with the shipped model configs (the 72B launcher's default is
# the Instruct model: same architecture as the base config shipped).
@pytest.mark.parametrize(("script", "model", "env"), [
    ("train_grpo.sh", "qwen2.5-3b-instruct", {}),
    ("example/train_grpo_2gpu.sh", "qwen2.5-3b-instruct", {}),
    ("example/multinode/train_grpo_multinode_32b.sh", "qwen2.5-32b", {"RAY_ADDRESS": "auto"}),
    ("example/multinode/train_ppo_multinode_32b.sh", "qwen2.5-32b", {"RAY_ADDRESS": "auto"}),
    ("example/multinode/train_grpo_multinode_72b.sh", "qwen2.5-72b", {"RAY_ADDRESS": "auto"}),
])
def test_the_documented_launchers_pass_preflight_with_the_shipped_model_configs(
        tmp_path: Path, script: str, model: str, env: dict[str, str]) -> None:
    proc, report, _ = _launch(tmp_path, script, model, "do_search=false", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] is True and report["fits"] is True, report
    assert report["memory_plan_gib"][report["largest_phase"]] <= 80


def test_the_72b_launcher_fits_a_2_tib_node_with_the_meta_loader_and_the_old_loader_would_not(
        tmp_path: Path, data: list[str]) -> None:
    # example/multinode/train_grpo_multinode_72b.sh (8 nodes x 8 GPUs, actor/optimizer/reference offloaded)
    from tests.multinode._launch_record import run_recorded
    from verl.utils.host_memory_plan import host_fit, old_loader_init, plan_host_memory
    from verl.utils.memory_plan import GIB

    run = run_recorded("example/multinode/train_grpo_multinode_72b.sh", tmp_path,
                       {"BASE_MODEL": str(CONFIGS / "qwen2.5-72b")}, ())
    assert run.returncode == 0, run.output
    overrides = [*run.overrides, *data, "do_search=false", "trainer.gpu_memory_gib=80"]
    report = run_preflight(compose_config([*overrides, "trainer.host_memory_gib=2048"]))
    assert report.passed and report.host_fits is True, report.render()
    assert "host memory plan per node (the node of global rank 0: 8 worker ranks)" in report.render()
    assert report.to_json()["host_memory_plan_gib"]["model_init"] < 200
    # the old loader (every rank from_pretrained in fp32 on the host): 8 x 291 GB, refused at model_init
    cfg = compose_config(overrides)
    OmegaConf.resolve(cfg)
    plan = plan_host_memory(cfg)
    old = [old_loader_init(cfg), *(p for p in plan.phases if p.name != "model_init")]
    fits, message = host_fit(old, 2048)
    assert fits is False and "phase model_init needs" in message and "trainer.host_memory_gib=2048" in message
    assert old[0].total / GIB > 2048 > max(p.total for p in plan.phases) / GIB
    # a node too small for the offloaded state: preflight refuses, naming the phase and the key
    small = run_preflight(compose_config([*overrides, "trainer.host_memory_gib=100"]))
    assert not small.passed and "trainer.host_memory_gib" in keys(small)
    # with vLLM pools (est.); the reference offloaded in bf16, 16.9 GiB (it was 33.9 in fp32)
    assert "phase training needs 134.7 GiB > trainer.host_memory_gib=100" in small.render()
    assert "trainer.host_memory_gib" in keys(run_preflight(compose_config([*overrides, "trainer.host_memory_gib=-1"])))
