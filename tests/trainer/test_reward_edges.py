"""The reward manager's helpers at the edges mutation testing found unpinned (docs/testing.md)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer.test_reward import SEARCH_THEN_ANSWER, _batch, _row
from verl.trainer.ppo.reward import RewardManager, em_by_data_source, load_reward_managers
from verl.utils.reward_score import FormatScoreConfig
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


VALID_WITH_SEARCH = [
    ("<think>search</think><search> capital of China </search>", True),
    ("\n\n<information>Doc 1(Title: Beijing) Beijing is the capital.</information>\n\n", False),
    ("<think>found it</think><answer> Beijing </answer>", True),
]


def test_batch_without_attention_mask_reads_real_tokens_from_padding(tok):
    data = _batch(tok, [_row(tok, VALID_WITH_SEARCH)], ["nq"], [["Beijing"]])
    data.batch.pop("attention_mask")
    cfg = FormatScoreConfig(structure_format_score=0.2, final_format_score=0.1)
    scores, breakdown = RewardManager(tok, num_examine=0, format_score_cfg=cfg)(data, return_breakdown=True)
    # The structure check saw the whole response (observation included): valid, so the full score.
    assert breakdown[0].format_valid is True and breakdown[0].em == 1 and breakdown[0].answer == "Beijing"
    assert scores.sum().item() == 1.0


def test_special_tokens_never_reach_the_scorer(tok):
    ids, mask = _row(tok, [("<think>found it</think><answer> Beijing", True)], eos=True)
    tail, tail_mask = _row(tok, [(" </answer>", True)], eos=True)
    data = _batch(tok, [(ids + tail, mask + tail_mask)], ["nq"], [["Beijing"]])
    cfg = FormatScoreConfig(structure_format_score=0.2)
    for manager in (RewardManager(tok, num_examine=0), RewardManager(tok, num_examine=0, format_score_cfg=cfg)):
        scores, breakdown = manager(data, return_breakdown=True)
        assert breakdown[0].answer == "Beijing" and breakdown[0].em == 1, breakdown
    assert breakdown[0].format_valid is True      # "</s>" after </answer> would be text outside tags


def test_format_aware_breakdown_and_final_format_score(tok):
    wrong_invalid = _row(tok, [("<answer> Paris </answer>", True)])
    no_answer = _row(tok, [("<think> no idea </think>", True)])
    data = _batch(tok, [wrong_invalid, no_answer], ["nq", "nq"], [["Beijing"], ["Beijing"]])
    cfg = FormatScoreConfig(structure_format_score=0.2, final_format_score=0.1)
    scores, breakdown = RewardManager(tok, num_examine=0, format_score_cfg=cfg)(data, return_breakdown=True)
    assert scores.sum(dim=-1).tolist() == pytest.approx([0.1, 0.0])
    assert (breakdown[0].answer, breakdown[0].em, breakdown[0].format_valid) == ("Paris", 0, False)
    assert (breakdown[1].answer, breakdown[1].em) == (None, 0)
    _, plain = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    assert (plain[1].answer, plain[1].em, plain[1].format_valid) == (None, 0, None)


def test_bad_batches_fail_naming_the_key(tok):
    data = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Beijing"]])
    manager = RewardManager(tok, num_examine=0)
    no_masks = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Beijing"]], with_loss_mask=False)
    no_masks.batch.pop("attention_mask")
    with pytest.raises(KeyError, match="RewardManager needs batch key 'loss_mask' or 'attention_mask'"):
        manager(no_masks)
    bad_shape = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Beijing"]])
    bad_shape.batch["loss_mask"] = bad_shape.batch["loss_mask"][:, :-1].clone().contiguous()
    with pytest.raises(ValueError, match=r"batch key 'loss_mask' has shape \(1, 119\), 'responses' has \(1, 120\)"):
        manager(bad_shape)
    for key in ("data_source", "reward_model"):
        broken = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Beijing"]])
        broken.non_tensor_batch.pop(key)
        with pytest.raises(KeyError, match=f"RewardManager needs non-tensor key '{key}'"):
            manager(broken)
    data.non_tensor_batch["reward_model"][0] = {"style": "rule"}
    with pytest.raises(KeyError, match="row 0: non-tensor 'reward_model' has no 'ground_truth' key"):
        manager(data)


def test_reward_managers_read_num_examine_and_score_with_the_tokenizer(tok):
    train, val = load_reward_managers(OmegaConf.create({"reward_model": {"num_examine": 0}}), tok)
    assert train.num_examine == 0 and val.num_examine == 0
    data = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Beijing"]])
    assert train(data).sum().item() == 1.0 and val(data).sum().item() == 1.0


def test_reward_metrics_and_examples_are_counted(tok, capsys):
    manager = RewardManager(tok, num_examine=2)
    assert manager.last_metrics == {}
    no_policy = _row(tok, [("\n\n<information>Doc 1 Beijing</information>\n\n", False)], eos=False)
    answered = _row(tok, SEARCH_THEN_ANSWER)
    data = _batch(tok, [no_policy, no_policy, answered], ["nq"] * 3, [["Beijing"]] * 3)
    manager(data)
    assert manager.last_metrics["reward/rows_without_policy_token"] == 2.0
    assert manager.last_metrics["reward/mean_score"] == pytest.approx(1 / 3)
    assert capsys.readouterr().out.count("[reward nq]") == 2      # num_examine examples per source, not more
