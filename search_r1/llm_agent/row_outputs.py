"""What a finished trajectory leaves on its batch row besides tokens and masks: its tools' step rewards
and calc_reward, an interaction's scores, its turn count (veRL's `tool_rewards`, `reward_scores`,
`turn_scores`, `__num_turns__`), and an agent loop's own `reward_score` and `extra_fields`. The reward
managers pass them to a custom reward function in its `extra_info` (verl/workers/reward_manager/
managers.py), as veRL's reward loop does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from search_r1.llm_agent.trajectory import _Row
from verl.utils import batch_keys as K


def object_column(values: Sequence[Any]) -> np.ndarray:
    """A (B,) object array holding `values` as they are (a list per row stays a list, never a 2-D array)."""
    column = np.empty(len(values), dtype=object)
    column[:] = list(values)
    return column


def num_turns(row: _Row) -> int:
    """veRL's `__num_turns__`: the policy's turns, the environment's turns (observations appended), plus one
    (an agent loop's own count when it gave one)."""
    if row.reported_turns is not None:
        return int(row.reported_turns)
    return row.n_turns + sum(1 for _, obs in row.turns if obs) + 1


def row_outputs(rows: Sequence[_Row]) -> dict[str, np.ndarray]:
    """The per-row non-tensors of a rollout (batch_keys: TOOL_REWARDS, REWARD_SCORES, TURN_SCORES, NUM_TURNS)."""
    return {
        K.TOOL_REWARDS: object_column([list(row.tool_rewards) for row in rows]),
        K.REWARD_SCORES: object_column([dict(row.reward_scores) for row in rows]),
        K.TURN_SCORES: object_column([list(row.turn_scores) for row in rows]),
        K.NUM_TURNS: np.array([num_turns(row) for row in rows], dtype=np.int64),
        K.ROLLOUT_REWARD_SCORE: object_column([row.reward_score for row in rows]),
        K.AGENT_EXTRA_FIELDS: object_column([dict(row.extra_fields) for row in rows]),
    }


def attach_row_outputs(output: Any, rows: Sequence[_Row]) -> None:
    """Add `row_outputs(rows)` to a composed rollout batch (a DataProto of len(rows) rows)."""
    if len(output) != len(rows):
        raise ValueError(f"a rollout of {len(rows)} rows composed a batch of {len(output)}")
    output.non_tensor_batch.update(row_outputs(rows))


__all__ = ["attach_row_outputs", "num_turns", "object_column", "row_outputs"]
