"""Search-R1 v0.3 format-aware reward: structure check, retrieval check, every scoring rule."""

from __future__ import annotations

import pytest

from verl.utils.reward_score import qa_em_format as fmt

GT = {"target": ["Lyon"]}
W = dict(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)

VALID = ("<think>who?</think><search>birthplace of Ann</search>\n\n"
         "<information>Doc 1(Title: Ann) Ann was born in Lyon.\n</information>\n\n"
         "<think>found it</think><answer>{answer}</answer>")
POLICY_OF_VALID = "<think>who?</think><search>birthplace of Ann</search>\n<think>found it</think><answer>{answer}</answer>"


def test_valid_structures():
    assert fmt.is_valid_sequence("<think>easy</think>\n<answer>Lyon</answer>")
    assert fmt.is_valid_sequence(VALID.format(answer="Lyon"))


@pytest.mark.parametrize("text", [
    "<answer>Lyon</answer>",                                              # no think first
    "<think>a</think><think>b</think><answer>x</answer>",                 # think twice in a row
    "<think>a</think><search>q</search><answer>x</answer>",               # search without information
    "<think>a</think> stray words <answer>x</answer>",                    # text between tags
    "<think>a</think><answer>x",                                           # unbalanced
    "<think>a</think><search>q</search><information>d</information><answer>x</answer>",  # no think after info
])
def test_invalid_structures(text):
    assert not fmt.is_valid_sequence(text)
    assert fmt.sequence_format_error(text)


def test_retrieval_correct_reads_only_information_blocks():
    assert fmt.is_retrieval_correct(VALID.format(answer="x"), ["lyon"])
    assert not fmt.is_retrieval_correct("<think>Lyon</think><answer>Lyon</answer>", ["Lyon"])


def test_rule_correct_answer_valid_format_gets_full_score():
    assert fmt.compute_score_em(POLICY_OF_VALID.format(answer="Lyon"), GT, **W,
                                response_str=VALID.format(answer="Lyon")) == 1.0


def test_rule_correct_answer_invalid_format_loses_structure_score():
    # 1.0 - 0.2 = 0.8 (Python floats, one or two IEEE double ops: identical on every CPU; approx
    # only because 1.0 - 0.2 is not exactly 0.8 in binary)
    assert fmt.compute_score_em("<answer>Lyon</answer>", GT, **W) == pytest.approx(0.8)


def test_rule_wrong_answer_valid_format_gets_structure_plus_retrieval():
    # the information block holds "Lyon": 0.2 + 0.1
    assert fmt.compute_score_em(POLICY_OF_VALID.format(answer="Paris"), GT, **W,
                                response_str=VALID.format(answer="Paris")) == pytest.approx(0.3)
    no_hit = "<think>x</think><answer>Paris</answer>"
    assert fmt.compute_score_em(no_hit, GT, **W) == pytest.approx(0.2)


def test_rule_wrong_answer_invalid_format():
    assert fmt.compute_score_em("<answer>Paris</answer>", GT, **W) == pytest.approx(0.1)
    assert fmt.compute_score_em("<think>no answer</think>", GT, **W) == 0.0


def test_answer_is_taken_from_policy_text_not_from_response():
    # The full response holds a correct-looking answer inside an observation; the policy never wrote it.
    # Tags inside <information> are opaque, so the format stays valid: wrong + valid + retrieved = 0.2 + 0.1.
    response = VALID.format(answer="Paris").replace("Ann was born", "<answer>Lyon</answer> Ann was born")
    assert fmt.is_valid_sequence(response)
    assert fmt.compute_score_em(POLICY_OF_VALID.format(answer="Paris"), GT, **W,
                                response_str=response) == pytest.approx(0.3)


def test_invalid_action_notice_outside_information_breaks_format():
    notice = "\nMy previous action is invalid. Put the answer between <answer> and </answer>.\n"
    assert not fmt.is_valid_sequence("<think>a</think> oops" + notice + "<think>b</think><answer>x</answer>")
