"""Preflight under ray_on_slurm.sh (SEARCH_R1_PREFLIGHT_RETRIEVER=job): when the job's own retrieval server
will search a dense index with FAISS on GPU (faiss_device=gpu, or auto on a GPU host), FAISS must import
with GPU support, or retrieval_launch.sh would stop after the cluster started. The env vars and the
`faiss` module are faked: no GPU, no FAISS build needed."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from search_r1.search import faiss_device
from tests.conftest import free_port
from tests.trainer._preflight_data import write_data
from verl.trainer import preflight
from verl.trainer.main_ppo import compose_config
from verl.trainer.preflight import PreflightReport, check_job_faiss, job_server_is_dense, run_preflight

QWEN_7B = str(Path(__file__).resolve().parents[2] / "example" / "model_configs" / "qwen2.5-7b")
CPU_FAISS = SimpleNamespace(__name__="faiss")                                          # faiss-cpu: no GPU API
GPU_FAISS = SimpleNamespace(__name__="faiss", StandardGpuResources=object, get_num_gpus=lambda: 2)
GPU_FAISS_NO_GPU = SimpleNamespace(__name__="faiss", StandardGpuResources=object, get_num_gpus=lambda: 0)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No retriever variable, no faiss_device, a host without GPU, unless a test sets them."""
    for var in (*preflight.RETRIEVER_VARS, "faiss_device"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(faiss_device, "is_gpu_host", lambda: False)
    return monkeypatch


def _check(monkeypatch: pytest.MonkeyPatch, faiss: object | None, gpu_host: bool = False, **env: str) -> PreflightReport:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setitem(sys.modules, "faiss", faiss)      # None: `import faiss` raises ImportError
    monkeypatch.setattr(faiss_device, "is_gpu_host", lambda: gpu_host)
    report = PreflightReport()
    check_job_faiss(report)
    return report


def test_the_server_is_dense_as_retrieval_launch_decides(env: pytest.MonkeyPatch) -> None:
    assert not job_server_is_dense({})                                   # the example corpus: BM25
    assert job_server_is_dense({"index_file": "/d/e5_Flat.index"})       # retriever_name defaults to e5
    assert job_server_is_dense({"file_path": "/d"})
    assert job_server_is_dense({"corpus_file": "/d/wiki.jsonl", "retriever_name": ""})
    assert not job_server_is_dense({"file_path": "/d", "retriever_name": "bm25"})


@pytest.mark.parametrize(("requested", "gpu_host"), [("gpu", False), ("gpu", True), ("auto", True)])
def test_gpu_search_with_cpu_only_faiss_is_an_error_naming_faiss_device(
        env: pytest.MonkeyPatch, requested: str, gpu_host: bool) -> None:
    report = _check(env, CPU_FAISS, gpu_host, index_file="/d/e5_Flat.index", faiss_device=requested)
    assert [e["key"] for e in report.errors] == ["faiss_device"]
    message = report.errors[0]["message"]
    assert f"faiss_device={requested}" in message and "CPU-only build" in message
    assert "faiss-gpu" in message and "set faiss_device=cpu" in message


def test_a_gpu_build_that_sees_no_gpu_is_an_error(env: pytest.MonkeyPatch) -> None:
    report = _check(env, GPU_FAISS_NO_GPU, True, file_path="/d", faiss_device="gpu")
    assert [e["key"] for e in report.errors] == ["faiss_device"]
    assert "get_num_gpus() = 0" in report.errors[0]["message"]


def test_faiss_with_gpu_support_passes_and_says_so(env: pytest.MonkeyPatch) -> None:
    report = _check(env, GPU_FAISS, True, index_file="/d/e5_Flat.index")     # faiss_device unset: auto
    assert report.errors == []
    assert any("FAISS searches the dense index on GPU (faiss_device=auto, 2 GPU(s)" in line for line in report.lines)


@pytest.mark.parametrize(("requested", "gpu_host"), [("cpu", True), ("auto", False), ("cpu", False)])
def test_cpu_search_needs_no_gpu_support(env: pytest.MonkeyPatch, requested: str, gpu_host: bool) -> None:
    assert _check(env, CPU_FAISS, gpu_host, index_file="/d/e5_Flat.index", faiss_device=requested).errors == []


@pytest.mark.parametrize("server", [{}, {"file_path": "/d", "retriever_name": "bm25"}])
def test_a_bm25_server_never_imports_faiss(env: pytest.MonkeyPatch, server: dict[str, str]) -> None:
    assert _check(env, None, True, faiss_device="gpu", **server).errors == []


def test_faiss_that_does_not_import_is_an_error_for_a_dense_server(env: pytest.MonkeyPatch) -> None:
    report = _check(env, None, True, index_file="/d/e5_Flat.index", faiss_device="gpu")
    assert [e["key"] for e in report.errors] == ["faiss_device"]
    assert "does not import" in report.errors[0]["message"] and "faiss-gpu" in report.errors[0]["message"]


def test_an_unknown_faiss_device_is_an_error(env: pytest.MonkeyPatch) -> None:
    report = _check(env, GPU_FAISS, True, index_file="/d/e5_Flat.index", faiss_device="cuda")
    assert [e["key"] for e in report.errors] == ["faiss_device"]
    assert "must be one of auto, gpu, cpu" in report.errors[0]["message"]


def test_preflight_of_the_job_checks_faiss_only_when_the_job_starts_the_server(
        env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    data = write_data(tmp_path / "data")
    index = tmp_path / "e5_Flat.index"
    index.write_bytes(b"\0")
    cfg = compose_config(["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "trainer.logger=[console]",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
                          "critic.ppo_micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
                          "actor_rollout_ref.ref.log_prob_micro_batch_size=2", f"actor_rollout_ref.model.path={QWEN_7B}",
                          f"critic.model.path={QWEN_7B}", *data, "do_search=true"])
    env.setenv("SEARCH_R1_PREFLIGHT_RETRIEVER", "job")
    env.setenv("index_file", str(index))
    env.setenv("corpus_file", data[0].split("=", 1)[1])
    env.setenv("faiss_device", "gpu")
    env.setitem(sys.modules, "faiss", CPU_FAISS)
    report = run_preflight(cfg, has_gpu=False)
    assert [e["key"] for e in report.errors] == ["faiss_device"], report.render()
    assert "retriever: started by the job after preflight" in report.render()
    env.setitem(sys.modules, "faiss", GPU_FAISS)
    assert run_preflight(cfg, has_gpu=False).errors == []
    # A server the user runs (RETRIEVER_URL set: "url"): its URL is asked, FAISS is not this job's concern.
    env.setenv("SEARCH_R1_PREFLIGHT_RETRIEVER", "url")
    env.setitem(sys.modules, "faiss", CPU_FAISS)
    cfg.retriever.url = f"http://127.0.0.1:{free_port()}/retrieve"      # nothing listens: its error only
    assert [e["key"] for e in run_preflight(cfg, has_gpu=False).errors] == ["retriever.url"]
