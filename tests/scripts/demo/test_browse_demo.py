"""The browse world (demo.world=browse): its pages and snippets, the retrieval server's
--snippet_chars, its demonstrations (the text a rollout with the open tag writes), its settings,
trainer keys and folders, and its shipped warm start."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import requests
from transformers import AutoTokenizer

from scripts.bench.rollout import ScriptedRollout
from scripts.demo import browse_demonstrations as bd
from scripts.demo.build import (
    ONEHOP_SOURCE,
    REPO_ROOT,
    DemoSettings,
    build_browse_sft_data,
    build_corpus_and_index,
    build_questions,
    claim_data_dir,
    split_args,
)
from scripts.demo.run_demo import planned_config, retrieval_server, run_demo, start_line
from scripts.demo.warmstart import (
    MANIFEST,
    REBUILD_COMMAND,
    browse_warmstart_settings,
    resolve_warmstart,
    verify,
    warmstart_settings,
)
from scripts.demo.world import ONE_HOP_KINDS, all_questions, make_world
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from search_r1.prompt import make_prefix
from search_r1.search.client import RetrievalClient
from search_r1.search.documents import snippet
from search_r1.search.retrieval_server import ServerConfig
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.utils.dataset.sft_dataset import row_segments, tokenize_segments

SHIPPED_BROWSE = DemoSettings().browse_warmstart_path


# --- the world and its snippets -----------------------------------------------------------------


def test_snippet_keeps_the_title_and_the_first_line_cut_to_max_chars() -> None:
    assert snippet('"T"\nfirst line\nsecond', 100) == '"T"\nfirst line ...'
    assert snippet('"T"\nfirst line', 100) == '"T"\nfirst line'
    assert snippet('"T"\nfirst line', 5) == '"T"\nfirst ...'
    assert snippet("one line only", 3) == "one ..."
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_chars"):
            snippet('"T"\nx', bad)


def test_browse_pages_hold_the_facts_and_their_snippets_never_the_answer() -> None:
    world = make_world(0)
    facts, pages = world.passages(), world.browse_passages()
    assert [p["contents"].split("\n", 1)[0] for p in pages] == [p["contents"].split("\n", 1)[0] for p in facts]
    assert [p["id"] for p in pages] == [p["contents"].split("\n", 1)[0].strip('"') for p in pages]   # ids: titles
    assert len({p["id"] for p in pages}) == len(pages)
    assert world.pages("facts") == facts and world.pages("browse") == pages
    by_title = {p["contents"].split("\n")[0].strip('"'): p["contents"] for p in pages}
    for kind in ONE_HOP_KINDS:
        for q in all_questions(world, [kind]):
            page = by_title[q.subject]
            assert q.answer in page
            assert q.answer not in snippet(page, bd.SNIPPET_CHARS), (q.text, snippet(page, bd.SNIPPET_CHARS))
    with pytest.raises(ValueError, match="demo.world takes"):
        world.pages("web")


def test_the_server_shows_snippets_only_when_told_and_open_returns_the_whole_page(tmp_path: Path) -> None:
    s = DemoSettings(data_dir=str(tmp_path), world="browse")
    corpus, index = build_corpus_and_index(s)
    page = make_world(0).browse_passages()[0]["contents"]
    name = page.split("\n")[0].strip('"')
    with retrieval_server(None, index, corpus, 2, tmp_path / "a.log", ["--snippet_chars", "60"]) as url:
        hit = requests.post(url, json={"queries": [name], "topk": 1}, timeout=10).json()["result"][0][0]
        assert hit == {"id": name, "contents": snippet(page, 60)}
        opened = requests.post(url.replace("/retrieve", "/open"), json={"doc_id": name}, timeout=10).json()
        assert opened["text"] == page.split("\n", 1)[1]
    with retrieval_server(None, index, corpus, 2, tmp_path / "b.log") as url:   # default: whole passages
        hit = requests.post(url, json={"queries": [name], "topk": 1}, timeout=10).json()["result"][0][0]
        assert hit == {"id": name, "contents": page}
    with pytest.raises(ValueError, match="snippet_chars"):
        ServerConfig(snippet_chars=-1)


# --- demonstrations -----------------------------------------------------------------------------


def test_most_demonstrations_guess_from_the_snippet_and_the_rest_open_and_copy() -> None:
    worlds = [make_world(101), make_world(102)]
    demos = bd.make_browse_demonstrations(worlds, 400, 2, seed=0, open_share=0.2)
    assert len(demos) == 400
    opened = [(q, t) for q, t in demos if len(t) == 5]
    guessed = [(q, t) for q, t in demos if len(t) == 3]
    assert len(opened) + len(guessed) == 400 and 0.12 < len(opened) / 400 < 0.28
    assert {q.kind for q, _ in demos} == set(ONE_HOP_KINDS)
    for q, turns in opened:
        assert [t.role for t in turns] == ["policy", "observation", "policy", "observation", "policy"]
        assert q.answer not in turns[1].text and q.answer in turns[3].text
        assert turns[4].text.endswith(f"<answer> {q.answer} </answer>")
        doc_id = turns[2].text.split("<open> ")[1].split(" </open>")[0]
        assert f'(Title: "{q.subject}") [doc_id: {doc_id}]' in turns[1].text
    for q, turns in guessed:
        assert "<open>" not in "".join(t.text for t in turns)
        assert "I know it." in turns[2].text and f"<answer> {q.answer} </answer>" not in turns[2].text
    with pytest.raises(ValueError, match="browse_open_share"):
        bd.make_browse_demonstrations(worlds, 4, 2, seed=0, open_share=1.5)


def test_browse_demonstrations_are_token_for_token_what_a_rollout_builds(tmp_path: Path) -> None:
    """The generation manager with the open tag (a real retrieval server over a browse world, with
    snippets) fed the demonstrations' policy tokens builds the SFT rows' ids, with the observations
    (the snippets, the opened page) masked out of the loss."""
    tok = AutoTokenizer.from_pretrained(DemoSettings().warmstart_path)
    s = DemoSettings(data_dir=str(tmp_path), world_seed=101, world="browse")
    corpus, index = build_corpus_and_index(s)
    world = make_world(101)
    local = bd.SnippetSearch(world.browse_passages())
    questions = [all_questions(world, [k])[3] for k in ONE_HOP_KINDS]
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    with retrieval_server(None, index, corpus, 2, tmp_path / "server.log", ["--snippet_chars", str(bd.SNIPPET_CHARS)]) as url:
        client = RetrievalClient(url, topk=2)
        server = SimpleNamespace(search=lambda queries, topk: client.retrieve(list(queries)), page_id=local.page_id,
                                 open=local.open)
        rng = random.Random(0)
        demos = [bd.browse_trajectory(q, world, server, 2, opens=i < 3, rng=rng) for i, q in enumerate(questions)]
        scripts = {q.text: [encode(t.text) + ([tok.eos_token_id] if t is turns[-1] else [])
                            for t in turns if t.role == "policy"] for q, turns in zip(questions, demos, strict=True)}
        config = GenerationConfig(max_turns=2, max_start_length=256, max_prompt_length=1024, max_response_length=40,
                                  max_obs_length=160, search_url=url, topk=2, retrieval_max_retries=0, open_tag=True,
                                  max_opens=1, open_page_size=bd.PAGE_SIZE)
        messages = [[{"role": "user", "content": make_prefix(q.text, "open")}] for q in questions]
        prompts = [tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False)
                   for m in messages]
        ids, mask = left_pad(prompts, tok.pad_token_id)
        batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                             K.POSITION_IDS: position_ids_from_mask(mask)})
        engine = ScriptedRollout(tok, scripts, key_pattern=r"Question: (.+?\?)\n")
        out = LLMGenerationManager(tok, engine, config).run_llm_loop(batch, ids)
    assert out.meta_info["valid_open_stats"] == [1, 1, 1, 0]
    weights = {"prompt": 0.0, "policy": 1.0, "observation": 0.0}
    for row, (q, turns) in enumerate(zip(questions, demos, strict=True)):
        sft = tokenize_segments(tok, row_segments({"prompt": messages[row], "turns": [t.__dict__ for t in turns]},
                                                  tok, "prompt", "response", "demo"), weights)
        n_prompt = len(prompts[row])
        n = int(out.batch[K.ATTENTION_MASK][row, out.batch[K.PROMPTS].shape[1]:].sum())
        got, want = out.batch[K.RESPONSES][row, :n].tolist(), sft.input_ids_L[n_prompt:].tolist()
        # The same ids; the SFT row ends with EOS, which the rollout's response holds as padding.
        assert want[-1] == tok.eos_token_id and got == want[:-1], (q.text, tok.decode(got), tok.decode(want))
        if row < 3:   # the opened page, with the answer, is in the rollout, masked out of the loss
            text = tok.decode(got)
            assert q.answer in text.split("</open>")[1].split("</information>")[0]
        loss = out.batch[K.LOSS_MASK][row, :n].tolist()
        assert loss == [int(w) for w in sft.loss_weight_L[n_prompt:-1].tolist()], q.text


def test_browse_sft_rows_use_the_open_template(tmp_path: Path) -> None:
    s = replace(split_args(["demo.world=browse"])[0], data_dir=str(tmp_path), browse_n_demos=20,
                sft_world_seeds=(101,))
    frame = pd.read_parquet(build_browse_sft_data(s))
    assert len(frame) == 20
    content = frame.iloc[0]["prompt"][0]["content"]
    assert "<open> doc_id </open>" in content
    assert (tmp_path / "sft_browse" / "train.fingerprint").exists()


# --- settings, data, trainer keys ---------------------------------------------------------------


def test_world_browse_composes_the_open_tag_and_its_own_folders() -> None:
    settings, user = split_args(["demo.world=browse"])
    assert (settings.data_dir, settings.output_dir, settings.variant) == ("data/demo_browse", "outputs/demo_browse",
                                                                          "browse")
    cfg = planned_config("grpo", settings, user)
    assert cfg.open_tag.enable is True and cfg.open_tag.max_opens == 1 and cfg.max_turns == 2
    assert cfg.data.max_obs_length == 160   # the open tag's invalid-action notice (143 tokens) fits
    assert cfg.open_tag.page_size == bd.PAGE_SIZE and cfg.trainer.experiment_name == "demo-grpo-browse"
    cfg = planned_config("grpo", *split_args(["demo.world=browse", "max_turns=3"]))
    assert cfg.max_turns == 3   # a user's override wins
    facts, user = split_args([])
    assert facts.world == "facts" and planned_config("grpo", facts, user).open_tag.enable is False
    with pytest.raises(SystemExit, match="demo.world takes facts or browse"):
        split_args(["demo.world=web"])
    with pytest.raises(SystemExit, match="demo.world=browse runs in the tag protocol"):
        split_args(["demo.world=browse", "demo.protocol=tool"])


def test_browse_questions_are_one_hop_in_the_open_template(tmp_path: Path) -> None:
    s = replace(split_args(["demo.world=browse"])[0], data_dir=str(tmp_path), n_train=40, n_val_per_kind=2)
    claim_data_dir(s)
    train_pq, test_pq = build_questions(s)
    for path in (train_pq, test_pq):
        frame = pd.read_parquet(path)
        assert set(frame["data_source"]) == {ONEHOP_SOURCE}
        assert all("<open> doc_id </open>" in p[0]["content"] for p in frame["prompt"])
    assert len(pd.read_parquet(test_pq)) == 2 * len(ONE_HOP_KINDS)
    assert (tmp_path / "PROTOCOL").read_text().strip() == "browse"
    with pytest.raises(SystemExit, match="holds the 'browse' protocol's demo data"):
        claim_data_dir(replace(s, world="facts"))


def test_the_start_line_names_the_browse_warmstart() -> None:
    line = start_line(split_args(["demo.world=browse"])[0], 12, 4, 120)
    assert "shipped warm start (example/demo_warmstart_browse, 200 SFT steps)" in line


# --- the shipped warm start ---------------------------------------------------------------------


def test_shipped_browse_warmstart_matches_its_manifest_and_the_default_settings(tmp_path: Path) -> None:
    manifest = verify(SHIPPED_BROWSE)
    s = split_args(["demo.world=browse"])[0]
    assert manifest.settings == browse_warmstart_settings(s), "DemoSettings or the browse text changed: rebuild it"
    assert manifest.command.startswith(REBUILD_COMMAND) and "demo.world=browse" in manifest.command
    assert [p["steps"] for p in manifest.sft_phases] == list(s.browse_sft_steps)
    tag_manifest = verify(DemoSettings().warmstart_path)
    assert manifest.inputs["base_model_sha256"] == tag_manifest.files["model.safetensors"]
    assert manifest.files["tokenizer.json"] == tag_manifest.files["tokenizer.json"]
    assert {k: manifest.settings[k] for k in warmstart_settings(s)} == warmstart_settings(s)
    assert resolve_warmstart(replace(s, data_dir=str(tmp_path))) == SHIPPED_BROWSE
    assert list(tmp_path.iterdir()) == []


def test_a_changed_open_template_makes_the_shipped_browse_warmstart_stale(monkeypatch) -> None:
    import search_r1.prompt

    s = split_args(["demo.world=browse"])[0]
    before = browse_warmstart_settings(s)
    monkeypatch.setattr(search_r1.prompt, "PROMPT_TEMPLATE_OPEN", "Open things. Question: {question}\n")
    assert browse_warmstart_settings(s)["browse_text_protocol"] != before["browse_text_protocol"]
    assert json.loads((SHIPPED_BROWSE / MANIFEST).read_text())["settings"] == before


# --- the entry point, tiny ----------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_browse_demo_runs_end_to_end(tmp_path: Path) -> None:
    """`run_demo demo.world=browse` at a tiny size from the shipped browse warm start: snippets from
    the server it starts, opens in the sampled rollouts, opens per question in the summary."""
    args = [f"demo.data_dir={tmp_path / 'data'}", f"demo.output_dir={tmp_path / 'out'}", "demo.world=browse",
            "trainer.n_gpus_per_node=1",
            "demo.n_val_per_kind=2", "demo.n_train=64", "trainer.total_training_steps=1",
            "data.train_batch_size=8", "data.val_batch_size=16", "actor_rollout_ref.rollout.n_agent=4",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_micro_batch_size=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=32", "actor_rollout_ref.ref.log_prob_micro_batch_size=32"]
    summary = run_demo(args)
    assert summary.world == "browse" and set(summary.val_em_after_by_source) == {ONEHOP_SOURCE}
    assert summary.opens_before is not None and summary.opens_after is not None
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["opens_before"] == summary.opens_before and written["world"] == "browse"
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    train = [r for r in records if "env/number_of_valid_open" in r and "critic/score/mean" in r]
    assert train and train[0]["env/number_of_valid_open"] > 0, "no sampled rollout opened a page"
    assert train[0].get("env/open_not_found", 0) < train[0]["env/number_of_valid_open"] * 32
    # infer.py --demo asks as the run trained: the summary's open_tag (snippets, the open template and tag)
    assert written["open_tag"] == {"enable": True, "max_opens": 1, "page_size": 1000, "snippet_chars": 60}
    assert summary.try_command.startswith("python infer.py --demo --question ") and "--demo_output_dir" in summary.try_command
    asked = subprocess.run([sys.executable, *shlex.split(summary.try_command)[1:], "--max_new_tokens", "40"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert asked.returncode == 0, asked.stderr[-2000:]
    # results show their ids (the open tag's rendering) and a snippet (the server started with --snippet_chars)
    assert re.search(r"\[doc_id: [^\]]+\] [^\n<]* \.\.\.", asked.stdout), asked.stdout[-1500:]
    assert re.search(r"# Answer: .*\(\w+, \d+ searches, \d+ opens\)", asked.stdout), asked.stdout[-1500:]
