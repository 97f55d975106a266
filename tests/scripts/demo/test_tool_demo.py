"""The demo in the tool protocol (demo.protocol=tool): its demonstrations are the text a rollout
writes, its trainer overrides, its data layout and folders, and its shipped warm start."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from scripts.bench.rollout import ScriptedRollout
from scripts.demo import tool_demonstrations as td
from scripts.demo.build import (
    DemoSettings,
    build_corpus_and_index,
    build_questions,
    claim_data_dir,
    split_args,
)
from scripts.demo.demonstrations import WorldSearch
from scripts.demo.run_demo import planned_config, retrieval_server, run_demo, tool_config_path
from scripts.demo.warmstart import (
    MANIFEST,
    REBUILD_COMMAND,
    resolve_warmstart,
    tool_warmstart_settings,
    verify,
    warmstart_settings,
)
from scripts.demo.world import all_questions, make_world
from search_r1.llm_agent import tools
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from search_r1.search.client import RetrievalClient
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.utils.dataset.sft_dataset import row_segments, tokenize_segments

SHIPPED_TOOL = DemoSettings().tool_warmstart_path


@pytest.fixture(scope="module")
def tool_tokenizer():
    return td.with_tool_template(AutoTokenizer.from_pretrained(DemoSettings().warmstart_path))


def test_tool_chat_template_renders_tool_messages_as_the_rollout_appends_them(tool_tokenizer) -> None:
    framing = td.framing_for(tool_tokenizer)
    assert framing.assistant_end == "<|im_end|>\n"
    # Consecutive tool messages share one user turn (Qwen2.5's layout).
    assert framing.observation(["a", "b"], ended_with_eos=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    prompt = td.render_prompt(tool_tokenizer, "Where was Tupemi Wenvios born?")
    assert prompt.startswith("<|im_start|>system\nYou are a helpful and harmless assistant.\n\n# Tools")
    assert json.dumps(td.SEARCH_TOOL_SCHEMA) in prompt
    assert prompt.endswith(f"<|im_start|>user\n{td.USER_CONTENT_PREFIX}Where was Tupemi Wenvios born?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    # Without tools and a system message it is the tag demo's template.
    plain = [{"role": "user", "content": "q"}]
    tag_tok = AutoTokenizer.from_pretrained(DemoSettings().warmstart_path)
    assert tool_tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == \
        tag_tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def test_a_demonstration_is_the_conversation_the_chat_template_renders(tool_tokenizer) -> None:
    world = make_world(101)
    question = next(q for q in all_questions(world, ["employer_founder"]))
    turns = td.searched_trajectory(question, WorldSearch(world.passages()), 2, td.framing_for(tool_tokenizer))
    assert [t.role for t in turns] == ["policy", "observation", "policy", "observation", "policy"]
    messages = td.prompt_messages(question.text)
    for turn in turns:
        if turn.role == "policy":
            messages.append({"role": "assistant", "content": turn.text})
        else:
            content = turn.text.split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]
            messages.append({"role": "tool", "content": content})
    whole = tool_tokenizer.apply_chat_template(messages, tools=[td.SEARCH_TOOL_SCHEMA], tokenize=False)
    # The SFT row (prompt, turns, and the EOS the trainer appends) is that conversation.
    row_text = td.render_prompt(tool_tokenizer, question.text) + "".join(t.text for t in turns) + "<|im_end|>\n"
    assert row_text == whole
    assert json.loads(messages[3]["content"])["result"].startswith(f'Doc 1 (Title: "{question.hops[0]}")')


def test_a_demonstrations_query_spells_each_name_in_the_pieces_the_model_read(tool_tokenizer) -> None:
    """Byte-level BPE gives a name right after `"` other pieces than after a space; the query
    ("about <name>") keeps the pieces of the question (hop 1) and of the passage (hop 2), so the
    model copies what it read. The bare name inside the JSON string would not."""
    tok = tool_tokenizer
    world = make_world(101)
    search = WorldSearch(world.passages())
    framing = td.framing_for(tok)

    def pieces(text: str) -> list[str]:
        return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])

    def contains(seq: list[str], sub: list[str]) -> bool:
        return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    for kind in ("birth_country", "employer_founder", "country", "founder"):
        question = all_questions(world, [kind])[0]
        turns = td.searched_trajectory(question, search, 2, framing)
        calls = [t.text for t in turns if t.role == "policy"][:-1]
        read = [td.user_content(question.text), turns[1].text]   # the prompt, then the first answer
        for hop, call, source in zip(question.hops, calls, read, strict=False):
            name = pieces(f" {hop}")
            assert contains(pieces(source), name), (hop, source)
            assert contains(pieces(call.split("<tool_call>", 1)[1]), name), (hop, call)
            assert not contains(pieces(json.dumps({"query_list": [hop]})), name), hop   # why the prefix


def test_tool_demonstrations_are_token_for_token_what_a_rollout_builds(tool_tokenizer, tmp_path: Path) -> None:
    """The rollout (the generation manager in tool mode, a real retrieval server over the same
    world) fed the demonstrations' policy tokens builds exactly the SFT row's ids, and its loss
    mask is the SFT row's policy/observation split."""
    tok = tool_tokenizer
    s = DemoSettings(data_dir=str(tmp_path), world_seed=101)
    corpus, index = build_corpus_and_index(s)
    world = make_world(101)
    framing = td.framing_for(tok)
    questions = [all_questions(world, [k])[3] for k in ("birthplace", "birth_country", "founder", "country")]
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    with retrieval_server(None, index, corpus, 2, tmp_path / "server.log") as url:
        # The server's hits (its BM25 breaks score-0 ties as its own index orders them, which an
        # in-process index need not), written by the demonstrations' own functions.
        client = RetrievalClient(url, topk=2)
        server = SimpleNamespace(search=lambda queries, topk: client.retrieve(list(queries)))
        demos = [td.searched_trajectory(q, server, 2, framing) for q in questions[:3]]
        demos.append(td.guessed_trajectory(questions[3], world, random.Random(0)))
        scripts = {q.text: [encode(t.text) + ([tok.eos_token_id] if t is turns[-1] else [])
                            for t in turns if t.role == "policy"]
                   for q, turns in zip(questions, demos, strict=True)}
        tool_config = tools.parse_tool_config(td.tool_config(url, 2))
        config = GenerationConfig(max_turns=2, max_start_length=640, max_prompt_length=640 + 512,
                                  max_response_length=512, max_total_response_length=512, max_obs_length=192,
                                  protocol="tool", tool_config=tool_config.to_dict(), max_assistant_turns=3,
                                  max_tool_response_length=td.MAX_TOOL_RESPONSE_LENGTH, retrieval_max_retries=0)
        prompts = [encode(td.render_prompt(tok, q.text)) for q in questions]
        ids, mask = left_pad(prompts, tok.pad_token_id)
        batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                             K.POSITION_IDS: position_ids_from_mask(mask)})
        engine = ScriptedRollout(tok, scripts, key_pattern=r"Question: (.+?\?)<\|im_end\|>")
        out = LLMGenerationManager(tok, engine, config).run_llm_loop(batch, ids)

    weights = {"prompt": 0.0, "policy": 1.0, "observation": 0.0}
    for row, (q, turns) in enumerate(zip(questions, demos, strict=True)):
        sft = tokenize_segments(tok, row_segments({"prompt": td.render_prompt(tok, q.text),
                                                   "turns": [t.__dict__ for t in turns]}, tok, "prompt", "response",
                                                  "demo"), weights)
        n_prompt = len(prompts[row])
        n = int(out.batch[K.ATTENTION_MASK][row, out.batch[K.PROMPTS].shape[1]:].sum())
        got, want = out.batch[K.RESPONSES][row, :n].tolist(), sft.input_ids_L[n_prompt:].tolist()
        assert got == want, (q.text, tok.decode(got), tok.decode(want))
        assert out.batch[K.LOSS_MASK][row, :n].tolist() == sft.loss_weight_L[n_prompt:].long().tolist(), q.text
    assert torch.equal(out.batch[K.PROMPTS], ids)


def test_demo_tool_responses_fit_verls_default_truncation() -> None:
    """Every demonstration's tool message is whole at max_tool_response_length=256 (the
    rollout would cut a longer one; tool_response raises rather than train on a cut text)."""
    for seed in (0, 101, 110):
        world = make_world(seed)
        search = WorldSearch(world.passages())
        longest = max(len(tools.render_search_results([search.search([p["contents"].split("\n")[0].strip('"')], 2)[0]]))
                      for p in world.passages())
        assert longest <= td.MAX_TOOL_RESPONSE_LENGTH, (seed, longest)


def test_protocol_tool_composes_the_recipes_trainer_keys_and_its_own_folders() -> None:
    settings, user = split_args(["demo.protocol=tool"])
    assert (settings.data_dir, settings.output_dir) == ("data/demo_tool", "outputs/demo_tool")
    cfg = planned_config("grpo", settings, user)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable is True and multi_turn.max_assistant_turns == 3
    assert multi_turn.tool_config_path == str(tool_config_path(settings))
    assert multi_turn.max_tool_response_length == td.MAX_TOOL_RESPONSE_LENGTH
    assert cfg.data.max_response_length == 512   # every turn and tool message of a row together
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.trainer.experiment_name == "demo-grpo-tool"
    # A user's override still wins.
    cfg = planned_config("grpo", *split_args(["demo.protocol=tool", "data.max_response_length=400"]))
    assert cfg.data.max_response_length == 400
    # The tag demo is unchanged.
    tags, user = split_args([])
    assert (tags.protocol, tags.data_dir, tags.output_dir) == ("tags", "data/demo", "outputs/demo")
    tag_cfg = planned_config("grpo", tags, user)
    assert tag_cfg.actor_rollout_ref.rollout.multi_turn.enable is False
    assert tag_cfg.data.max_response_length == 40
    with pytest.raises(SystemExit, match="demo.protocol takes tags or tool"):
        split_args(["demo.protocol=xml"])


def test_train_grpo_sh_with_protocol_tool_runs_the_full_size_tool_demo(tmp_path: Path) -> None:
    """README's `bash train_grpo.sh demo.protocol=tool` on a machine with no GPU: the demo, at the
    size docs/demo.md measures (12 GRPO steps, 32 prompts x 5, 180 validation questions), from the
    shipped tool warm start."""
    from tests.scripts.demo.test_ppo_demo import composed, demo_argv

    argv = demo_argv("train_grpo.sh", tmp_path, "demo.protocol=tool")
    algorithm, cfg = composed(argv)
    settings, _ = split_args([a for a in argv if a.startswith("demo.")])
    assert algorithm == "grpo" and settings.protocol == "tool"
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is True
    assert cfg.trainer.total_training_steps == 12
    assert cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n_agent == 160
    assert resolve_warmstart(settings) == SHIPPED_TOOL and settings.tool_sft_steps == (200,)


def test_tool_questions_are_verl_preprocess_rows_scored_by_search_r1_like(tmp_path: Path) -> None:
    from verl.utils.reward_score import get_scorer

    s = replace(split_args(["demo.protocol=tool"])[0], data_dir=str(tmp_path), n_train=40, n_val_per_kind=2)
    _, test_pq = build_questions(s)
    frame = pd.read_parquet(test_pq)
    assert set(frame["data_source"]) == {"searchR1_demo_onehop", "searchR1_demo_twohop"}
    row = frame.iloc[0]
    question = row["extra_info"]["question"]
    assert [dict(m) for m in row["prompt"]] == td.prompt_messages(question)
    assert row["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]["question"] == question
    answer = str(row["reward_model"]["ground_truth"]["target"][0])
    scorer = get_scorer(row["data_source"])
    truth = {"target": list(row["reward_model"]["ground_truth"]["target"])}
    assert scorer(f"<answer> {answer} </answer>", truth) == 1
    assert scorer("<answer> nobody </answer>", truth) == 0


def test_a_data_folder_serves_one_protocol(tmp_path: Path) -> None:
    tags = DemoSettings(data_dir=str(tmp_path))
    claim_data_dir(tags)
    claim_data_dir(tags)   # the same protocol again is fine
    with pytest.raises(SystemExit, match="holds the 'tags' protocol's demo data"):
        claim_data_dir(replace(tags, protocol="tool"))


def test_shipped_tool_warmstart_matches_its_manifest_and_the_default_settings(tmp_path: Path) -> None:
    manifest = verify(SHIPPED_TOOL)
    s = split_args(["demo.protocol=tool"])[0]
    assert manifest.settings == tool_warmstart_settings(s), "DemoSettings or the tool text changed: rebuild it"
    assert manifest.settings["protocol"] == "tool"
    assert manifest.command.startswith(REBUILD_COMMAND) and "demo.protocol=tool" in manifest.command
    assert [p["steps"] for p in manifest.sft_phases] == list(s.tool_sft_steps)
    # It continued the shipped tag warm start: same tokenizer file, the tool chat template.
    tag_manifest = verify(DemoSettings().warmstart_path)
    assert manifest.inputs["base_model_sha256"] == tag_manifest.files["model.safetensors"]
    assert manifest.files["tokenizer.json"] == tag_manifest.files["tokenizer.json"]
    assert AutoTokenizer.from_pretrained(SHIPPED_TOOL).chat_template == td.TOOL_CHAT_TEMPLATE
    # The tag settings are the tag warm start's; the demo uses the shipped folder without building.
    assert {k: manifest.settings[k] for k in warmstart_settings(s)} == warmstart_settings(s)
    assert resolve_warmstart(replace(s, data_dir=str(tmp_path))) == SHIPPED_TOOL
    assert list(tmp_path.iterdir()) == []


def test_a_changed_tool_text_makes_the_shipped_tool_warmstart_stale(monkeypatch) -> None:
    s = split_args(["demo.protocol=tool"])[0]
    before = tool_warmstart_settings(s)
    monkeypatch.setattr(td, "SYSTEM_CONTENT", "You are a terse assistant.")
    assert tool_warmstart_settings(s)["tool_text_protocol"] != before["tool_text_protocol"]
    assert json.loads((SHIPPED_TOOL / MANIFEST).read_text())["settings"] == before


TINY_TOOL = ["demo.protocol=tool", "demo.tool_n_demos=48", "demo.tool_sft_steps=2", "demo.tool_sft_batch_size=8",
             "data.max_response_length=384"]


@pytest.mark.slow
def test_tiny_tool_demo_runs_end_to_end(tmp_path: Path) -> None:
    from tests.scripts.demo.test_run_demo import tiny_args

    args = [a for a in tiny_args(tmp_path) if not a.startswith("data.max_response_length=")] + TINY_TOOL
    summary = run_demo(args)
    assert summary.protocol == "tool"
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["protocol"] == "tool"
    assert set(summary.val_em_after_by_source) == {"searchR1_demo_onehop", "searchR1_demo_twohop"}
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    assert any("critic/score/mean" in r for r in records)
    # The demo wrote the tool config the workers read, pointing at the server it started.
    config = tools.load_tool_config(tmp_path / "out" / "search_tool_config.yaml")
    assert config.search["retrieval_service_url"].startswith("http://127.0.0.1:")
    assert (tmp_path / "data" / "PROTOCOL").read_text().strip() == "tool"


def test_the_demo_shows_the_model_the_recipes_search_tool() -> None:
    recipe = tools.load_tool_config(Path(__file__).resolve().parents[3] / "example" / "tool_recipe" / "config"
                                    / "tool_config" / "search_tool_config.yaml")
    assert recipe.schemas == [td.SEARCH_TOOL_SCHEMA]
    demo = tools.parse_tool_config(td.tool_config("http://127.0.0.1:1/retrieve", 2))
    assert demo.schemas == recipe.schemas and demo.search["topk"] == 2


def test_the_start_line_names_the_tool_warmstart_and_protocol() -> None:
    from scripts.demo.run_demo import start_line

    line = start_line(split_args(["demo.protocol=tool"])[0], 12, 4, 180)
    assert "shipped warm start (example/demo_warmstart_tool, 200 SFT steps)" in line
    assert "12 GRPO steps with search (tool calls)" in line
    assert "(tool calls)" not in start_line(split_args([])[0], 12, 4, 180)
