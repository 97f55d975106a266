"""The retrieval server the offline demo starts (scripts/demo/run_demo.py re-exports it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    from search_r1.search.client import RetrievalClient

    return RetrievalClient(url, timeout=2.0).health()


@contextmanager
def retrieval_server(url: str | None, index_dir: Path, corpus: Path, topk: int, log_path: Path,
                     extra_args: list[str] | tuple[str, ...] = ()):
    """Yield a /retrieve URL: `url` if a server answers there, else one started here (and stopped
    after) with `extra_args` (more retrieval_server flags, e.g. --simulate_latency_ms)."""
    if url is not None and _healthy(url):
        yield url
        return
    if url is None:
        host, port = "127.0.0.1", _free_port()
        url = f"http://{host}:{port}/retrieve"
    else:
        from urllib.parse import urlparse

        parsed = urlparse(url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    cmd = [sys.executable, "-m", "search_r1.search.retrieval_server", "--index_path", str(index_dir),
           "--corpus_path", str(corpus), "--topk", str(topk), "--retriever_name", "bm25",
           "--host", host, "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 180
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"retrieval server exited with code {proc.returncode}; see {log_path}")
            if time.time() > deadline:
                raise TimeoutError(f"retrieval server did not answer at {url} within 180 s; see {log_path}")
            time.sleep(0.5)
        print(f"[demo] retrieval server (pid {proc.pid}) at {url}", flush=True)
        yield url
    finally:
        stop_process(proc, grace_s=20)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within `grace_s` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
