from __future__ import annotations

import re

from search_r1.llm_agent import actions
from search_r1.llm_agent.actions import Action, parse_action, render_observation
from search_r1.search.schema import Hit


def test_parse_action_takes_first_complete_action():
    text = "<think> hmm </think><search> capital of France </search> then <answer> Paris </answer>"
    action = parse_action(text)
    assert action == Action("search", "capital of France", text.index("</search>") + len("</search>"))


def test_parse_action_skips_unclosed_tag_for_a_later_complete_one():
    assert parse_action("<search> unfinished <answer> Rome </answer>") == Action(
        "answer", "Rome", len("<search> unfinished <answer> Rome </answer>"))


def test_parse_action_requires_matching_close_tag():
    assert parse_action("<search> q </answer>").kind == "invalid"
    assert parse_action("no tags at all").kind == "invalid"


def test_empty_search_query_is_invalid():
    assert parse_action("<search>   </search>").kind == "invalid"


def test_render_observation_matches_original_format():
    hits = [Hit.from_contents("0", '"Paris"\nParis is big.', 1.0), Hit.from_contents("1", '"Rome"\nOld city.', 0.5)]
    assert render_observation(hits) == (
        "\n\n<information>Doc 1(Title: Paris) Paris is big.\nDoc 2(Title: Rome) Old city.\n</information>\n\n")


def test_invalid_notice_has_no_extractable_answer_word():
    for notice in (actions.INVALID_ACTION_NOTICE, actions.SEARCH_BUDGET_NOTICE, actions.SEARCH_FAILED_TEXT):
        for content in re.findall(r"<answer>(.*?)</answer>", notice, re.DOTALL):
            assert not re.search(r"\w", content), notice


def test_stop_rules_name_their_reason():
    search, answer, invalid = Action("search", "q", 5), Action("answer", "a", 5), Action("invalid", "")
    assert actions.stop_if_answered(answer) == actions.ANSWERED
    assert actions.stop_if_answered(search) is None
    assert actions.stop_if_eos(invalid, emitted_eos=True) == actions.EOS
    assert actions.stop_if_eos(invalid, emitted_eos=False) is None
    assert actions.stop_if_final_turn(search, is_final_turn=True) == actions.MAX_TURNS
    assert actions.stop_if_final_turn(invalid, is_final_turn=True) == actions.INVALID_ACTION
    assert actions.stop_if_final_turn(search, is_final_turn=False) is None
    assert actions.stop_if_context_full(90, 20, 100) == actions.CONTEXT_FULL
    assert actions.stop_if_context_full(80, 20, 100) is None
    assert actions.stop_if_context_full(10**6, 20, None) is None
