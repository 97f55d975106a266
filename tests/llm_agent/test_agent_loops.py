"""Agent loops written against veRL's interface (verl.experimental.agent_loop) run rows of a batch beside the
protocol's own loop, in sync mode (the driver, requests batched per round) and async mode (a worker's
engine): their tokens, masks and rewards become the rows; a loop that fails is its row's counted error."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.agent_loops import AgentLoopGenerationManager, run_worker_shard
from search_r1.llm_agent.generation import LLMGenerationManager
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_tool_protocol import (
    SYSTEM,
    response_of,
    tool_batch,
    tool_gen_config,
    tool_prompt_ids,
)
from tests.llm_agent.test_user_tools import call_text, write_tool
from verl.utils import batch_keys as K

# An agent loop file as a veRL user writes it (veRL's imports only): at most two tool rounds, the tools
# loaded from the run's tool config, each tool message rendered by the chat template on its own.
LOOKUP_LOOP = '''
import json
import re
from uuid import uuid4

from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.tools.utils.tool_registry import initialize_tools_from_config
from verl.utils.profiler import simple_timer

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@register("lookup_agent")
class LookupLoop(AgentLoopBase):
    def __init__(self, *args, max_rounds=2, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_rounds = max_rounds
        path = self.config.actor_rollout_ref.rollout.multi_turn.tool_config_path
        self.tools = {tool.name: tool for tool in initialize_tools_from_config(path)}
        self.schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in self.tools.values()]

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]), tools=self.schemas)
        ids, mask, rewards, turns, metrics = [], [], [], 1, {}
        request_id = uuid4().hex
        for _ in range(self.max_rounds + 1):
            with simple_timer("generate_sequences", metrics):
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + ids,
                                                         sampling_params=sampling_params)
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            turns += 1
            calls = CALL.findall(self.tokenizer.decode(out.token_ids))
            if not calls:
                break
            call = json.loads(calls[0])
            tool = self.tools[call["name"]]
            instance_id, _ = await tool.create(create_kwargs=kwargs["tools_kwargs"].get(call["name"], {}))
            response, reward, _ = await tool.execute(instance_id, call["arguments"])
            await tool.release(instance_id)
            rewards.append(reward)
            observation = await self.apply_chat_template([{"role": "tool", "content": response.text}],
                                                         remove_system_prompt=True)
            ids += observation
            mask += [0] * len(observation)
            turns += 1
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids, response_mask=mask, num_turns=turns,
                               metrics=metrics, reward_score=0.25, extra_fields={"tool_rewards": rewards, "note": "mine"})


class Broken(AgentLoopBase):
    def __init__(self, *args, mode="raise", **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = mode

    async def run(self, sampling_params, **kwargs):
        if self.mode == "raise":
            raise ZeroDivisionError("no")
        if self.mode == "mask":
            return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 2])
        return {"prompt_ids": [1]}
'''

LOOPS_YAML = """\
- name: lookup_one_round
  _target_: loops.py:LookupLoop
  max_rounds: 1
- name: raising
  _target_: loops.py:Broken
- name: bad_mask
  _target_: loops.py:Broken
  mode: mask
- name: not_an_output
  _target_: loops.py:Broken
  mode: dict
"""


def setup_loops(tmp_path, retrieval_url):
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    (tmp_path / "loops.py").write_text(LOOKUP_LOOP)
    (tmp_path / "loops.yaml").write_text(LOOPS_YAML)
    trainer = {"actor_rollout_ref": {"rollout": {"multi_turn": {"tool_config_path": str(tmp_path / "tools.yaml")}}},
               "data": {}}
    return config, dict(agent_loop_config_path=str(tmp_path / "loops.yaml"), trainer_config=trainer)


def scripts(tok):
    eos = tok.eos_token_id
    answer = encode(tok, "<answer> Paris </answer>") + [eos]
    lookup = encode(tok, call_text(("capital", {"country": "France"})))
    return {key: [lookup, answer] for key in ("q1", "q2", "q3", "q4")}


def fields_batch(tok, config, keys, names):
    gen_batch, prompts = tool_batch(tok, keys, config.schemas)
    raw = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Answer. Question: {k}?"}] for k in keys]
    gen_batch.non_tensor_batch.update({
        K.RAW_PROMPT: np.array(raw + [None], dtype=object)[:-1],
        K.AGENT_NAME: np.array(names, dtype=object),
        K.EXTRA_INFO: np.array([{"index": i} for i in range(len(keys))], dtype=object)})
    return gen_batch, prompts


def test_a_loop_of_your_own_runs_beside_the_protocols_loop_in_sync_mode(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config, agent = setup_loops(tmp_path, retrieval_url)
    gen = tool_gen_config(config, max_tool_response_length=None, **agent)
    engine = ScriptedRollout(tok, scripts(tok))
    gen_batch, prompts = fields_batch(tok, config, ["q1", "q2", "q3"], ["lookup_agent", "tool_agent", "lookup_agent"])
    out = AgentLoopGenerationManager(tok, engine, gen).run_llm_loop(gen_batch, prompts)

    # the protocol's row is what the protocol's own rollout makes of it
    alone = LLMGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen).run_llm_loop(
        *tool_batch(tok, ["q2"], config.schemas))
    assert response_of(out, 1) == response_of(alone, 0)
    # the loop's row: its call, the tool's message (masked, rendered by the chat template alone), its answer
    ids, mask = response_of(out, 0)
    observation = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
    assert observation == ("<|im_start|>user\n<tool_response>\nThe capital of France is Paris.\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")
    policy = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 1])
    assert policy.endswith("<answer> Paris </answer><|im_end|>")
    assert response_of(out, 2) == (ids, mask)
    # the loop's prompt is its own rendering of raw_prompt (here the dataset's, token for token)
    n_prompt = out.batch[K.PROMPTS].shape[1]
    assert out.batch[K.INPUT_IDS][0, n_prompt - len(tool_prompt_ids(tok, "q1", config.schemas)):n_prompt].tolist() == \
        tool_prompt_ids(tok, "q1", config.schemas)
    assert out.non_tensor_batch[K.ROLLOUT_REWARD_SCORE].tolist() == [0.25, None, 0.25]
    assert out.non_tensor_batch[K.TOOL_REWARDS][0] == [-0.1] and out.non_tensor_batch[K.NUM_TURNS][0] == 4
    assert out.non_tensor_batch[K.AGENT_EXTRA_FIELDS][0] == {"note": "mine"}
    assert out.meta_info["stop_reasons"][actions.AGENT_LOOP] == 2 and out.meta_info["stop_reasons"]["answered"] == 1
    assert out.meta_info["row_errors"] == 0
    # the loop rows' requests went out together, one engine call a round (the protocol row's apart: its stop string)
    loop_calls = [c for c in engine.calls if not c["meta_info"][K.META_STOP]]
    assert [len(c["contexts"]) for c in loop_calls] == [2, 2]


def test_the_same_loops_in_a_workers_async_shard(tool_tokenizer, retrieval_url, tmp_path):
    from tests.llm_agent.test_rollout_behaviours import ScriptedStepEngine

    tok = tool_tokenizer
    config, agent = setup_loops(tmp_path, retrieval_url)
    gen = tool_gen_config(config, max_tool_response_length=None, mode="async", **agent)
    sync_gen = tool_gen_config(config, max_tool_response_length=None, **agent)
    gen_batch, prompts = fields_batch(tok, config, ["q1", "q2", "q4"], ["lookup_agent", "tool_agent", "lookup_one_round"])
    sync_out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), sync_gen).run_llm_loop(gen_batch,
                                                                                                          prompts)
    step_engine = ScriptedStepEngine(tok, scripts(tok), gen)
    seen_meta: list[dict] = []

    def engine_for(meta):
        seen_meta.append(meta)
        return step_engine

    fields = [{k: v[i] for k, v in gen_batch.non_tensor_batch.items()} for i in range(3)]
    rows, stats, _ = run_worker_shard(tok, gen, engine_for, {K.META_STOP: list(gen.stop)},
                                      [tool_prompt_ids(tok, k, config.schemas) for k in ("q1", "q2", "q4")], 5,
                                      frozenset({tok.eos_token_id}), fields)
    assert seen_meta[0][K.META_STOP] == []        # the engine runs without the protocol's stop strings
    for i, row in enumerate(rows):
        assert row.response() == response_of(sync_out, i), f"row {i}"
    assert [row.agent_name for row in rows] == ["lookup_agent", "tool_agent", "lookup_one_round"]
    assert sum(stats, start=Counter())["agent_loop/lookup_agent/rows"] == 1
    # requests sample with seeds derived from (call, row, request) when the loop gives none
    from search_r1.llm_agent.async_generation import request_seed

    assert (tool_prompt_ids(tok, "q1", config.schemas), request_seed(5, 0, 0)) in step_engine.requests


def test_a_failing_loop_is_its_rows_counted_error(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config, agent = setup_loops(tmp_path, retrieval_url)
    gen = tool_gen_config(config, max_tool_response_length=None, **agent)
    names = ["raising", "bad_mask", "not_an_output", "tool_agent"]
    gen_batch, prompts = fields_batch(tok, config, ["q1", "q2", "q3", "q4"], names)
    out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen).run_llm_loop(gen_batch, prompts)
    assert out.meta_info["row_errors"] == 3
    assert out.meta_info["row_error_types"] == {"TypeError": 1, "ValueError": 1, "ZeroDivisionError": 1}
    width = out.batch[K.PROMPTS].shape[1]
    assert out.batch[K.ATTENTION_MASK][:3, width:].sum() == 0            # no response for the failed rows
    assert torch.equal(out.batch[K.PROMPTS][:, -prompts.shape[1]:], prompts)   # their prompts kept
    assert response_of(out, 3)[1].count(1) > 0 and out.meta_info["stop_reasons"]["answered"] == 1


def test_unknown_and_other_protocol_loops_are_refused(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config, agent = setup_loops(tmp_path, retrieval_url)
    gen = tool_gen_config(config, **agent)
    for name, message in (("nobody", r"agent loop 'nobody' is not registered; registered: \[.*'lookup_agent'"),
                          ("search_r1_agent", r"'search_r1_agent' runs the tags protocol, this run the tool")):
        gen_batch, prompts = fields_batch(tok, config, ["q1"], [name])
        with pytest.raises(ValueError, match=message):
            AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen).run_llm_loop(gen_batch, prompts)


def test_verls_built_in_names_are_registered():
    from verl.experimental.agent_loop import registered_agent_loops

    assert {"single_turn_agent", "tool_agent", "search_r1_agent"} <= set(registered_agent_loops())
    assert json.loads(json.dumps(registered_agent_loops()))
