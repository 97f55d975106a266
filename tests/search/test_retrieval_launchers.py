"""The retrieval launchers (retrieval_launch.sh, example/retriever/*.sh) run as the user runs them:
which corpus they serve, when they refuse to start, the FAISS device and the encoder settings
they pass to the server. Most runs use SEARCH_R1_DRY_RUN=1 (print the commands, start nothing)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from search_r1.search.encoders import Encoder, encoder_dtype
from search_r1.search.faiss_device import FaissDeviceError, choose_faiss_device, faiss_gpu_count
from search_r1.search.retrieval_server import parse_args
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "retrieval_launch.sh"
ANN = REPO / "example" / "retriever" / "retrieval_launch_ann.sh"
BM25 = REPO / "example" / "retriever" / "retrieval_launch_bm25.sh"
RETRIEVER_VARS = ("file_path", "index_file", "corpus_file", "retriever_name", "retriever_path")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The caller's environment minus every launcher variable, plus ``extra``; this venv's python first."""
    env = {k: v for k, v in os.environ.items()
           if k not in RETRIEVER_VARS and not k.startswith(("SLURM_", "SEARCH_R1_")) and k != "faiss_device"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SEARCH_R1_CACHE"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def _launch(script: Path, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def _server_argv(stdout: str) -> list[str]:
    """The retrieval server's argv from a dry run's output (its last line)."""
    argv = shlex.split(stdout.strip().splitlines()[-1])
    assert argv[:3] == ["python", "-m", "search_r1.search.retrieval_server"], stdout
    return argv


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def dense_files(tmp_path: Path) -> Path:
    """A folder holding files named as the wiki-18 ones (a dry run only checks they exist)."""
    folder = tmp_path / "wiki"
    folder.mkdir()
    for name in ("e5_Flat.index", "e5_HNSW64.index", "wiki-18.jsonl"):
        (folder / name).write_bytes(b"")
    return folder


# -- item: no silent fall-back to the example corpus ------------------------------------------

@pytest.mark.parametrize(
    ("script", "variables", "missing"),
    [
        (LAUNCH, {"file_path": "/nonexistent"}, "/nonexistent/e5_Flat.index"),
        (LAUNCH, {"index_file": "/nonexistent/my.index"}, "/nonexistent/my.index"),
        (ANN, {"file_path": "/nonexistent"}, "/nonexistent/e5_HNSW64.index"),
        (BM25, {"corpus_file": "/nonexistent/wiki-18.jsonl"}, "/nonexistent/wiki-18.jsonl"),
    ],
)
def test_a_set_but_missing_index_stops_the_launch_naming_it(
        tmp_path: Path, script: Path, variables: dict[str, str], missing: str) -> None:
    # No dry run: had it fallen back to the example corpus it would be serving on this port.
    result = _launch(script, _env(tmp_path, **variables), "--port", str(free_port()), timeout=90)
    assert result.returncode == 2, result.stderr
    assert f"{missing} does not exist" in result.stderr
    assert "example corpus" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_with_no_retriever_variable_the_example_corpus_is_served(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(["bash", str(LAUNCH), "--port", str(port)], env=_env(tmp_path), cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no /health within 180 s"
            try:
                health = requests.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
                break
            except requests.ConnectionError:
                time.sleep(0.5)
        assert health["retriever"] == "bm25" and health["corpus_size"] == 300
        hits = requests.post(f"http://127.0.0.1:{port}/retrieve", timeout=30,
                             json={"queries": ["photosynthesis"], "topk": 1}).json()["result"][0]
        assert "Photosynthesis" in hits[0]["contents"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)   # the group of the launcher started above (exec'd server)
        proc.wait(timeout=30)


def test_inside_a_slurm_job_the_example_corpus_needs_an_explicit_yes(tmp_path: Path) -> None:
    refused = _launch(LAUNCH, _env(tmp_path, SLURM_JOB_ID="4242", SEARCH_R1_DRY_RUN="1"))
    assert refused.returncode == 2 and "Slurm job 4242" in refused.stderr and "export file_path" in refused.stderr
    allowed = _launch(LAUNCH, _env(tmp_path, SLURM_JOB_ID="4242", SEARCH_R1_DRY_RUN="1",
                                   SEARCH_R1_EXAMPLE_RETRIEVER="1"))
    assert allowed.returncode == 0, allowed.stderr
    argv = _server_argv(allowed.stdout)
    assert _flag(argv, "--corpus_path") == "example/corpus.jsonl" and _flag(argv, "--retriever_name") == "bm25"


# -- item: FAISS on GPU, or a loud failure ------------------------------------------------------

@pytest.mark.parametrize(
    ("has_gpu", "faiss_gpus", "requested", "expected"),
    [
        (False, 0, "auto", "cpu"),      # CPU host, CPU FAISS
        (True, 2, "auto", "gpu"),       # GPU FAISS: search there
        (True, 2, "cpu", "cpu"),        # asked for CPU
        (True, 0, "cpu", "cpu"),        # GPU host, CPU FAISS, CPU asked for: allowed
        (True, 1, "gpu", "gpu"),
        (True, 0, "auto", FaissDeviceError),    # GPU host, CPU-only FAISS: no silent CPU search
        (False, 0, "gpu", FaissDeviceError),    # GPU asked for, FAISS cannot
    ],
)
def test_faiss_device_decision(has_gpu: bool, faiss_gpus: int, requested: str, expected) -> None:
    if isinstance(expected, str):
        assert choose_faiss_device(has_gpu, faiss_gpus, requested) == expected
    else:
        with pytest.raises(expected, match="faiss_device|GPU support"):
            choose_faiss_device(has_gpu, faiss_gpus, requested)


def test_faiss_device_rejects_an_unknown_request() -> None:
    with pytest.raises(ValueError, match="faiss_device must be one of auto, gpu, cpu"):
        choose_faiss_device(True, 0, "tpu")


def test_launcher_fails_on_a_gpu_host_with_cpu_only_faiss_unless_cpu_is_asked_for(
        tmp_path: Path, dense_files: Path) -> None:
    base = _env(tmp_path, file_path=str(dense_files), SEARCH_R1_DRY_RUN="1", SEARCH_R1_ASSUME_GPU_HOST="1")
    on_gpu_host = _launch(LAUNCH, base)
    if faiss_gpu_count() == 0:   # the faiss-cpu wheel of the test environment
        assert on_gpu_host.returncode == 2, on_gpu_host.stdout
        assert "CPU-only build" in on_gpu_host.stderr and "faiss_device=cpu" in on_gpu_host.stderr
    else:                        # a GPU build of FAISS: the launcher searches there
        assert "--faiss_gpu" in _server_argv(on_gpu_host.stdout)
    on_cpu = _launch(LAUNCH, {**base, "faiss_device": "cpu"})
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert "--faiss_gpu" not in _server_argv(on_cpu.stdout)
    bad = _launch(LAUNCH, {**base, "faiss_device": "fast"})
    assert bad.returncode == 2 and "faiss_device must be one of" in bad.stderr


# -- item: the original's encoder settings (fp16 on GPU, batches of 512) ----------------------

@pytest.mark.parametrize("script", [LAUNCH, ANN])
def test_dense_launchers_pass_the_originals_batch_size_and_fp16(
        tmp_path: Path, dense_files: Path, script: Path) -> None:
    env = _env(tmp_path, file_path=str(dense_files), SEARCH_R1_DRY_RUN="1", faiss_device="cpu")
    argv = _server_argv(_launch(script, env).stdout)
    assert _flag(argv, "--encode_batch_size") == "512" and "--use_fp16" in argv
    args = parse_args(argv[3:])
    assert args.encode_batch_size == 512 and args.use_fp16 is True and args.max_length == 256
    argv = _server_argv(_launch(script, {**env, "retrieval_batch_size": "256"}, "--no-use_fp16").stdout)
    args = parse_args(argv[3:])
    assert args.encode_batch_size == 256 and args.use_fp16 is False   # the user's last word wins


def test_server_encoder_settings_fp16_on_gpu_fp32_on_cpu() -> None:
    default = parse_args(["--retriever_name", "e5"])
    assert default.use_fp16 is None and default.encode_batch_size == 512 and default.max_length == 256
    assert encoder_dtype("cuda", default.use_fp16) == torch.float16
    assert encoder_dtype("cuda", True) == torch.float16
    assert encoder_dtype("cuda", False) == torch.float32
    assert encoder_dtype("cpu", default.use_fp16) == torch.float32
    assert encoder_dtype("cpu", True) == torch.float32


def test_encoder_on_cpu_stays_fp32_even_when_fp16_is_asked_for(minilm_path: str) -> None:
    encoder = Encoder(minilm_path, max_length=32, use_fp16=True, device="cpu")
    assert encoder.dtype == torch.float32 and next(encoder.model.parameters()).dtype == torch.float32
