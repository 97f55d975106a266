"""End to end with a real retrieval server: a tiny model that searches, PPO and GRPO steps
through `run_ppo` (real Ray workers, FSDP on gloo, HF rollout, the rule reward on `nq`).

The BM25 server runs under uvicorn on 127.0.0.1; the model is warmed up in the test to
write `<search> q </search>` before answering (tests/trainer/_search_model.py), so the
generation manager really calls the server and appends retrieved passages, which the
actor must not train on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from scripts.bench.toy_task import ToyPaths, toy_overrides
from tests.trainer._search_model import (
    TOPK,
    build_bm25_retriever,
    warm_up_searching_model,
    write_corpus,
    write_question_parquets,
)
from tests.trainer.test_main_ppo import _finite
from verl.trainer.main_ppo import compose_config, run_ppo

BATCH_SIZE = 2      # prompts a step (both questions)
N_AGENT = 2         # samples a prompt
ROLLOUTS = BATCH_SIZE * N_AGENT


@dataclass(frozen=True)
class SearchWorld:
    server_url: str
    model_dir: str
    data: ToyPaths
    corpus_path: str = ""     # what the server loads, for a run that starts its own (retriever.serve=ray)
    index_path: str = ""


def _warmed_up_once(base_model_dir: str, retriever: Any, out_dir: Path, steps: int) -> Path:
    """warm_up_searching_model's folder, copied to `out_dir` from the run's SEARCH_R1_CACHE where the same
    warm-up was saved before (xdist workers share it; .ci/run's two suites share one): the 200 steps took
    10-170 s a world, and the default suite, the slow suite's modules and the multinode package each built
    the same one. Keyed by the base folder's bytes, the warm-up's source (corpus, questions, layout) and
    the library versions, so a different model or warm-up never gets another's weights."""
    import hashlib
    import shutil

    import bm25s
    import torch
    import transformers

    from tests.conftest import RUN_CACHE, run_lock
    from tests.trainer import _search_model

    key = hashlib.sha256(f"{steps}|{torch.__version__}|{transformers.__version__}|{bm25s.__version__}".encode())
    key.update(Path(_search_model.__file__).read_bytes())
    for f in sorted(Path(base_model_dir).rglob("*")):
        if f.is_file():
            key.update(str(f.relative_to(base_model_dir)).encode() + b"\0" + f.read_bytes())
    cached = RUN_CACHE / "search_warm_ups" / key.hexdigest()[:24]
    with run_lock(f"warm_up_{cached.name}"):
        if not cached.is_dir():
            tmp = cached.with_name(cached.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            warm_up_searching_model(base_model_dir, retriever, tmp, steps=steps)
            tmp.replace(cached)
    shutil.copytree(cached, out_dir)
    return out_dir


@contextmanager
def serve_search_world(root: Path, base_model_dir: str) -> Iterator[SearchWorld]:
    """A BM25 server over the tiny corpus, the model at `base_model_dir` warmed up to search it,
    and the question parquets, all under `root`; the server stops on exit."""
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background

    corpus = write_corpus(root / "corpus.jsonl")
    retriever = build_bm25_retriever(corpus, root / "index")
    # The warm-up reads the retriever directly, so the server's counters start at zero.
    model_dir = _warmed_up_once(base_model_dir, retriever, root / "model", steps=200)
    data = write_question_parquets(root / "data")
    with serve_in_background(create_app(retriever)) as url:
        yield SearchWorld(server_url=url, model_dir=str(model_dir), data=data, corpus_path=str(corpus),
                          index_path=str(retriever.index_path))


@pytest.fixture(scope="module")
def search_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    with serve_search_world(tmp_path_factory.mktemp("search_world"), tiny_model_dir) as world:
        yield world


class StepOneGate:
    """Makes a partial-rollout run deterministic: the retrieval server holds each search that arrives
    after batch 1 was rolled out (batch 2's, which rolls out while step 1 trains) until step 1's update
    is over, so batch 2's next turn always starts after step 1's weights exist and no update is running:
    the producer pushes them between its two turns. A fixed server latency alone raced the update on a
    loaded CI machine (no push in batch 2). The producer runs in this process (the driver); the gate
    wraps its rollout and its update lock, and the server's app, nothing else."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from verl.trainer.ppo.pipeline import RolloutProducer

        self.batches_rolled = 0
        self.step_one_trained = threading.Event()
        gate = self
        init, updating = RolloutProducer.__init__, RolloutProducer.updating

        def counting_init(producer: RolloutProducer, rollout, *args, **kwargs) -> None:
            def rolled_out(*a):
                out = rollout(*a)
                gate.batches_rolled += 1
                return out
            init(producer, rolled_out, *args, **kwargs)

        @contextmanager
        def opening_updating(producer: RolloutProducer) -> Iterator[None]:
            with updating(producer):
                yield
            if producer.steps_done >= 1:   # the update lock is free again: a push can be sent
                gate.step_one_trained.set()

        monkeypatch.setattr(RolloutProducer, "__init__", counting_init)
        monkeypatch.setattr(RolloutProducer, "updating", opening_updating)

    def hold(self, app):
        """`app` (the retrieval server's) with every /retrieve after batch 1 held until step 1 is trained."""
        import asyncio
        import time

        @app.middleware("http")
        async def held(request, call_next):
            if request.url.path == "/retrieve" and self.batches_rolled >= 1:
                deadline = time.monotonic() + 600
                while not self.step_one_trained.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            return await call_next(request)
        return app


def _queries_answered(url: str) -> int:
    """Every query the server looked up, from its cache or the index."""
    counters = requests.get(f"{url}/health", timeout=10).json()["counters"]
    return int(counters["cache_hits"] + counters["cache_misses"])


def _search_overrides(world: SearchWorld, tmp_path: Path, adv: str, extra: list[str] | None = None) -> list[str]:
    """A one-step run with search against the world's server (later `extra` overrides win)."""
    return toy_overrides(world.model_dir, world.data, str(tmp_path / "ckpt"), adv_estimator=adv,
                         batch_size=BATCH_SIZE, n_agent=N_AGENT, response_length=40) + [
        "do_search=true", "max_turns=2", "actor_rollout_ref.actor.state_masking=true",
        "data.max_start_length=160", "data.max_prompt_length=512", "data.max_obs_length=160",
        f"retriever.url={world.server_url}/retrieve", f"retriever.topk={TOPK}",
        # a little below 1 so the warmed-up policy stays on its trajectory in every run
        "actor_rollout_ref.rollout.temperature=0.7",
        *(extra or []),
    ]


def _run_with_search(world: SearchWorld, tmp_path: Path, adv: str, extra: list[str] | None = None,
                     expect_steps: list[int] | None = None) -> tuple[dict, int]:
    """One training step with search against the world's server; returns (step metrics, queries served)."""
    overrides = _search_overrides(world, tmp_path, adv, extra)
    before = _queries_answered(world.server_url)
    history = run_ppo(compose_config(overrides))   # the default rule reward scores `nq` rows
    served = _queries_answered(world.server_url) - before
    assert [h["step"] for h in history] == (expect_steps or [1])
    return history[-1], served


def _assert_searched_against_the_server(step: dict, served: int) -> None:
    searches = step["env/number_of_valid_search"] * ROLLOUTS
    assert step["env/number_of_valid_search"] > 0
    assert step["env/search_failures"] == 0
    # every search the rollout counted was one query the server answered, and nothing else was sent
    assert served == round(searches) > 0
    # a search means at least two turns: the engines stayed awake across them (woke once)
    assert step["rollout/engine_wake_ups"] == 1
    # retrieved passages are in the response but masked out of the policy's tokens
    assert step["state_tokens/total"] > 0
    assert 0.0 < step["state_tokens/coverage"] < 1.0
    for prefix in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/", "critic/advantages/"):
        _finite(step, prefix)
    assert step["actor/grad_nonfinite"] == 0
    # the warmed-up policy answers from the passage; the rule reward reads only its own text
    assert step["critic/score/mean"] > 0


def test_ppo_step_with_search_against_a_real_server_trains_actor_and_critic(
        ray_cluster, search_world: SearchWorld, tmp_path: Path) -> None:
    step, served = _run_with_search(search_world, tmp_path, "gae")
    _assert_searched_against_the_server(step, served)
    for prefix in ("critic/vf_loss", "critic/grad_norm", "critic/values/", "critic/returns/"):
        _finite(step, prefix)
    assert step["critic/grad_nonfinite"] == 0
    assert "actor/kl_loss" not in step


@pytest.mark.slow   # a run_ppo step with search (test_main_ppo has GRPO with KL loss): in CI's slow suite (the default suite's 15-minute goal)
def test_grpo_step_with_search_against_a_real_server_uses_kl_loss_and_no_critic(
        ray_cluster, search_world: SearchWorld, tmp_path: Path) -> None:
    step, served = _run_with_search(search_world, tmp_path, "grpo",   # one worker: the split is the PPO step's
                                    extra=[f"trainer.rollout_data_dir={tmp_path / 'rollout'}", "trainer.n_gpus_per_node=1"])
    _assert_searched_against_the_server(step, served)
    _finite(step, "actor/kl_loss")
    assert not any(k.startswith(("critic/values", "critic/vf_loss")) for k in step)
    # the step's trajectories are dumped (verl/trainer/ppo/dumps.py): what each turn asked and got back
    import json

    rows = [json.loads(line) for line in (tmp_path / "rollout" / "1.jsonl").read_text().splitlines()]
    assert len(rows) == ROLLOUTS and {r["step"] for r in rows} == {1}
    searched = [t for r in rows for t in r["turns"] if t["queries"]]
    assert sum(r["n_searches"] for r in rows) == round(step["env/number_of_valid_search"] * ROLLOUTS) == len(searched)
    assert all(t["observation"].startswith("\n\n<information>") and len(t["doc_ids"][0]) == TOPK for t in searched)
    assert sum(r["trained_tokens"] for r in rows) == sum(t["trained"] for r in rows for t in r["turns"]) > 0
    assert all(r["advantage"] is not None and r["stop_reason"] for r in rows)


def test_a_retrieval_server_that_dies_after_start_up_stops_the_run_at_the_first_rollout(
        ray_cluster, search_world: SearchWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up probe finds a live server, which then goes away: the first rollout's searches
    all fail, and the run stops there (above the default retriever.max_failure_fraction=0.05) instead
    of training on failure notices."""
    from contextlib import ExitStack

    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from verl.trainer import main_ppo
    from verl.trainer.ppo.rollout_setup import SearchFailureError

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    server = ExitStack()
    url = server.enter_context(serve_in_background(create_app(build_bm25_retriever(corpus, tmp_path / "index"))))
    real_probe, probed = main_ppo.wait_for_retriever, []

    def probe_then_stop_the_server(config):
        probed.append(real_probe(config))      # the real probe, against the live server
        server.close()                         # which then stops before the first rollout
        return probed[-1]

    monkeypatch.setattr(main_ppo, "wait_for_retriever", probe_then_stop_the_server)
    overrides = _search_overrides(search_world, tmp_path, "grpo",
                                  [f"retriever.url={url}/retrieve", "retriever.max_retries=0",
                                   "trainer.n_gpus_per_node=1"])     # one worker: the failure is the driver's
    with pytest.raises(SearchFailureError) as info:
        run_ppo(compose_config(overrides))
    assert probed == [f"{url}/health"]
    message = str(info.value)
    assert message.startswith("env/search_failure_fraction=1.000 (env/search_failures=")
    assert "in the rollout of training step 1 exceeds retriever.max_failure_fraction=0.05" in message
    assert f"retriever.url={url}/retrieve: GET {url}/health" in message
    # stopped before the update: no step was logged, no checkpoint written
    metrics_file = tmp_path / "ckpt" / "logs" / "metrics.jsonl"
    assert not metrics_file.exists() or metrics_file.read_text().strip() == ""
    assert not list((tmp_path / "ckpt").glob("global_step_*"))


@pytest.mark.slow   # a partial-rollout pipeline run: in CI's slow suite (the default suite's 15-minute goal)
def test_a_partial_rollout_takes_new_weights_between_turns_and_records_each_tokens_version(
        ray_cluster, search_world: SearchWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """one_step_off with rollout.partial=true: batch 2 rolls out while step 1 trains, and the server
    answers its searches once step 1 is trained (StepOneGate), so step 1's weights arrive between two
    of its turns."""
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background

    gate = StepOneGate(monkeypatch)
    retriever = build_bm25_retriever(search_world.corpus_path, tmp_path / "index")
    with serve_in_background(gate.hold(create_app(retriever))) as url:
        overrides = _search_overrides(search_world, tmp_path, "grpo", [
            f"retriever.url={url}/retrieve", "retriever.timeout=600", "trainer.total_training_steps=3",
            "trainer.n_gpus_per_node=2",
            "trainer.pipeline=one_step_off", "trainer.rollout_pool=1", "actor_rollout_ref.rollout.partial=true"])
        history = run_ppo(compose_config(overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    first, second = history[0], history[1]
    assert first["pipeline/partial_rows"] == 0.0 and first["pipeline/token_staleness_max"] == 0.0
    # batch 2: begun with the initial weights (version 0, staleness 1 at step 2), finished with step 1's
    assert second["pipeline/staleness"] == 1.0 and second["pipeline/policy_version"] == 0.0
    assert second["pipeline/partial_rows"] > 0
    assert second["pipeline/token_staleness_max"] == 1.0 and second["pipeline/token_staleness_mean"] < 1.0
    for h in history:
        assert h["env/number_of_valid_search"] > 0 and h["env/search_failures"] == 0
        assert h["pipeline/staleness"] <= 1.0


@pytest.mark.slow   # generates batches again: in CI's slow suite (the default suite's 15-minute goal)
def test_dapo_dynamic_sampling_filters_groups_and_generates_again(ray_cluster, search_world: SearchWorld,
                                                                  tmp_path: Path) -> None:
    # DAPO end to end: dynamic sampling and overlong shaping through run_ppo, with search. In the default
    # suite, not the slow one: this module's world is built there anyway, and the step itself is ~40 s
    import torch

    from verl.utils import batch_keys as K

    calls: list[dict] = []

    def alternating_reward(batch):
        """Odd calls: every row 0 (each group all equal: filtered); even calls: 1, 0, 1, 0 ... (a group's
        two samples differ: kept). The score sits on the row's last policy token."""
        mask = batch.batch[K.RESPONSE_MASK]
        scores = torch.zeros(mask.shape)
        keep = len(calls) % 2 == 1
        for row in range(mask.shape[0]):
            positions = torch.nonzero(mask[row]).flatten()
            if keep and row % 2 == 0 and len(positions):
                scores[row, positions[-1]] = 1.0
        calls.append({"rows": mask.shape[0], "width": mask.shape[1], "uids": list(batch.non_tensor_batch[K.UID])})
        return scores

    overrides = _search_overrides(search_world, tmp_path, "grpo", [
        "data.train_batch_size=1", "data.gen_batch_size=1", "trainer.n_gpus_per_node=1",   # the driver filters
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size=2",
        "actor_rollout_ref.rollout.micro_batch_size=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=2",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=20",
        "reward_model.overlong_buffer.penalty_factor=0.1", "reward_model.overlong_buffer.log=true",
    ])
    history = run_ppo(compose_config(overrides), reward_fn=alternating_reward)
    assert [h["step"] for h in history] == [1]
    step = history[-1]
    # two generation batches of one prompt x 2 samples: the first group filtered, the second trained
    assert [c["rows"] for c in calls] == [2, 2]
    assert step["train/num_gen_batches"] == 2.0
    assert step["train/filter_groups/generated"] == 2.0
    assert step["train/filter_groups/kept"] == 1.0 and step["train/filter_groups/filtered"] == 1.0
    assert step["train/filter_groups/filtered_ratio"] == pytest.approx(0.5)
    # the trained group is the second batch's: its scores 1 and 0 (less any overlong penalty) are what GRPO saw
    assert step["critic/score/max"] <= 1.0 and step["critic/score/min"] <= 0.0
    assert step["critic/score/max"] > 0.5
    assert 0.0 <= step["reward/overlong_fraction"] <= 1.0 and step["reward/overlong_reward_mean"] <= 0.0
    assert step["actor/grad_nonfinite"] == 0
    assert step["env/number_of_valid_search"] > 0   # multi-turn rows with searches were filtered and padded together


@pytest.mark.slow   # ~30 s beside this module's search world (built once): 3 steps
def test_a_partial_rollout_with_lora_takes_the_merged_weights_between_turns(
        ray_cluster, search_world: SearchWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one_step_off with rollout.partial=true (the run above) and LoRA: step 1's weights reach batch 2
    # between two of its turns (StepOneGate), through the same push (merged for the HF engine)
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from tests.trainer.test_pipeline_lora import LORA, _base_numel

    gate = StepOneGate(monkeypatch)
    retriever = build_bm25_retriever(search_world.corpus_path, tmp_path / "index")
    with serve_in_background(gate.hold(create_app(retriever))) as url:
        overrides = _search_overrides(search_world, tmp_path, "grpo", [
            f"retriever.url={url}/retrieve", "retriever.timeout=600", "trainer.total_training_steps=3",
            "trainer.n_gpus_per_node=2",
            *LORA, "actor_rollout_ref.rollout.partial=true"])
        history = run_ppo(compose_config(overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    second = history[1]
    assert second["pipeline/partial_rows"] > 0 and second["pipeline/token_staleness_max"] == 1.0
    last = history[-1]
    assert last["pipeline/weight_sync_bytes"] == last["pipeline/weight_syncs"] * _base_numel(search_world.model_dir) * 4
