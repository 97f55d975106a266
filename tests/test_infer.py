"""infer.py against a real BM25 retrieval server: the model searches, reads, and answers.

The model is a tiny Qwen2 taught one trajectory with the project's SFT trainer, so its
greedy behaviour is known: search for the question's subject, then answer with what
the retrieved passage says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import requests

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Where was Kalo Miven born?"
CORPUS = [
    {"id": "0", "contents": '"Kalo Miven"\nKalo Miven was born in Dorsil and works at Fen Labs.'},
    {"id": "1", "contents": '"Dorsil"\nDorsil is a city in Zaria.'},
    {"id": "2", "contents": '"Fen Labs"\nFen Labs was founded by Ora Pel.'},
]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    from search_r1.search.index_builder import build_index

    root = tmp_path_factory.mktemp("retrieval")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    index = build_index("bm25", str(corpus), str(root))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "search_r1.search.retrieval_server", "--index_path", str(index),
         "--corpus_path", str(corpus), "--topk", "1", "--retriever_name", "bm25", "--port", str(port)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/retrieve"
    try:
        for _ in range(240):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None:
                raise RuntimeError("retrieval server exited early")
            time.sleep(0.5)
        else:
            raise TimeoutError("retrieval server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def taught_model(tmp_path_factory: pytest.TempPathFactory, server_url: str) -> str:
    """A tiny model SFT-trained on the one trajectory it should replay (real search result inside)."""
    from transformers import AutoTokenizer

    from infer import retrieval_search_fn
    from search_r1.prompt import make_prefix
    from verl.utils.tiny_model import DEFAULT_TEXTS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("taught")
    texts = [*DEFAULT_TEXTS, *(r["contents"] for r in CORPUS), QUESTION]
    init = make_tiny_checkpoint(root / "init", texts=texts, vocab_size=400, hidden_size=64, num_layers=2)
    AutoTokenizer.from_pretrained(init)  # fail early if the checkpoint is unreadable
    observation = retrieval_search_fn(server_url, topk=1)("Kalo Miven")
    assert "born in Dorsil" in observation
    row = {"prompt": [{"role": "user", "content": make_prefix(QUESTION)}],
           "turns": [{"role": "policy", "text": "<think> search Kalo Miven </think>\n<search> Kalo Miven </search>"},
                     {"role": "observation", "text": observation},
                     {"role": "policy", "text": "<think> found </think>\n<answer> Dorsil </answer>"}]}
    return _teach(root, init, row, "trainer.total_training_steps=80", "trainer.log_freq=20")


def _teach(root: Path, init: str, row: dict, *overrides: str) -> str:
    """A checkpoint of `init` SFT-trained on `row` (8 copies), policy turns only, with the project's trainer."""
    from verl.trainer.fsdp_sft_trainer import compose_sft_config, run_sft

    data = root / "sft.parquet"
    pd.DataFrame([row] * 8).to_parquet(data)
    cfg = compose_sft_config([
        f"data.train_files={data}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=8",
        f"model.partial_pretrain={init}", "optim.lr=1e-2", "optim.warmup_steps_ratio=0.05",
        "data.loss_weights.observation=0.0", "data.loss_weights.prompt=0.0",
        f"trainer.default_local_dir={root / 'sft'}", "trainer.device=cpu", "trainer.num_threads=1", *overrides])
    return str(run_sft(cfg).checkpoint_dir)


def test_the_model_searches_then_answers_from_the_retrieved_passage(taught_model: str, server_url: str) -> None:
    from infer import answer_question, load_model, retrieval_search_fn

    model, tok = load_model(taught_model, "cpu")
    episode = answer_question(model, tok, QUESTION, retrieval_search_fn(server_url, topk=1), max_turns=2,
                              max_new_tokens=40)
    assert [t.action.kind for t in episode.turns] == ["search", "answer"]
    assert episode.turns[0].action.content == "Kalo Miven"
    # The observation came from the live server, rendered as in training.
    assert episode.turns[0].observation.startswith("\n\n<information>Doc 1(Title: \"Kalo Miven\") Kalo Miven was born")
    assert episode.answer == "Dorsil" and episode.stop_reason == "answered" and episode.n_searches == 1
    # The turn was cut at the stop string: nothing generated past </search>.
    assert episode.turns[0].text.endswith("</search>")


def test_a_search_on_the_final_turn_is_not_run(taught_model: str, server_url: str) -> None:
    from infer import answer_question, load_model, retrieval_search_fn

    model, tok = load_model(taught_model, "cpu")
    episode = answer_question(model, tok, QUESTION, retrieval_search_fn(server_url, topk=1), max_turns=0,
                              max_new_tokens=40)
    assert episode.n_searches == 0 and episode.stop_reason == "max_turns" and episode.answer is None


def test_a_failed_search_becomes_an_observation_not_a_crash(taught_model: str) -> None:
    from infer import answer_question, load_model, retrieval_search_fn

    model, tok = load_model(taught_model, "cpu")
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    episode = answer_question(model, tok, QUESTION, retrieval_search_fn(dead, topk=1), max_turns=1, max_new_tokens=40)
    assert "failed" in episode.turns[0].observation


def test_cli_prints_each_turn_and_the_answer(taught_model: str, server_url: str, tmp_path: Path) -> None:
    dump = tmp_path / "answers.jsonl"
    dump.write_text(json.dumps({"step": 9, "input": "an earlier answer", "output": "x"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "infer.py", "--question", QUESTION, "--model_path", taught_model,
         "--retriever_url", server_url, "--topk", "1", "--max_turns", "2", "--device", "cpu",
         "--max_new_tokens", "40", "--dump", str(dump)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "<search> Kalo Miven </search>" in proc.stdout
    assert "Doc 1(Title: \"Kalo Miven\")" in proc.stdout
    assert "# Answer: Dorsil" in proc.stdout
    # --dump appended the episode as a trajectory-dump row, which the viewer reads
    earlier, row = [json.loads(line) for line in dump.read_text().splitlines()]
    assert earlier["input"] == "an earlier answer"
    assert [t["queries"] for t in row["turns"]] == [["Kalo Miven"], []] and row["answer"] == "Dorsil"
    assert row["turns"][0]["observation"].startswith("\n\n<information>Doc 1(Title: \"Kalo Miven\")")
    assert row["step"] == 0 and row["n_searches"] == 1 and row["stop_reason"] == "answered"
    from scripts.viewer import collect

    assert [r["step"] for r in collect([dump]).rows] == [9, 0]


def test_a_dump_row_scores_the_answer_with_the_training_rewards_exact_match() -> None:
    from infer import Episode, Turn, checkpoint_step, dump_row
    from search_r1.llm_agent.actions import Action

    episode = Episode("Q?", [Turn("<search> q </search>", Action("search", "q"), "\n\n<information>x</information>\n\n"),
                             Turn("<answer> the Dorsil </answer>", Action("answer", "the Dorsil"), None)],
                      answer="the Dorsil", stop_reason="answered", n_searches=1)
    row = dump_row(episode, 12, ["Dorsil"])
    assert row["correct"] is True and row["score"] == 1.0 and row["reward_parts"] == {"em": 1}   # EM normalises "the"
    assert row["output"] == "<search> q </search>\n\n<information>x</information>\n\n<answer> the Dorsil </answer>"
    assert dump_row(episode, 12, ["Zaria"])["correct"] is False
    assert dump_row(episode)["score"] is None and dump_row(episode)["correct"] is False   # no golden answer
    assert checkpoint_step("out/checkpoints/global_step_12/hf") == 12 and checkpoint_step("Qwen/Qwen2.5-3B") == 0


def test_a_turn_stops_at_any_eos_of_the_generation_config(tiny_model_dir: str) -> None:
    """Qwen2.5-Instruct ends a turn with <|im_end|> (its tokenizer's EOS) or <|endoftext|> (only in
    its generation config): infer.py stops at either, as training does."""
    import torch

    from infer import answer_question, eos_ids, load_model

    model, tok = load_model(tiny_model_dir)
    other = tok.pad_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    assert eos_ids(model, tok) == (tok.eos_token_id, other)
    # A model that always writes `other`: the episode ends at once with reason eos, not invalid_action.
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[other] = 1.0
        if model.lm_head.bias is not None:
            model.lm_head.bias.zero_()
    episode = answer_question(model, tok, "who?", search=lambda q: "", max_turns=2, max_new_tokens=4)
    assert episode.stop_reason == "eos" and len(episode.turns) == 1


@pytest.fixture(scope="module")
def taught_opener(tmp_path_factory: pytest.TempPathFactory, server_url: str) -> str:
    """A tiny model SFT-trained on an open-tag trajectory: search, open the result, answer from the page."""
    from infer import retrieval_open_fn, retrieval_search_fn
    from search_r1.prompt import make_prefix
    from verl.utils.tiny_model import DEFAULT_TEXTS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("opener")
    texts = [*DEFAULT_TEXTS, *(r["contents"] for r in CORPUS), QUESTION, "[doc_id: 0] <open> </open> page"]
    init = make_tiny_checkpoint(root / "init", texts=texts, vocab_size=400, hidden_size=64, num_layers=2)
    found = retrieval_search_fn(server_url, topk=1, show_doc_ids=True)("Kalo Miven")
    assert "[doc_id: 0]" in found
    page = retrieval_open_fn(server_url)("0")
    assert "born in Dorsil" in page and "doc 0, page 1 of 1" in page
    row = {"prompt": [{"role": "user", "content": make_prefix(QUESTION, "open")}],
           "turns": [{"role": "policy", "text": "<think> search </think>\n<search> Kalo Miven </search>"},
                     {"role": "observation", "text": found},
                     {"role": "policy", "text": "<think> read it </think>\n<open> 0 </open>"},
                     {"role": "observation", "text": page},
                     {"role": "policy", "text": "<think> found </think>\n<answer> Dorsil </answer>"}]}
    return _teach(root, init, row, "data.max_length=1024", "trainer.total_training_steps=100", "trainer.log_freq=50")


def test_with_the_open_tag_the_model_opens_the_result_and_answers_from_the_page(
        taught_opener: str, server_url: str) -> None:
    from infer import answer_question, load_model, retrieval_open_fn, retrieval_search_fn

    model, tok = load_model(taught_opener, "cpu")
    search = retrieval_search_fn(server_url, topk=1, show_doc_ids=True)
    episode = answer_question(model, tok, QUESTION, search, max_turns=2, max_new_tokens=40,
                              open_doc=retrieval_open_fn(server_url))
    assert [t.action.kind for t in episode.turns] == ["search", "open", "answer"]
    assert episode.turns[1].text.endswith("</open>")          # cut at the open tag's stop string
    assert "doc 0, page 1 of 1" in episode.turns[1].observation   # the server's page, rendered as in training
    assert episode.answer == "Dorsil" and (episode.n_searches, episode.n_opens) == (1, 1)
    # Past the open budget the open is not run: the rollout's notice, and the episode goes on.
    capped = answer_question(model, tok, QUESTION, search, max_turns=2, max_new_tokens=40,
                             open_doc=retrieval_open_fn(server_url), max_opens=0)
    assert capped.n_opens == 0 and "open budget is spent" in capped.turns[1].observation


def test_cli_open_tag_prints_the_opened_page(taught_opener: str, server_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "infer.py", "--question", QUESTION, "--model_path", taught_opener, "--open_tag",
         "--retriever_url", server_url, "--topk", "1", "--max_turns", "2", "--device", "cpu",
         "--max_new_tokens", "40"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[doc_id: 0]" in proc.stdout and "<open> 0 </open>" in proc.stdout
    assert "# Answer: Dorsil  (answered, 1 searches, 1 opens)" in proc.stdout
    bad = subprocess.run([sys.executable, "infer.py", "--open_tag", "--max_opens", "0", "--question", "x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--max_opens must be >= 1" in bad.stderr
