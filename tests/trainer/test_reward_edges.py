"""The reward manager's helpers at the edges mutation testing found unpinned (docs/testing.md)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer.test_reward import SEARCH_THEN_ANSWER, _batch, _row
from verl.trainer.ppo.reward import em_by_data_source, load_reward_managers
from verl.utils.tiny_model import train_bpe_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def test_em_by_data_source_refuses_scores_for_another_batch(tok):
    data = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)] * 2, ["nq", "hotpotqa"], [["Beijing"]] * 2)
    with pytest.raises(ValueError):
        em_by_data_source(data, torch.ones(3, 5))     # 3 rows of scores for 2 rows of sources


def test_reward_managers_from_a_config_without_reward_model_use_plain_em(tok):
    train, val = load_reward_managers(OmegaConf.create({"trainer": {}}), tok)
    assert train.format_score_cfg is None and val.format_score_cfg is None
    assert train.num_examine == 1 and val.num_examine == 1
