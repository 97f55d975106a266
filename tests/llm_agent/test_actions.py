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


def test_render_observation_is_byte_identical_to_the_original():
    # The original: title = contents.split("\\n")[0] as stored (quotes kept), text = the rest joined by
    # "\\n", f"Doc {i}(Title: {title}) {text}\\n" per hit, then strip() inside <information>.
    hits = [Hit.from_contents("0", '"Paris"\nParis is big.\nAnd old.', 1.0),
            Hit.from_contents("1", "Rome\nOld city.", 0.5),
            Hit.from_contents("2", "no title line", 0.1)]
    assert render_observation(hits) == (
        '\n\n<information>Doc 1(Title: "Paris") Paris is big.\nAnd old.\n'
        "Doc 2(Title: Rome) Old city.\nDoc 3(Title: no title line)</information>\n\n")
    assert hits[0].title == "Paris"          # the parsed title (rerankers, logs) loses its quotes


def test_invalid_action_notice_is_the_originals_text():
    # DESIGN §3.3, verbatim. The reward never reads it (tests/trainer/test_reward.py).
    assert actions.INVALID_ACTION_NOTICE == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n")


def test_our_own_notices_have_no_extractable_answer_word():
    for notice in (actions.SEARCH_BUDGET_NOTICE, actions.SEARCH_FAILED_TEXT):
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
