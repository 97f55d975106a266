"""The search_r1_like reward (veRL's reproduction) against hand-checked cases, and through the reward manager."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.ppo.reward import RewardManager
from verl.utils.reward_score import (
    SEARCH_R1_LIKE_DATA_SOURCES,
    SUPPORTED_DATA_SOURCES,
    TAG_DATA_SOURCES,
    FormatScoreConfig,
    get_scorer,
    qa_em,
    search_r1_like_qa_em,
    validate_data_sources,
)
from verl.utils.tiny_model import train_bpe_tokenizer

score_of = search_r1_like_qa_em.compute_score
subem_of = search_r1_like_qa_em.compute_score_subem
GT = {"target": ["Paris", "City of Light"]}


def test_correct_answer_scores_one_and_wrong_answer_the_format_score():
    assert score_of("<think>hmm</think><answer> Paris </answer>", GT) == 1.0
    assert score_of("<answer>Lyon</answer>", GT) == 0.0
    assert score_of("<answer>Lyon</answer>", GT, format_score=0.2) == 0.2
    assert score_of("<answer>Paris</answer>", GT, score=2.0) == 2.0


def test_no_answer_scores_zero_even_with_a_format_score():
    assert score_of("<think>Paris</think> Paris", GT, format_score=0.2) == 0.0
    assert score_of("<answer>Paris", GT, format_score=0.2) == 0.0  # never closed
    assert subem_of("Paris", GT, format_score=0.2) == 0.0


def test_the_last_of_several_answers_is_scored():
    assert score_of("<answer>Lyon</answer> no wait <answer>Paris</answer>", GT) == 1.0
    assert score_of("<answer>Paris</answer> no wait <answer>Lyon</answer>", GT) == 0.0


def test_more_than_ten_answer_tags_quarter_a_correct_score():
    ten = "<answer>x</answer>" * 9 + "<answer>Paris</answer>"
    assert score_of(ten, GT) == 1.0  # 10 of each: no penalty
    eleven = "<answer>x</answer>" * 10 + "<answer>Paris</answer>"
    assert score_of(eleven, GT) == 0.25
    # opening and closing tags are counted separately: 11 stray closers alone trigger it
    assert score_of("</answer>" * 11 + "<answer>Paris</answer>", GT) == 0.25
    assert score_of("<answer>Paris</answer>" + " <answer>" * 10, GT) == 0.25  # 11 opening, 1 closing
    # a wrong answer keeps its format score, unquartered
    assert score_of("<answer>x</answer>" * 11, GT, format_score=0.2) == 0.2
    # substring EM has no tag penalty (as in the reproduction)
    assert subem_of(eleven, GT) == 1.0


def test_normalisation_ignores_articles_punctuation_and_case():
    assert score_of("<answer>the CITY of light!</answer>", GT) == 1.0
    assert score_of("<answer> An  apple. </answer>", {"target": ["apple"]}) == 1.0
    assert score_of("<answer>Paris, France</answer>", GT) == 0.0
    assert subem_of("<answer>Paris, France</answer>", GT) == 1.0


@pytest.mark.parametrize("ground_truth", [
    {"target": ["Lyon", "Paris"]},
    {"target": np.array(["Lyon", "Paris"], dtype=object)},  # what a parquet row reads back as
    {"target": "Paris"},
    "Paris",
])
def test_ground_truth_as_list_array_or_string(ground_truth):
    assert score_of("<answer>paris</answer>", ground_truth) == 1.0
    assert score_of("<answer>Rome</answer>", ground_truth) == 0.0
    assert subem_of("<answer>paris texas</answer>", ground_truth) == 1.0


def test_ground_truth_without_target_key_names_the_key():
    with pytest.raises(KeyError, match="target"):
        score_of("<answer>Paris</answer>", {"answers": ["Paris"]})


def test_searchR1_sources_get_the_search_r1_like_scorer():
    for source in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
                   "demo_onehop", "demo_twohop"):
        assert get_scorer("searchR1_" + source) is search_r1_like_qa_em.compute_score
        assert get_scorer(source) is qa_em.compute_score_em
    assert SEARCH_R1_LIKE_DATA_SOURCES == {"searchR1_" + s for s in TAG_DATA_SOURCES}
    assert SUPPORTED_DATA_SOURCES == TAG_DATA_SOURCES | SEARCH_R1_LIKE_DATA_SOURCES
    validate_data_sources(["searchR1_nq", "nq"])
    with pytest.raises(ValueError, match="searchR1_squad"):
        validate_data_sources(["searchR1_squad"])


def test_format_aware_reward_is_refused_for_searchR1_sources_saying_what_to_set():
    with pytest.raises(ValueError, match="structure_format_score"):
        get_scorer("searchR1_nq", format_aware=True)


# --- through the reward manager: policy text only, and the breakdown ---------------------------

R = 320


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def _batch(tok, rows: list[list[tuple[str, bool]]], source: str, answers: list[str]) -> DataProto:
    responses = torch.full((len(rows), R), tok.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), R), dtype=torch.long)
    attention = torch.zeros((len(rows), R), dtype=torch.long)
    for i, segments in enumerate(rows):
        ids: list[int] = []
        mask: list[int] = []
        for text, is_policy in segments:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(is_policy)] * len(piece)
        ids.append(tok.eos_token_id)
        mask.append(1)
        assert len(ids) <= R
        responses[i, :len(ids)] = torch.tensor(ids)
        loss_mask[i, :len(ids)] = torch.tensor(mask)
        attention[i, :len(ids)] = 1
    prompt = torch.tensor([tok("Question: where?", add_special_tokens=False)["input_ids"]] * len(rows))
    tensors = {"prompts": prompt, "responses": responses, "input_ids": torch.cat([prompt, responses], dim=1),
               "attention_mask": torch.cat([torch.ones_like(prompt), attention], dim=1), "loss_mask": loss_mask}
    reward_model = np.array([{"style": "rule", "ground_truth": {"target": np.array([a], dtype=object)}}
                             for a in answers], dtype=object)
    return DataProto.from_dict(tensors, {"data_source": np.array([source] * len(rows), dtype=object),
                                         "reward_model": reward_model})


TOOL_CALL = ('<think>search</think>\n<tool_call>\n{"name": "search", "arguments": {"query_list": ["q"]}}'
             "\n</tool_call>")
# A tool response that holds answer tags: masked, so neither extracted nor counted.
TOOL_RESPONSE = ("\n<tool_response>\n" + "<answer> Rome </answer>" * 11 + "\n</tool_response>\n", False)


def test_reward_manager_scores_searchR1_rows_from_policy_text_with_the_breakdown(tok):
    correct = [(TOOL_CALL, True), TOOL_RESPONSE, ("<answer> Paris </answer>", True)]
    spammed = [(TOOL_CALL, True), TOOL_RESPONSE, ("<answer>x</answer>" * 10 + "<answer> Paris </answer>", True)]
    data = _batch(tok, [correct, spammed], "searchR1_nq", ["Paris", "Paris"])
    scores, breakdown = RewardManager(tok, num_examine=0)(data, return_breakdown=True)
    # The tool response's 11 Rome answers would make row 0 wrong (last answer) or quartered: it scores 1.
    assert scores.sum(dim=-1).tolist() == [1.0, 0.25]
    assert [(b.answer, b.em, b.format_valid) for b in breakdown] == [("Paris", 1, None), ("Paris", 1, None)]


def test_reward_manager_with_format_weights_refuses_searchR1_rows(tok):
    data = _batch(tok, [[("<answer> Paris </answer>", True)]], "searchR1_hotpotqa", ["Paris"])
    manager = RewardManager(tok, num_examine=0, format_score_cfg=FormatScoreConfig(structure_format_score=0.2))
    with pytest.raises(ValueError, match="searchR1_hotpotqa"):
        manager(data)
