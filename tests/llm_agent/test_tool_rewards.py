"""Tool step rewards (BaseTool.execute's second value) and calc_reward reach the reward function as veRL
passes them (extra_info's tool_rewards / rollout_reward_scores / num_turns) and, through it, the advantages:
two rows that answer alike get the same rule reward and zero GRPO advantages, their tool rewards do not."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from search_r1.llm_agent import tools
from tests.llm_agent.test_user_tools import INFOS, run_sync, scripts_for, write_tool
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts
from verl.utils import batch_keys as K
from verl.workers.reward_manager import build_reward_managers


@pytest.fixture(autouse=True)
def _forget_reward_files():
    """Reward files this module imports leave no module behind (another test finds its own by prefix)."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n.startswith("search_r1_custom_reward_") and n not in before]:
        del sys.modules[name]


TOOL_REWARD_ONLY = '''
SEEN = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    SEEN.append(dict(extra_info))
    return sum(extra_info.get("tool_rewards", [])) + sum(extra_info.get("rollout_reward_scores", {}).values())
'''


def rolled_out_group(tok, retrieval_url, tmp_path) -> DataProto:
    """Both rows answer Paris (same rule reward); their tools rewarded them differently."""
    config = tools.load_tool_config(write_tool(tmp_path, retrieval_url))
    out, _, _ = run_sync(tok, config, scripts_for(tok), ["q1", "q2"], INFOS)
    out.non_tensor_batch.update({
        K.DATA_SOURCE: np.array(["nq", "nq"], dtype=object),
        K.REWARD_MODEL: np.array([{"ground_truth": {"target": ["Paris"]}}] * 2, dtype=object),
        K.EXTRA_INFO: np.array(INFOS, dtype=object),
        K.UID: np.array(["group", "group"], dtype=object)})
    out.batch[K.RESPONSE_MASK] = out.batch[K.LOSS_MASK]
    return out


def grpo_advantages(batch: DataProto) -> torch.Tensor:
    advantages_BR, _ = core_algos.compute_advantage("grpo", batch.batch[K.TOKEN_LEVEL_SCORES],
                                                    batch.batch[K.RESPONSE_MASK], index=batch.non_tensor_batch[K.UID])
    return advantages_BR


def test_step_rewards_reach_the_reward_function_and_move_the_advantages(tool_tokenizer, retrieval_url, tmp_path):
    tok = tool_tokenizer
    batch = rolled_out_group(tok, retrieval_url, tmp_path)
    assert list(batch.non_tensor_batch[K.TOOL_REWARDS]) == [[0.5, -0.1], [-0.1]]
    assert list(batch.non_tensor_batch[K.REWARD_SCORES]) == [{"capital": 1.0}, {"capital": 0.0}]
    assert list(batch.non_tensor_batch[K.NUM_TURNS]) == [4, 4]      # 2 policy turns, 1 tool round, + 1

    rule, _ = build_reward_managers(OmegaConf.create({"reward_model": {}}), tok)
    score_rollouts(rule, batch, OverlongBuffer(), 400)
    assert batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 1.0]   # both answered Paris
    assert torch.count_nonzero(grpo_advantages(batch)) == 0

    (tmp_path / "reward.py").write_text(TOOL_REWARD_ONLY)
    custom, _ = build_reward_managers(OmegaConf.create(
        {"reward_model": {}, "custom_reward_function": {"path": str(tmp_path / "reward.py"), "name": "compute_score"}}),
        tok)
    score_rollouts(custom, batch, OverlongBuffer(), 400)
    assert batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() == pytest.approx([1.4, -0.1])
    advantages_BR = grpo_advantages(batch)
    mask = batch.batch[K.RESPONSE_MASK].bool()
    assert (advantages_BR[0][mask[0]] > 0).all() and (advantages_BR[1][mask[1]] < 0).all()
    seen = __import__("sys").modules[custom.compute_score.__module__].SEEN
    assert seen[0]["tool_rewards"] == [0.5, -0.1] and seen[0]["rollout_reward_scores"] == {"capital": 1.0}
    assert seen[0]["num_turns"] == 4 and seen[0]["tools_kwargs"] == INFOS[0]["tools_kwargs"]   # extra_info kept
    assert "tool_rewards" not in batch.non_tensor_batch[K.EXTRA_INFO][0]                     # a copy, not changed


def test_default_compute_score_is_the_built_in_rule():
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("nq", "<answer> Paris </answer>", {"target": ["Paris"]}) == 1.0
    assert default_compute_score("searchR1_nq", "<answer> Rome </answer>", {"target": ["Paris"]}) == 0.0


def test_an_agent_loops_own_reward_score_replaces_the_reward_functions(tool_tokenizer, retrieval_url, tmp_path):
    from scripts.bench.rollout import ScriptedRollout
    from search_r1.llm_agent.agent_loops import AgentLoopGenerationManager
    from tests.llm_agent.test_agent_loops import fields_batch, scripts, setup_loops
    from tests.llm_agent.test_tool_protocol import tool_gen_config

    tok = tool_tokenizer
    config, agent = setup_loops(tmp_path, retrieval_url)
    gen = tool_gen_config(config, max_tool_response_length=None, **agent)
    out = AgentLoopGenerationManager(tok, ScriptedRollout(tok, scripts(tok)), gen).run_llm_loop(
        *fields_batch(tok, config, ["q1", "q2"], ["lookup_agent", "tool_agent"]))   # the loop's reward_score: 0.25
    out.non_tensor_batch.update({K.DATA_SOURCE: np.array(["nq", "nq"], dtype=object),
                                 K.REWARD_MODEL: np.array([{"ground_truth": {"target": ["Paris"]}}] * 2, dtype=object)})
    out.batch[K.RESPONSE_MASK] = out.batch[K.LOSS_MASK]
    rule, _ = build_reward_managers(OmegaConf.create({"reward_model": {}}), tok)
    score_rollouts(rule, out, OverlongBuffer(), 400)
    scores_BR = out.batch[K.TOKEN_LEVEL_SCORES]
    assert scores_BR.sum(-1).tolist() == [0.25, 1.0]       # both answered Paris; the loop's row scored itself
    last = int(out.batch[K.RESPONSE_MASK][0].nonzero().max())
    assert scores_BR[0, last] == 0.25
