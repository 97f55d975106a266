"""Real Slurm on this machine: scripts/slurm/local_cluster.sh configures and starts munged,
slurmctld and slurmd (installing Debian's slurm-wlm if missing), then `sbatch
scripts/slurm/train_grpo.sbatch` runs one GRPO step with search to completion: the job starts
the Ray head with srun, the retrieval server (retrieval_launch.sh over a BM25 index of the tiny
corpus), trains through train_grpo.sh, and stops everything. A second job that fails midway
(after Ray and the server are up, its first Ray head having timed out during startup and been started
again) must leave no Ray or server process behind; a job with a bad
override fails in its preflight, before any Ray node or the server starts; a job timed out by Slurm
mid-training, and one whose Ray head cannot start, leave nothing behind either. Each job is submitted
with `sbatch` and polled every second (`sbatch --wait` polls at 2, 8, then every 32 s here).

If the Slurm daemons cannot start, the tests fail with local_cluster.sh's reason.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts.bench.toy_task import toy_overrides
from tests.conftest import free_port, free_port_pair
from tests.multinode._local_ray import REPO, ray_env
from tests.trainer._search_model import TOPK, build_bm25_retriever, write_corpus
from tests.trainer.test_search_e2e import BATCH_SIZE, N_AGENT, SearchWorld, serve_search_world

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOCAL_CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train_grpo.sbatch"


@pytest.fixture(scope="module")
def search_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    """This module's own search world (the warmed-up model and the question parquets; the jobs start their
    own servers), instead of the package's: a test using a package-scoped fixture joins the package's xdist
    group, which put these jobs on one worker after every two-node test (~1,500 s in a row)."""
    with serve_search_world(tmp_path_factory.mktemp("slurm_search_world"), tiny_model_dir) as world:
        yield world


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment sbatch needs (SLURM_CONF), once the one-machine cluster is up and idle."""
    start = subprocess.run(["bash", str(LOCAL_CLUSTER), "start"], capture_output=True, text=True, timeout=900)
    if start.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not start (scripts/slurm/local_cluster.sh start, "
                    f"rc {start.returncode}):\n{start.stdout}\n{start.stderr}")
    line = subprocess.run(["bash", str(LOCAL_CLUSTER), "env"], capture_output=True, text=True, check=True).stdout
    conf = re.fullmatch(r"export SLURM_CONF=(\S+)\s*", line)
    assert conf, line
    env = ray_env(SLURM_CONF=conf.group(1))
    env.pop("RETRIEVER_URL", None)
    return env


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(corpus, BM25 index folder) of the tiny corpus the warmed-up model searches."""
    root = tmp_path_factory.mktemp("slurm_corpus")
    corpus = write_corpus(root / "corpus.jsonl")
    build_bm25_retriever(corpus, root / "index")
    (index,) = [p.parent for p in (root / "index").rglob("search_r1_bm25.json")]
    return corpus, index


def _submit(env: dict[str, str], world: SearchWorld, index: tuple[Path, Path], out: Path,
            extra: list[str], time_limit: str = "00:20:00", **job_vars: str) -> tuple[str, Path]:
    """Submit train_grpo.sbatch (one node, 2 CPUs, 1 CPU worker); (job id, its log file)."""
    corpus, index_dir = index
    overrides = [o for o in toy_overrides(world.model_dir, world.data, str(out / "ckpt"), adv_estimator="grpo",
                                          n_workers=1, batch_size=BATCH_SIZE, n_agent=N_AGENT, response_length=40)
                 # the sbatch script sets these two from the allocation
                 if not o.startswith(("trainer.nnodes=", "trainer.n_gpus_per_node="))] + [
        "do_search=true", "max_turns=2", "actor_rollout_ref.actor.state_masking=true",
        "data.max_start_length=160", "data.max_prompt_length=512", "data.max_obs_length=160",
        f"retriever.topk={TOPK}", "actor_rollout_ref.rollout.temperature=0.7",
        "trainer.logger=[console,jsonl]", f"hydra.run.dir={out / 'hydra'}", *extra]
    job_env = dict(env, BASE_MODEL=world.model_dir, WORKERS_PER_NODE="1", SEARCH_R1_VENV=str(REPO / ".venv"),
                   EXPERIMENT_NAME=str(out / "grpo-slurm"),      # train_grpo.sh tees its log to $EXPERIMENT_NAME.log
                   RAY_PORT=str(free_port_pair()), RETRIEVER_PORT=str(free_port()),
                   retriever_name="bm25", index_file=str(index_dir), corpus_file=str(corpus))
    job_env.update(job_vars)
    log = out / "job.out"
    # Not `sbatch --wait`: it polls the job after 2, 8, then every 32 s (its interval grows up to
    # MinJobAge / 2), so a job that ended a second after a poll was waited on for up to 32 s more.
    proc = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0",
         "--cpus-per-task=2", f"--time={time_limit}", f"--output={log}", "--job-name=search-r1-test",
         str(SBATCH), *overrides],
        cwd=REPO, env=job_env, capture_output=True, text=True, timeout=120)
    job_id = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_id.isdigit(), f"sbatch did not submit: {proc.stdout}\n{proc.stderr}"
    return job_id, log


def _job(env: dict[str, str], job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of the job as `scontrol show job` has them."""
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    state, code = re.search(r"JobState=(\S+)", out), re.search(r"ExitCode=(\d+:\d+)", out)
    return (state.group(1) if state else out.strip()), (code.group(1) if code else "")


def _ended(state: str) -> bool:
    # COMPLETING: the job ended but slurmd is still tearing it down (its processes may still run)
    return state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def _poll(env: dict[str, str], job_id: str, log: Path, done: Callable[[str, str], bool], timeout_s: float,
          waited_for: str) -> tuple[str, str]:
    """Poll the job's state and log every second until done(state, log text); (state, log text). Past
    `timeout_s` the job is cancelled and the test fails, naming what it `waited_for`."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, text = _job(env, job_id)[0], (log.read_text() if log.exists() else "")
        if done(state, text):
            return state, text
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"job {job_id} still {state}, {waited_for} after {timeout_s:.0f}s (cancelled):\n{text[-4000:]}")
        time.sleep(1)


def _wait(env: dict[str, str], job_id: str, log: Path, timeout_s: float = 1500.0) -> tuple[int, str]:
    """Wait (polling every second) until Slurm has finished ending the job; (exit code, log). The exit
    code is the one `sbatch --wait` returns: the script's exit status, 1 if a signal ended it."""
    state, _ = _poll(env, job_id, log, lambda state, _: _ended(state), timeout_s, "not ended")
    code = _job(env, job_id)[1]
    assert re.fullmatch(r"\d+:\d+", code), f"job {job_id}: no ExitCode ({state})"
    status, signal = map(int, code.split(":"))
    return (1 if signal else status), (log.read_text() if log.exists() else "")


def _sbatch(env: dict[str, str], world: SearchWorld, index: tuple[Path, Path], out: Path,
            extra: list[str], time_limit: str = "00:20:00", **job_vars: str) -> tuple[int, str, str]:
    """Submit train_grpo.sbatch, wait for the job to end; (exit code, job id, log)."""
    job_id, log = _submit(env, world, index, out, extra, time_limit, **job_vars)
    rc, text = _wait(env, job_id, log)
    return rc, job_id, text


def _final_state(env: dict[str, str], job_id: str) -> str:
    """The job's state (once `_wait` has seen it end: Slurm has finished ending it, not COMPLETING)."""
    state = _job(env, job_id)[0]
    assert _ended(state), state
    return state


def _leftovers(job_id: str, retriever_port: str | None = None) -> list[str]:
    """Command lines of processes still alive from the job: its Ray (temp dir /tmp/ray_<job>) or server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/tmp/ray_{job_id}" in cmd or ("retrieval_server" in cmd and retriever_port and retriever_port in cmd):
            found.append(f"{entry.name}: {cmd[:200]}")
    return found


def _port_in_log(log: str) -> str | None:
    match = re.search(r"retrieval server up on \S+ at http://[\d.]+:(\d+)/retrieve", log)
    return match.group(1) if match else None


def test_sbatch_train_grpo_runs_a_step_with_its_own_ray_and_retrieval_server(
        slurm_env: dict[str, str], search_world: SearchWorld, tiny_index: tuple[Path, Path], tmp_path: Path) -> None:
    rc, job_id, log = _sbatch(slurm_env, search_world, tiny_index, tmp_path, [])
    assert rc == 0, log[-6000:]
    assert "Ray cluster up: 1 node(s) joined" in log
    assert "retrieval server up on" in log and "command exited with status 0" in log
    # the trainer's step, as the job log shows it (train_grpo.sh tees the driver's output)
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    step = records[0]
    assert step["env/number_of_valid_search"] > 0 and step["env/search_failures"] == 0
    assert re.search(r"^step:1 - .*env/number_of_valid_search:", log, re.M), log[-3000:]
    # the job's own server answered the searches: its counters at shut-down
    end = re.search(r"retrieval server at the end: (\{.*\})", log)
    assert end, log[-3000:]
    counters = json.loads(end.group(1))["counters"]
    assert counters["cache_hits"] + counters["cache_misses"] > 0
    assert "stopped" in log
    assert _final_state(slurm_env, job_id) == "COMPLETED"
    assert _leftovers(job_id, _port_in_log(log)) == []


def test_sbatch_with_retriever_serve_ray_searches_a_serve_replica_instead_of_a_server(
        slurm_env: dict[str, str], search_world: SearchWorld, tiny_index: tuple[Path, Path], tmp_path: Path) -> None:
    rc, job_id, log = _sbatch(slurm_env, search_world, tiny_index, tmp_path, [], RETRIEVER_SERVE="ray")
    assert rc == 0, log[-6000:]
    assert "the trainer starts it on Ray Serve (retriever.serve=ray" in log
    assert "retrieval server up on" not in log            # no standalone server was started
    step = json.loads((tmp_path / "ckpt" / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["env/number_of_valid_search"] > 0 and step["env/search_failures"] == 0
    # the replica on the job's one node answered every search
    (replica,) = json.loads((tmp_path / "ckpt" / "logs" / "retrieval_replicas.json").read_text()).values()
    assert replica["counters"]["cache_hits"] + replica["counters"]["cache_misses"] > 0
    assert _final_state(slurm_env, job_id) == "COMPLETED"
    assert _leftovers(job_id) == []


def _venv_whose_first_ray_head_times_out(root: Path) -> Path:
    """A SEARCH_R1_VENV whose `ray` fails the first `ray start --head` as Ray does when its raylet misses
    the fixed 30 s to register on a busy node (what a CI run met), and is the real `ray` otherwise."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    venv_bin = REPO / ".venv" / "bin"
    for name in ("python", "python3"):   # exec'd by path, so the real venv's packages stay on sys.path
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\nexec {venv_bin / "python"} "$@"\n')
    (bin_dir / "ray").write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2" = "start --head" ] && mkdir {root / "failed-once"} 2>/dev/null; then\n'
        '    echo "Exception: The current node timed out during startup. This could happen because some of the '
        'raylet failed to startup or the GCS has become overloaded." >&2\n'
        "    exit 1\n"
        "fi\n"
        f'exec {venv_bin / "ray"} "$@"\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return root


def test_a_job_failing_midway_leaves_no_ray_or_server_process(
        slurm_env: dict[str, str], search_world: SearchWorld, tiny_index: tuple[Path, Path], tmp_path: Path) -> None:
    # Preflight would catch the missing training data before anything starts (the next test's case);
    # with it off (PREFLIGHT=0), Ray and the retrieval server are up by the time the driver reads it.
    # The job's first Ray head times out during startup (a fake `ray`): the script starts it once more.
    venv = _venv_whose_first_ray_head_times_out(tmp_path / "venv")
    rc, job_id, log = _sbatch(dict(slurm_env, PREFLIGHT="0"), search_world, tiny_index, tmp_path,
                              [f"data.train_files={tmp_path / 'missing.parquet'}"], SEARCH_R1_VENV=str(venv))
    assert "preflight: " not in log, log[-4000:]
    assert "timed out during startup (a busy node); starting it again" in log, log[-4000:]
    assert rc != 0, log[-4000:]
    assert "Ray cluster up: 1 node(s) joined" in log and "retrieval server up on" in log, log[-4000:]
    assert "missing.parquet" in log
    assert re.search(r"command exited with status [1-9]", log)
    assert "shutting down" in log and "stopped" in log
    assert _final_state(slurm_env, job_id) == "FAILED"
    assert _leftovers(job_id, _port_in_log(log)) == []


def test_a_job_hitting_its_time_limit_stops_ray_and_the_server(
        slurm_env: dict[str, str], search_world: SearchWorld, tiny_index: tuple[Path, Path], tmp_path: Path) -> None:
    # A run of many steps under a 20-minute limit; once its first step is in the log, the limit is
    # lowered to 1 minute (already run out, or about to), so Slurm times the job out mid-training: the
    # time-limit check sends SIGTERM (then SIGKILL after KillWait=30 s) and the script's trap must stop
    # the Ray node and the server in time. (A fixed limit raced the job's start: 1 minute ran out while
    # a loaded machine was still starting the job's Ray head, and 3 minutes cost 3.5 on an idle one.)
    # The job's exit code is not asserted: for a timed-out job it need not be the script's (a CI run's
    # `sbatch --wait` got 0 although the trap exited 143). The job's state and the processes count.
    # PREFLIGHT=0: the config check before Ray starts (25 s on a loaded machine) plays no part here.
    job_id, log_file = _submit(dict(slurm_env, PREFLIGHT="0"), search_world, tiny_index, tmp_path,
                               ["trainer.total_training_steps=500", "trainer.total_epochs=500"])
    def stepped(text: str) -> bool:
        return re.search(r"^step:1 - ", text, re.M) is not None

    state, text = _poll(slurm_env, job_id, log_file, lambda state, text: stepped(text) or _ended(state), 1200,
                        "no first step")
    assert stepped(text), f"job {job_id} ended ({state}) before its first step:\n{text[-4000:]}"
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=1"], env=slurm_env, check=True)
    _, log = _wait(slurm_env, job_id, log_file)
    assert _final_state(slurm_env, job_id) == "TIMEOUT", log[-4000:]
    assert "running: bash train_grpo.sh" in log and "caught SIGTERM" in log, log[-4000:]
    assert "command exited with status 0" not in log
    assert "shutting down (exit status 143)" in log
    assert _leftovers(job_id, _port_in_log(log)) == []


def test_a_ray_head_that_cannot_start_fails_the_job_at_once_naming_it(
        slurm_env: dict[str, str], search_world: SearchWorld, tiny_index: tuple[Path, Path], tmp_path: Path) -> None:
    # The head's client-server port (RAY_PORT + 1) is taken: `ray start --head` brings its GCS up,
    # then exits when the client server cannot bind (as a CI run met by chance). The script must
    # stop there, naming the head, not wait for a retrieval server or train against a dead cluster.
    port = free_port_pair()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", port + 1))
        taken.listen()
        # PREFLIGHT=0: the config check before the head starts (seconds of CPU) plays no part here
        rc, job_id, log = _sbatch(slurm_env, search_world, tiny_index, tmp_path, [], time_limit="5",
                                  RAY_PORT=str(port), PREFLIGHT="0")
    assert rc != 0, log[-4000:]
    assert re.search(r"ERROR: ray head on \S+ exited; see its output above", log), log[-4000:]
    for later in ("retrieval server up", "running: "):
        assert later not in log, later
    assert _final_state(slurm_env, job_id) == "FAILED"
    assert _leftovers(job_id) == []


def test_a_bad_override_fails_the_job_in_preflight_before_ray_or_the_server_start(
        slurm_env: dict[str, str], tmp_path: Path) -> None:
    # Preflight reads only the config: no model, data or index has to exist for it.
    from scripts.bench.toy_task import ToyPaths

    world = SearchWorld(server_url="", model_dir=str(tmp_path / "no-model"),
                        data=ToyPaths(str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet")))
    rc, job_id, log = _sbatch(slurm_env, world, (tmp_path / "corpus.jsonl", tmp_path / "index"), tmp_path,
                              ["actor_rollout_ref.actor.ppo_micro_batch_size=3"])
    assert rc != 0, log[-4000:]
    assert "preflight FAILED" in log and "actor_rollout_ref.actor.ppo_micro_batch_size" in log, log[-4000:]
    assert "no Ray node or retrieval server was started" in log
    for started in ("Ray head on", "Ray cluster up", "retrieval server up", "running: "):
        assert started not in log, started
    assert _final_state(slurm_env, job_id) == "FAILED"
    assert _leftovers(job_id) == []
