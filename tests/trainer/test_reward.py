"""Reward manager: answers come from policy tokens only, and the score sits on the last policy token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.reward import RewardManager, em_by_data_source, load_reward_managers
from verl.utils.reward_score import FormatScoreConfig
from verl.utils.tiny_model import train_bpe_tokenizer

INVALID_NOTICE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
R = 120


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def _row(tok, segments: list[tuple[str, bool]], eos: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and loss mask for (text, written_by_policy) segments; EOS is a policy token."""
    ids, mask = [], []
    for text, is_policy in segments:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(is_policy)] * len(piece)
    if eos:
        ids.append(tok.eos_token_id)
        mask.append(1)
    return ids, mask


def _batch(tok, rows, sources, answers, with_loss_mask=True, prompt="Question: who?") -> DataProto:
    responses = torch.full((len(rows), R), tok.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), R), dtype=torch.long)
    response_attention = torch.zeros((len(rows), R), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        assert len(ids) <= R
        responses[i, :len(ids)] = torch.tensor(ids)
        loss_mask[i, :len(ids)] = torch.tensor(mask)
        response_attention[i, :len(ids)] = 1
    prompt_ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]] * len(rows))
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([torch.ones_like(prompt_ids), response_attention], dim=1),
    }
    if with_loss_mask:
        tensors["loss_mask"] = loss_mask
    non_tensors = {
        "data_source": np.array(sources, dtype=object),
        "reward_model": np.array([{"style": "rule", "ground_truth": {"target": np.array(a, dtype=object)}}
                                  for a in answers], dtype=object),
    }
    return DataProto.from_dict(tensors, non_tensors)


SEARCH_THEN_ANSWER = [
    ("<think>I should search</think><search> the author </search>", True),
    ("\n\n<information>Doc 1(Title: Paris) Paris is the capital. <answer> Paris </answer></information>\n\n", False),
    ("<think>found it</think><answer> Beijing </answer>", True),
]


def test_score_sits_on_last_policy_token(tok):
    rows = [_row(tok, SEARCH_THEN_ANSWER)]
    data = _batch(tok, rows, ["nq"], [["Beijing"]])
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    last_policy = len(rows[0][0]) - 1  # the EOS the policy emitted
    assert scores[0, last_policy].item() == 1.0
    assert scores.sum().item() == 1.0
    assert breakdown[0].answer == "Beijing" and breakdown[0].em == 1 and breakdown[0].format_valid is None


def test_retrieved_answer_is_never_scored(tok):
    # The observation holds "<answer> Paris </answer>"; the policy answered Beijing.
    data = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["nq"], [["Paris"]])
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    assert scores.sum().item() == 0.0
    assert breakdown[0].answer == "Beijing"


def test_prompt_example_answer_is_never_scored(tok):
    prompt = "For example, <answer> Beijing </answer>. Question: where?"
    rows = [_row(tok, [("<think>no idea</think>", True)])]
    data = _batch(tok, rows, ["nq"], [["Beijing"]], prompt=prompt)
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    assert scores.sum().item() == 0.0 and breakdown[0].answer is None


def test_invalid_action_notice_word_and_is_never_extracted(tok):
    rows = [_row(tok, [("<think>hmm</think> maybe", True), (INVALID_NOTICE, False), ("<think>ok</think>", True)])]
    data = _batch(tok, rows, ["nq"], [["and"]])
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    assert breakdown[0].answer is None
    assert scores.sum().item() == 0.0
    # Without the loss mask (fallback: every response token), the notice's "and" WOULD be extracted.
    unmasked = _batch(tok, rows, ["nq"], [["and"]], with_loss_mask=False)
    _, fallback = RewardManager(tok, num_examine=0)(unmasked, return_breakdown=True)
    assert fallback[0].answer == "and"


def test_several_answers_last_policy_answer_counts(tok):
    rows = [_row(tok, [("<think>a</think><answer> Paris </answer>", True), (INVALID_NOTICE, False),
                       ("<think>b</think><answer> Beijing </answer>", True)])]
    data = _batch(tok, rows, ["nq"], [["Paris"]])
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    assert breakdown[0].answer == "Beijing"
    assert scores.sum().item() == 0.0


def test_row_without_policy_tokens_scores_zero_and_is_counted(tok):
    rows = [_row(tok, [("<think>x</think>", False)], eos=False), _row(tok, SEARCH_THEN_ANSWER)]
    data = _batch(tok, rows, ["nq", "nq"], [["x"], ["Beijing"]])
    manager = RewardManager(tok, num_examine=0)
    scores = manager(data)
    assert scores[0].abs().sum().item() == 0.0 and scores[1].sum().item() == 1.0
    assert manager.last_metrics["reward/rows_without_policy_token"] == 1.0


def test_format_aware_reward_uses_full_response_for_structure(tok):
    cfg = FormatScoreConfig(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)
    correct = _row(tok, SEARCH_THEN_ANSWER)
    wrong = _row(tok, SEARCH_THEN_ANSWER[:2] + [("<think>found it</think><answer> Rome </answer>", True)])
    data = _batch(tok, [correct, wrong], ["nq", "nq"], [["Beijing"], ["Paris"]])
    scores, breakdown = RewardManager(tok, num_examine=0, format_score_cfg=cfg)(data, return_breakdown=True)
    assert [b.format_valid for b in breakdown] == [True, True]
    # correct + valid -> 1.0 ; wrong + valid, "Paris" retrieved -> 0.2 + 0.1 (one fp32 add: a few
    # ulps, within approx's rel=1e-6 on any CPU; the exact == elsewhere compare placed 0/1 scores)
    assert scores.sum(dim=-1).tolist() == pytest.approx([1.0, 0.3])


def test_unknown_data_source_fails_naming_it(tok):
    data = _batch(tok, [_row(tok, SEARCH_THEN_ANSWER)], ["squad_v9"], [["Beijing"]])
    with pytest.raises(ValueError, match="squad_v9"):
        RewardManager(tok, num_examine=0)(data)


def test_em_by_data_source_and_examples_printed_per_source(tok, capsys):
    rows = [_row(tok, SEARCH_THEN_ANSWER)] * 3
    data = _batch(tok, rows, ["nq", "nq", "hotpotqa"], [["Beijing"], ["Rome"], ["Beijing"]])
    scores = RewardManager(tok, num_examine=1)(data)
    assert em_by_data_source(data, scores) == {"hotpotqa": 1.0, "nq": 0.5}
    printed = capsys.readouterr().out
    assert printed.count("[reward nq]") == 1 and printed.count("[reward hotpotqa]") == 1


def test_reward_managers_from_trainer_config(tok):
    cfg = OmegaConf.load("verl/trainer/config/ppo_trainer.yaml")
    train, val = load_reward_managers(cfg, tok)
    assert train.format_score_cfg is None and val.format_score_cfg is None
    cfg.reward_model.structure_format_score = 0.2
    train, val = load_reward_managers(cfg, tok)
    assert train.format_score_cfg.structure_format_score == 0.2 and val.format_score_cfg is None
