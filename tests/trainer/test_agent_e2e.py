"""End to end: a tool and an agent loop written against veRL's interfaces (the shipped examples,
example/tools/corpus_search_tool.py and example/agent_loops/search_budget_loop.py) load by their YAML
names and train through `run_ppo` (real Ray workers, FSDP on gloo, HF rollout) in both rollout modes,
beside the built-in search tool answered by a real BM25 retrieval server over HTTP. Rows of one batch run
different loops (the data's `agent_name` column); the protocol's rows also talk to the example interaction;
the reward is the tools' own (calc_reward) and the interaction's scores, read by a custom reward function
from extra_info as veRL passes them.

A tiny Qwen2 is warmed up first to call `lookup` (the user's tool) for one question and `search` (the
server) for the other, in the tool protocol's exact text, then answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import requests
import torch

from scripts.bench.toy_task import ToyPaths, toy_overrides
from tests.trainer._search_model import QUESTIONS, build_bm25_retriever, write_corpus
from tests.trainer.test_main_ppo import _finite
from verl.trainer.main_ppo import compose_config, run_ppo


@pytest.fixture(autouse=True)
def _forget_reward_files():
    """Reward files this module imports leave no module behind (another test finds its own by prefix)."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n.startswith("search_r1_custom_reward_") and n not in before]:
        del sys.modules[name]


REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "function", "function": {"name": "search", "description": "",
                                           "parameters": {"type": "object", "properties": {}}}}
LOOKUP = {"type": "function", "function": {**SCHEMA["function"], "name": "lookup"}}
# A short ChatML template that lists the tools' names and renders tool messages after the assistant's turn
# (the tiny tokenizer spends many tokens on a full JSON schema: a short prompt keeps the warm-up quick).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\ntools:' }}{%- for t in tools %}{{- ' ' + t['function']['name'] }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
# Question 0 runs the example loop and looks up with the user's tool; question 1 the protocol's loop and the server.
TOOL_OF = ("lookup", "search")
AGENT_OF = ("search_budget_agent", "")
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(extra_info["rollout_reward_scores"].values()) + sum(extra_info["turn_scores"])
'''


@dataclass(frozen=True)
class ToolWorld:
    server_url: str
    model_dir: str
    data: ToyPaths
    tool_config: str
    reward_file: str


def _prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{question}?"}]


def _warm_up(base_dir: str, tool_texts: list[str], out_dir: Path) -> str:
    """The tiny model fitted to each question's call-then-answer trajectory in the tool protocol's text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from search_r1.llm_agent.tools import ChatFraming
    from verl.utils.dataset.rl_dataset import prompt_to_text
    from verl.utils.tiny_model import save_model_and_tokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.chat_template = CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    framing = ChatFraming(tok, [SCHEMA, LOOKUP])
    demos = []
    for q, tool, text in zip(QUESTIONS, TOOL_OF, tool_texts, strict=True):
        call = "<tool_call>\n" + json.dumps({"name": tool, "arguments": {"query_list": [q.query]}}) + "\n</tool_call>"
        pieces = [(prompt_to_text(_prompt(q.question), tok, [SCHEMA, LOOKUP]), 0), (call, 1),
                  (framing.observation([text], ended_with_eos=False), 0), (f"<answer> {q.answer} </answer>", 1)]
        ids, weights = [], []
        for piece, weight in pieces:
            piece_ids = tok.encode(piece, add_special_tokens=False)
            ids += piece_ids
            weights += [weight] * len(piece_ids)
        demos.append((ids + [tok.eos_token_id], weights + [1]))
    width = max(len(ids) for ids, _ in demos)
    input_ids = torch.full((len(demos), width), tok.pad_token_id)
    weights_BT = torch.zeros((len(demos), width))
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    for row, (ids, w) in enumerate(demos):
        input_ids[row, :len(ids)], weights_BT[row, :len(w)], attention[row, :len(ids)] = (
            torch.tensor(ids), torch.tensor(w, dtype=torch.float32), 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(100):
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")
        loss = (nll * weights_BT[:, 1:]).sum() / weights_BT[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return str(save_model_and_tokenizer(model.eval(), tok, out_dir))


@pytest.fixture(scope="module")
def tool_world(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ToolWorld]:
    from search_r1.search.retrieval_server import create_app
    from search_r1.search.serving import serve_in_background
    from verl.tools.utils.tool_registry import initialize_tools_from_config

    root = tmp_path_factory.mktemp("tool_world")
    corpus = write_corpus(root / "corpus.jsonl")
    retriever = build_bm25_retriever(corpus, root / "index")
    with serve_in_background(create_app(retriever)) as url:
        config = {"tools": [
            {"class_name": "verl.tools.search_tool.SearchTool", "config": {"retrieval_service_url": f"{url}/retrieve",
                                                                           "topk": 1}, "tool_schema": SCHEMA},
            {"class_name": f"{REPO / 'example/tools/corpus_search_tool.py'}:CorpusSearchTool",
             "config": {"type": "native", "corpus_path": str(corpus), "topk": 1}, "tool_schema": LOOKUP}]}
        (root / "tools.yaml").write_text(json.dumps(config))
        tools = {t.name: t for t in initialize_tools_from_config(root / "tools.yaml")}
        texts = [asyncio.run(tools[name].execute("warm-up", {"query_list": [q.query]}))[0].text
                 for q, name in zip(QUESTIONS, TOOL_OF, strict=True)]
        model_dir = _warm_up(tiny_model_dir, texts, root / "model")
        rows = [{"data_source": "searchR1_nq", "prompt": _prompt(q.question), "ability": "fact-reasoning",
                 "reward_model": {"style": "rule", "ground_truth": {"target": [q.answer]}}, "agent_name": agent,
                 "extra_info": {"index": i, "tools_kwargs": {"lookup": {"create_kwargs": {
                     "ground_truth": {"target": [q.answer]}}}},
                                **({} if agent else {"interaction_kwargs": {"name": "retry",
                                                                            "ground_truth": [q.answer]}})}}
                for i, (q, agent) in enumerate(zip(QUESTIONS, AGENT_OF, strict=True))]
        data = ToyPaths(str(root / "train.parquet"), str(root / "val.parquet"))
        pd.DataFrame(rows).to_parquet(data.train)
        pd.DataFrame(rows).to_parquet(data.val)
        (root / "reward.py").write_text(REWARD)
        yield ToolWorld(url, model_dir, data, str(root / "tools.yaml"), str(root / "reward.py"))


def _served(url: str) -> int:
    counters = requests.get(f"{url}/health", timeout=10).json()["counters"]
    return int(counters["cache_hits"] + counters["cache_misses"])


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_user_tool_and_agent_loop_train_through_run_ppo(ray_cluster, tool_world: ToolWorld, tmp_path: Path,
                                                          mode: str) -> None:
    overrides = toy_overrides(tool_world.model_dir, tool_world.data, str(tmp_path / "ckpt"), batch_size=2,
                              n_agent=2, response_length=200, n_workers=1) + [
        "do_search=true", "actor_rollout_ref.actor.state_masking=true", f"actor_rollout_ref.rollout.mode={mode}",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_world.tool_config}",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=1000",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={REPO / 'example/agent_loops/agent_loops.yaml'}",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path="
        f"{REPO / 'example/interactions/interaction_config.yaml'}",
        "data.max_prompt_length=128", "data.max_obs_length=200", "actor_rollout_ref.rollout.temperature=0.5",
        f"custom_reward_function.path={tool_world.reward_file}", "reward_model.reward_manager=naive"]
    before = _served(tool_world.server_url)
    history = run_ppo(compose_config(overrides))
    step = history[-1]
    assert step["env/agent_loop/search_budget_agent/rows"] == 2 and step["env/agent_loop/tool_agent/rows"] == 2
    assert step["env/row_errors"] == 0
    # the user's tool ran in the loop rows (found the answer: calc_reward 1), the server answered the others
    assert step["tools/search/calls"] > 0 and _served(tool_world.server_url) > before
    assert step["critic/score/max"] >= 1.0           # a found answer's calc_reward reached the reward
    assert step["env/interaction_turns"] >= 2        # the interaction answered each protocol row's answer
    for prefix in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/"):
        _finite(step, prefix)
    assert step["state_tokens/total"] > 0 and 0.0 < step["state_tokens/coverage"] < 1.0
