"""An interaction written against veRL's interface (the shipped example, a user who says "wrong, try again"
once) answers a tool-protocol row's turns without calls: its reply is a user message, masked like an
observation, the model gets another turn, and its scores reach the reward function and the advantages."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import tools
from search_r1.llm_agent.agent_loops import AgentLoopGenerationManager, run_worker_shard
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_tool_protocol import (
    SYSTEM,
    response_of,
    tool_batch,
    tool_gen_config,
    tool_prompt_ids,
)
from tests.llm_agent.test_user_tools import write_tool
from verl.utils import batch_keys as K


@pytest.fixture(autouse=True)
def _forget_reward_files():
    """Reward files this module imports leave no module behind (another test finds its own by prefix)."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n.startswith("search_r1_custom_reward_") and n not in before]:
        del sys.modules[name]


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
INTERACTIONS = REPO / "example" / "interactions" / "interaction_config.yaml"
TURN_SCORES_ONLY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return sum(extra_info["turn_scores"])
'''


def scripts(tok):
    eos = tok.eos_token_id
    wrong, right = encode(tok, "<answer> Rome </answer>") + [eos], encode(tok, "<answer> Paris </answer>") + [eos]
    return {"q1": [wrong, right], "q2": [wrong, wrong], "q3": [right]}


def batch(tok, config, keys):
    gen_batch, prompts = tool_batch(tok, keys, config.schemas)
    retry = {"name": "retry", "ground_truth": {"target": ["Paris"]}}
    gen_batch.non_tensor_batch.update({
        K.RAW_PROMPT: np.array([[{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Answer. Question: {k}?"}] for k in keys] + [None],
                               dtype=object)[:-1],
        K.EXTRA_INFO: np.array([{"interaction_kwargs": retry} if k != "q3" else {} for k in keys], dtype=object)})
    return gen_batch, prompts


def gen_config(config, **overrides):
    return tool_gen_config(config, interaction_config_path=str(INTERACTIONS), max_tool_response_length=None,
                           **overrides)


def test_a_wrong_answer_gets_one_retry_masked_and_scored(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen_config(config)).run_llm_loop(
        *batch(tok, config, ["q1", "q2", "q3"]))
    ids, mask = response_of(out, 0)
    user = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
    assert user == "\n<|im_start|>user\nThat is wrong, try again.<|im_end|>\n<|im_start|>assistant\n"
    policy = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 1])
    assert policy == "<answer> Rome </answer><|im_end|><answer> Paris </answer><|im_end|>"
    assert list(out.non_tensor_batch[K.TURN_SCORES]) == [[0.0, 1.0], [0.0, 0.0], []]
    # q2 was wrong twice: one retry, then the row ends on the second wrong answer (no reply appended)
    assert response_of(out, 1)[1].count(0) == len(encode(tok, user)) and out.meta_info["turns_stats"] == [2, 2, 1]
    assert out.meta_info["stop_reasons"]["answered"] == 3 and out.meta_info["row_errors"] == 0


def test_the_same_in_a_workers_async_shard(tool_tokenizer, retrieval_url, tmp_path):
    from tests.llm_agent.test_rollout_behaviours import ScriptedStepEngine

    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    gen_batch, prompts = batch(tok, config, ["q1", "q3"])
    sync = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen_config(config)).run_llm_loop(
        gen_batch, prompts)
    gen = gen_config(config, mode="async")
    fields = [{k: v[i] for k, v in gen_batch.non_tensor_batch.items()} for i in range(2)]
    rows, _, _ = run_worker_shard(tok, gen, lambda meta: ScriptedStepEngine(tok, scripts(tok), gen), {},
                                  [tool_prompt_ids(tok, k, config.schemas) for k in ("q1", "q3")], 1,
                                  frozenset({tok.eos_token_id}), fields)
    assert [row.response() for row in rows] == [response_of(sync, i) for i in range(2)]
    assert rows[0].turn_scores == [0.0, 1.0]
    assert [m["role"] for m in rows[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[0].messages[-2:] == [{"role": "user", "content": "That is wrong, try again."},
                                     {"role": "assistant", "content": "<answer> Paris </answer>"}]


def test_interaction_scores_reach_the_reward_and_the_advantages(tool_tokenizer, retrieval_url, tmp_path):
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts
    from verl.workers.reward_manager import build_reward_managers

    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen_config(config)).run_llm_loop(
        *batch(tok, config, ["q1", "q2"]))
    out.non_tensor_batch.update({K.DATA_SOURCE: np.array(["nq"] * 2, dtype=object),
                                 K.REWARD_MODEL: np.array([{"ground_truth": {"target": ["Paris"]}}] * 2, dtype=object),
                                 K.UID: np.array(["g", "g"], dtype=object)})
    out.batch[K.RESPONSE_MASK] = out.batch[K.LOSS_MASK]
    (tmp_path / "reward.py").write_text(TURN_SCORES_ONLY)
    reward, _ = build_reward_managers(OmegaConf.create(
        {"reward_model": {}, "custom_reward_function": {"path": str(tmp_path / "reward.py")}}), tok)
    score_rollouts(reward, out, OverlongBuffer(), 400)
    assert out.batch[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 0.0]
    advantages_BR, _ = core_algos.compute_advantage("grpo", out.batch[K.TOKEN_LEVEL_SCORES],
                                                    out.batch[K.RESPONSE_MASK], index=out.non_tensor_batch[K.UID])
    mask = out.batch[K.RESPONSE_MASK].bool()
    assert (advantages_BR[0][mask[0]] > 0).all() and (advantages_BR[1][mask[1]] < 0).all()
    assert torch.count_nonzero(advantages_BR[~mask]) == 0    # the user's message is never a step


def test_an_unknown_interaction_is_the_rows_error(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    gen_batch, prompts = batch(tok, config, ["q1", "q3"])
    gen_batch.non_tensor_batch[K.EXTRA_INFO][0] = {"interaction_kwargs": {"name": "nobody"}}
    out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen_config(config)).run_llm_loop(
        gen_batch, prompts)
    assert out.meta_info["row_error_types"] == {"ValueError": 1}
    assert response_of(out, 1)[1].count(1) > 0


def test_the_interaction_registry_names_and_refuses(tmp_path):
    from verl.interactions.utils.interaction_registry import initialize_interactions_from_config

    found = initialize_interactions_from_config(INTERACTIONS)
    assert list(found) == ["retry"] and found["retry"].name == "retry"
    (tmp_path / "i.yaml").write_text("interaction:\n  - class_name: collections.OrderedDict\n")
    with pytest.raises(ValueError, match=r"interaction\[0\].class_name: 'collections.OrderedDict' is not a "
                                         r"verl.interactions.base.BaseInteraction"):
        initialize_interactions_from_config(tmp_path / "i.yaml")
