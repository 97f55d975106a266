"""Exact-match reward: normalisation, extraction of the policy's last answer, scoring."""

from __future__ import annotations

import numpy as np
import pytest

from verl.utils.reward_score import SUPPORTED_DATA_SOURCES, get_scorer, qa_em, validate_data_sources


def test_normalisation_drops_case_punctuation_articles_and_spaces():
    assert qa_em.normalize_answer("  The  Eiffel-Tower!  ") == "eiffeltower"
    assert qa_em.normalize_answer("An apple, a pear") == "apple pear"
    assert qa_em.em_check("the Beijing.", ["beijing"]) == 1
    assert qa_em.em_check("Beijing city", ["beijing"]) == 0
    assert qa_em.subem_check("Beijing city", ["beijing"]) == 1


def test_extract_solution_takes_the_last_answer():
    text = "<think>x</think><answer> Paris </answer> hmm <answer>Lyon</answer>"
    assert qa_em.extract_solution(text) == "Lyon"
    assert qa_em.extract_solution("<answer>\nmulti\nline </answer>") == "multi\nline"
    assert qa_em.extract_solution("<think>no answer</think>") is None
    assert qa_em.extract_solution("<answer>unclosed") is None


@pytest.mark.parametrize("target", [["Lyon", "Lyons"], np.array(["Lyon", "Lyons"], dtype=object), "Lyon"])
def test_ground_truth_as_list_array_or_string(target):
    ground_truth = target if isinstance(target, str) else {"target": target}
    assert qa_em.compute_score_em("<answer>lyon</answer>", ground_truth) == 1.0
    assert qa_em.compute_score_em("<answer>Paris</answer>", ground_truth, format_score=0.1) == 0.1
    assert qa_em.compute_score_em("no tags at all: Lyon", ground_truth, format_score=0.1) == 0.0


def test_subem_score_accepts_contained_answer():
    gt = {"target": ["Lyon"]}
    assert qa_em.compute_score_subem("<answer>the city of Lyon</answer>", gt) == 1.0
    assert qa_em.compute_score_em("<answer>the city of Lyon</answer>", gt) == 0.0


def test_ground_truth_without_target_names_the_key():
    with pytest.raises(KeyError, match="target"):
        qa_em.compute_score_em("<answer>x</answer>", {"answers": ["x"]})


def test_unknown_data_source_is_named():
    with pytest.raises(ValueError, match="squad2"):
        get_scorer("squad2")
    with pytest.raises(ValueError, match="mystery"):
        validate_data_sources(["nq", "mystery", "demo"])
    validate_data_sources(["nq", "demo_twohop"])
    assert {"nq", "hotpotqa", "bamboogle", "demo", "demo_onehop"} <= SUPPORTED_DATA_SOURCES
    assert get_scorer("nq") is qa_em.compute_score_em
