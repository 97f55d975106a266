"""Reward rules at the edges mutation testing found unpinned (docs/testing.md): the substring-EM
variants, the retrieval check's negatives, the format-aware rule's default weights, and what the
errors for bad ground truth and bad reward settings say."""

from __future__ import annotations

import pytest

from verl.utils.reward_score import FormatScoreConfig, get_scorer, qa_em, search_r1_like_qa_em
from verl.utils.reward_score import qa_em_format as fmt

GT = {"target": ["Lyon"]}


@pytest.mark.parametrize("compute", [qa_em.compute_score_subem, search_r1_like_qa_em.compute_score_subem])
def test_substring_em_scores_contained_answers_and_nothing_else(compute):
    assert compute("<answer>the city of Lyon, France</answer>", GT) == 1.0
    assert compute("<answer>Paris</answer>", GT) == 0.0                      # wrong: format_score, 0 by default
    assert compute("<answer>Paris</answer>", GT, format_score=0.25) == 0.25
    assert compute("I think it is Lyon", GT) == 0.0                          # no answer at all
    assert compute("<answer>Lyon</answer>", GT, score=2.0) == 2.0


def test_search_r1_like_substring_em_has_no_tag_penalty():
    spam = "<answer>x</answer>" * 12 + "<answer>Lyon</answer>"
    assert search_r1_like_qa_em.compute_score_subem(spam, GT) == 1.0
    assert search_r1_like_qa_em.compute_score(spam, GT) == 0.25


def test_retrieval_check_is_false_when_no_block_holds_an_answer():
    text = ("<think>q</think><search>x</search>\n\n<information>Doc 1 Paris is in France, by the sea.</information>"
            "\n\n<think>t</think><answer>Paris</answer>")
    assert not fmt.is_retrieval_correct(text, ["Lyon"])
    # A bare string is one answer, not its characters (each of which the block contains).
    assert not fmt.is_retrieval_correct(text, "sap")
    assert fmt.is_retrieval_correct(text, "paris")
    # An answer that normalises to nothing matches no block.
    assert not fmt.is_retrieval_correct(text, ["the", "Lyon"])


def test_format_aware_rule_weights_default_to_zero():
    valid_wrong = ("<think>who?</think><search>q</search>\n\n<information>Doc 1 born in Lyon.</information>\n\n"
                   "<think>t</think><answer>Paris</answer>")
    assert fmt.is_valid_sequence(valid_wrong)
    assert fmt.compute_score_em(valid_wrong, GT) == 0.0                       # structure + retrieval weights 0
    assert fmt.compute_score_em("<answer>Lyon</answer>", GT) == 1.0          # invalid format, right answer
    assert fmt.compute_score_em("<answer>Paris</answer>", GT) == 0.0         # invalid format, wrong answer
    assert fmt.compute_score_em("<answer>Paris</answer>", GT, final_format_score=0.1) == 0.1


def test_missing_format_weights_read_as_zero():
    assert FormatScoreConfig.from_config({}) == FormatScoreConfig(0.0, 0.0, 0.0, 0.0)
    assert FormatScoreConfig.from_config({"retrieval_score": None, "final_format_score": 0.3}) == \
        FormatScoreConfig(final_format_score=0.3)


def test_bad_ground_truth_errors_name_the_offending_type():
    with pytest.raises(TypeError, match=r"^ground_truth must be a dict with 'target' or a str, got int$"):
        qa_em.golden_answers_of(5)
    with pytest.raises(TypeError, match=r"^golden answer #1 is int, expected str: 7$"):
        qa_em.golden_answers_of({"target": ["Lyon", 7]})


def test_tool_format_source_with_format_weights_error_says_what_to_set():
    with pytest.raises(ValueError) as err:
        get_scorer("searchR1_nq", format_aware=True)
    message = str(err.value)
    assert "has no format-aware variant; set reward_model.structure_format_score, final_format_score and " \
           "retrieval_score to 0 for tool-format data (the v0.3 format reward checks <search> tags)" in message
    assert message.endswith("<search> tags)")


def test_format_error_quotes_the_first_40_characters_of_stray_text():
    stray = "x" * 60
    error = fmt.sequence_format_error(f"<think>a</think> {stray} <answer>b</answer>")
    assert error is not None and error.endswith(repr("x" * 40))
