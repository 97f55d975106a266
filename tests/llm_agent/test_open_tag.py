"""The tag protocol's second tag, `<open> doc_id </open>` (GenerationConfig.open_tag; trainer key
open_tag.enable): parsing and rendering, the config, and the manager (sync and async) against a
scripted engine and the project's BM25 server over HTTP (its POST /open)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import requests
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from search_r1.llm_agent import actions
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.search.client import RetrievalClient
from search_r1.search.documents import Page, paginate, render_page
from search_r1.search.schema import Hit
from tests.conftest import free_port, serving
from tests.llm_agent.helpers import CORPUS, encode
from tests.llm_agent.test_generation import make_config, response_of, run
from tests.llm_agent.test_rollout_behaviours import run_async
from verl.trainer.ppo.metric_utils import compute_env_metrics
from verl.utils import batch_keys as K

# --- actions: parsing and rendering -------------------------------------------------------------


def test_open_is_an_action_only_with_the_open_tag():
    text = "<think> read it </think><open> 3 </open>"
    assert actions.parse_action(text) == actions.Action(kind="invalid", content="")
    assert actions.parse_action(text, open_tag=True) == actions.Action(kind="open", content="3", end=len(text))
    assert not actions.has_complete_action(text) and actions.has_complete_action(text, open_tag=True)


@pytest.mark.parametrize("text, kind, content", [
    ("<search> a </search><open>1</open>", "search", "a"),     # the first complete action wins
    ("<open>1</open><search> a </search>", "open", "1"),
    ("<open>1</open><answer> x </answer>", "open", "1"),
    ("<answer> x </answer><open>1</open>", "answer", "x"),
    ("<open> 1 </search>", "invalid", ""),                      # a tag closes with its own name
    ("<open>   </open>", "invalid", ""),                         # no doc id
    ("<open> 1", "invalid", ""),                                 # not closed
])
def test_first_complete_action_of_any_kind_wins(text, kind, content):
    action = actions.parse_action(text, open_tag=True)
    assert (action.kind, action.content) == (kind, content)


@pytest.mark.parametrize("content, expected", [
    ("3", ("3", 1)), ("3 page 2", ("3", 2)), ("3, page 2", ("3", 2)), ("3 Page 12", ("3", 12)),
    ("doc-7 page 0", ("doc-7", 0)),          # passed on: the server refuses the page, the policy reads why
    ("page 3", ("page 3", 1)),               # no id before it: the whole text is the id
    ("wiki 12", ("wiki 12", 1)),
])
def test_parse_open_reads_the_id_and_an_optional_page(content, expected):
    assert actions.parse_open(content) == expected


def test_search_results_show_doc_ids_only_with_the_open_tag():
    hits = [Hit.from_contents("17", '"Paris"\nParis is a city.', 1.0),
            Hit.from_contents("4", "no title line", 0.5)]
    assert actions.render_passages(hits) == 'Doc 1(Title: "Paris") Paris is a city.\nDoc 2(Title: no title line) \n'
    assert actions.render_passages(hits, show_doc_ids=True) == (
        'Doc 1(Title: "Paris") [doc_id: 17] Paris is a city.\nDoc 2(Title: no title line) [doc_id: 4] \n')
    assert actions.render_observation(hits, True) == (
        '\n\n<information>Doc 1(Title: "Paris") [doc_id: 17] Paris is a city.\n'
        'Doc 2(Title: no title line) [doc_id: 4]</information>\n\n')


def test_open_observations_use_the_information_framing():
    page = Page(text="Some text.", page=1, num_pages=2)
    assert actions.render_open_page("Paris", page, "17") == (
        "\n\n<information>Paris\n[doc 17, page 1 of 2 (open page 2 for more)]\nSome text.</information>\n\n")
    assert actions.render_open_unknown("no document with id '9'") == (
        "\n\n<information>The document could not be opened: no document with id '9'.</information>\n\n")
    assert actions.render_open_failure() == f"\n\n<information>{actions.OPEN_FAILED_TEXT}</information>\n\n"


def test_the_notice_with_open_adds_one_sentence_to_the_original():
    original, with_open = actions.INVALID_ACTION_NOTICE, actions.INVALID_ACTION_NOTICE_WITH_OPEN
    sentence = "If I want to read a document from the search results, I should put its doc_id between <open> and </open>. "
    assert with_open.replace(sentence, "") == original
    assert actions.OPEN_BUDGET_NOTICE.startswith("\n") and actions.OPEN_BUDGET_NOTICE.endswith("\n")


def test_an_open_in_the_final_turn_ends_the_row_as_max_turns():
    assert actions.stop_if_final_turn(actions.Action(kind="open", content="1"), True) == actions.MAX_TURNS
    assert actions.stop_if_final_turn(actions.Action(kind="open", content="1"), False) is None


# --- the config -----------------------------------------------------------------------------------


def test_config_off_keeps_the_original_stop_strings_and_on_adds_close_open():
    assert make_config("http://x/retrieve").stop == ("</search>", "</answer>")
    assert make_config("http://x/retrieve", open_tag=True).stop == ("</search>", "</answer>", "</open>")
    # an engine asked not to stop at actions (stop=()) is not given one; the manager cuts by position
    assert make_config("http://x/retrieve", open_tag=True, stop=()).stop == ()
    # the config travels to async rollout workers as a dict: rebuilt there, the same (no second </open>)
    on = make_config("http://x/retrieve", open_tag=True)
    assert GenerationConfig(**dataclasses.asdict(on)) == on


@pytest.mark.parametrize("overrides, named", [
    ({"max_opens": 0}, "open_tag.max_opens"),
    ({"open_page_size": 0}, "open_tag.page_size"),
    ({"open_page_size": 10**6}, "open_tag.page_size"),
    ({"serve_app": "app"}, "retriever.serve=ray"),
])
def test_bad_open_settings_are_refused_naming_the_key(overrides, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        make_config("http://x/retrieve", open_tag=True, **overrides)


def test_open_tag_with_the_tool_protocol_is_refused():
    with pytest.raises(ValueError, match=r"open_tag\.enable.*tool config"):
        make_config("http://x/retrieve", open_tag=True, protocol="tool", tool_config={"tools": []},
                    max_total_response_length=128)


# --- the manager against the BM25 server ------------------------------------------------------------


def _streams(tokenizer) -> dict[str, list[int]]:
    enc = lambda s: encode(tokenizer, s)  # noqa: E731
    return {
        "search": enc("<think> look </think><search> Eiffel Tower </search>"),
        "open1": enc("<think> read </think><open> 1 </open>"),
        "open1p2": enc("<think> next </think><open> 1 page 2 </open>"),
        "open99": enc("<think> guess </think><open> 99 </open>"),
        "tail": enc("\n\n<information>made up</information>"),
        "answer": enc("<think> done </think><answer> 1889 </answer>"),
        "bad": enc("<think> hmm </think> nothing"),
        "eos": [tokenizer.eos_token_id],
    }


def _obs_ids(tokenizer, text: str) -> list[int]:
    """An observation as the manager tokenizes it: body, then the closing tag, each once."""
    close = actions.INFORMATION_CLOSE
    return encode(tokenizer, text[: -len(close)]) + encode(tokenizer, close)


def _page(doc_id: str, page: int, page_size: int) -> tuple[str, Page]:
    contents = next(c["contents"] for c in CORPUS if c["id"] == doc_id)
    hit = Hit.from_contents(doc_id, contents, 0.0)
    return hit.title, paginate(hit.text, page, page_size)


def _layout(out, row: int) -> list[tuple[int, int]]:
    ids, mask = response_of(out, row)
    return list(zip(ids, mask, strict=True))


def _expected(*parts: tuple[list[int], int]) -> list[tuple[int, int]]:
    return [(tok, m) for ids, m in parts for tok in ids]


def test_search_open_answer_layout_masks_and_metrics(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    scripts = {"q1": [s["search"] + s["tail"], s["open1"] + s["tail"], s["open1p2"], s["answer"] + s["eos"]]}
    config = make_config(retrieval_url, open_tag=True, open_page_size=200)
    out, engine, _, _ = run(tokenizer, scripts, ["q1"], config)

    hits = RetrievalClient(retrieval_url, topk=2).retrieve(["Eiffel Tower"])[0]
    search_obs = actions.render_observation(hits, show_doc_ids=True)
    assert "[doc_id: 1]" in search_obs                     # the id the policy then opens
    title, page1 = _page("1", 1, 200)
    _, page2 = _page("1", 2, 200)
    open_obs1 = actions.render_open_page(title, page1, "1")
    open_obs2 = actions.render_open_page(title, page2, "1")
    assert "[doc 1, page 1 of 3 (open page 2 for more)]" in open_obs1 and "page 2 of 3" in open_obs2
    assert _layout(out, 0) == _expected(
        (s["search"], 1), (_obs_ids(tokenizer, search_obs), 0),
        (s["open1"], 1), (_obs_ids(tokenizer, open_obs1), 0),
        (s["open1p2"], 1), (_obs_ids(tokenizer, open_obs2), 0),
        (s["answer"], 1))
    # info_mask (prompt + response) agrees with loss_mask on the response
    prompt_width = out.batch[K.PROMPTS].shape[1]
    assert out.batch[K.INFO_MASK][0, prompt_width:].tolist() == out.batch[K.LOSS_MASK][0].tolist()
    assert engine.calls[0]["meta_info"][K.META_STOP] == ["</search>", "</answer>", "</open>"]
    meta = out.meta_info
    assert meta["valid_search_stats"] == [1] and meta["valid_open_stats"] == [2]
    assert meta["valid_action_stats"] == [4] and meta["stop_reasons"][actions.ANSWERED] == 1
    assert (meta["open_not_found"], meta["open_failures"], meta["search_failures"]) == (0, 0, 0)
    metrics = compute_env_metrics(meta)
    assert metrics["env/number_of_valid_open"] == 2.0 and metrics["env/number_of_valid_search"] == 1.0
    assert metrics["env/open_not_found"] == 0.0 and metrics["env/open_failures"] == 0.0


def test_the_open_observation_is_cut_to_max_obs_length_keeping_the_close(tokenizer):
    """Opens go through the manager's one observation path: cut to max_obs_length, `</information>` kept."""
    bound = len(encode(tokenizer, actions.INVALID_ACTION_NOTICE_WITH_OPEN))   # the smallest the manager takes
    manager = LLMGenerationManager(tokenizer, None, make_config("http://x/retrieve", open_tag=True,
                                                                max_obs_length=bound))
    text = actions.render_open_page("Paris", paginate("Paris is the capital of France. " * 40, 1, 1000), "0")
    assert len(_obs_ids(tokenizer, text)) > bound
    ids, truncated = manager._observation_ids(text)
    close = encode(tokenizer, actions.INFORMATION_CLOSE)
    assert truncated and len(ids) == bound and ids[-len(close):] == close
    assert ids[: -len(close)] == _obs_ids(tokenizer, text)[: bound - len(close)]


def test_an_unknown_id_is_an_observation_and_the_row_goes_on(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    config = make_config(retrieval_url, open_tag=True)
    out, _, _, _ = run(tokenizer, {"q1": [s["open99"], s["answer"]]}, ["q1"], config)
    unknown = actions.render_open_unknown("no document with id '99'")
    assert _layout(out, 0) == _expected((s["open99"], 1), (_obs_ids(tokenizer, unknown), 0), (s["answer"], 1))
    meta = out.meta_info
    assert meta["open_not_found"] == 1 and meta["open_failures"] == 0
    assert meta["valid_open_stats"] == [1] and meta["valid_action_stats"] == [2]   # a valid action, not an invalid one
    assert compute_env_metrics(meta)["env/open_not_found"] == 1.0


def test_opens_past_max_opens_get_the_budget_notice_and_the_row_goes_on(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    config = make_config(retrieval_url, open_tag=True, max_opens=1, max_turns=4)
    out, _, _, _ = run(tokenizer, {"q1": [s["open1"], s["open1"], s["answer"]]}, ["q1"], config)
    title, page = _page("1", 1, config.open_page_size)
    notice = encode(tokenizer, actions.OPEN_BUDGET_NOTICE)
    assert _layout(out, 0) == _expected(
        (s["open1"], 1), (_obs_ids(tokenizer, actions.render_open_page(title, page, "1")), 0),
        (s["open1"], 1), (notice, 0), (s["answer"], 1))
    assert out.meta_info["valid_open_stats"] == [1] and out.meta_info["stop_reasons"][actions.ANSWERED] == 1


def test_an_open_in_the_final_turn_is_not_run_and_ends_the_row(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    config = make_config(retrieval_url, open_tag=True, max_turns=1)
    out, engine, _, _ = run(tokenizer, {"q1": [s["search"], s["open1"]]}, ["q1"], config)
    ids, mask = response_of(out, 0)
    notice = encode(tokenizer, actions.OPEN_BUDGET_NOTICE)
    assert ids[-len(notice):] == notice and mask[-len(notice):] == [0] * len(notice)
    assert ids[-len(notice) - len(s["open1"]): -len(notice)] == s["open1"]
    assert out.meta_info["stop_reasons"][actions.MAX_TURNS] == 1 and out.meta_info["valid_open_stats"] == [0]
    assert len(engine.calls) == 2


def test_the_invalid_action_notice_mentions_open_only_when_on(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    scripts = {"q1": [s["bad"], s["answer"]]}
    on, _, _, _ = run(tokenizer, scripts, ["q1"], make_config(retrieval_url, open_tag=True))
    off, _, _, _ = run(tokenizer, scripts, ["q1"], make_config(retrieval_url))
    for out, notice in ((on, actions.INVALID_ACTION_NOTICE_WITH_OPEN), (off, actions.INVALID_ACTION_NOTICE)):
        assert _layout(out, 0) == _expected((s["bad"], 1), (encode(tokenizer, notice), 0), (s["answer"], 1))


def test_with_the_tag_off_an_open_is_an_invalid_action_and_the_output_is_the_originals(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    scripts = {"q1": [s["open1"] + s["bad"], s["search"], s["answer"]]}   # not stopped at </open> when off
    out, engine, _, _ = run(tokenizer, scripts, ["q1"], make_config(retrieval_url))
    hits = RetrievalClient(retrieval_url, topk=2).retrieve(["Eiffel Tower"])[0]
    original_obs = actions.render_observation(hits)
    assert "doc_id" not in original_obs
    assert _layout(out, 0) == _expected(
        (s["open1"] + s["bad"], 1), (encode(tokenizer, actions.INVALID_ACTION_NOTICE), 0),
        (s["search"], 1), (_obs_ids(tokenizer, original_obs), 0), (s["answer"], 1))
    assert engine.calls[0]["meta_info"][K.META_STOP] == ["</search>", "</answer>"]
    assert not {"valid_open_stats", "open_not_found", "open_failures"} & set(out.meta_info)
    assert "env/number_of_valid_open" not in compute_env_metrics(out.meta_info)


def test_a_server_that_does_not_answer_an_open_is_counted(tokenizer):
    s = _streams(tokenizer)
    config = make_config(f"http://127.0.0.1:{free_port()}/retrieve", open_tag=True, retrieval_timeout=2.0)
    out, _, _, _ = run(tokenizer, {"q1": [s["open1"], s["answer"]]}, ["q1"], config)
    assert _layout(out, 0) == _expected(
        (s["open1"], 1), (_obs_ids(tokenizer, actions.render_open_failure()), 0), (s["answer"], 1))
    assert out.meta_info["open_failures"] == 1 and compute_env_metrics(out.meta_info)["env/open_failures"] == 1.0


def test_the_open_page_is_the_servers_and_the_tool_protocols_text(retrieval_url):
    """The tag's observation body is what the tool protocol's open tool renders (one renderer)."""
    from search_r1.llm_agent.tool_backends import OpenTool

    tool = OpenTool("open", {"retrieval_service_url": retrieval_url, "page_size": 200})
    title, page = tool.read_doc("2", 1)
    answer = requests.post(retrieval_url.removesuffix("/retrieve") + "/open",
                           json={"doc_id": "2", "page": 1, "page_size": 200}, timeout=5).json()
    assert (title, page.text, page.num_pages) == (answer["title"], answer["text"], answer["num_pages"])
    assert tool.call({"doc_id": "2"}).startswith('{"result": "Berlin')
    assert actions.render_open_page(title, page, "2") == (
        actions.INFORMATION_OPEN + render_page(title, page, "doc 2") + actions.INFORMATION_CLOSE)


def test_the_manager_checks_the_notices_fit_max_obs_length(tokenizer):
    """The longer notice (with <open>) must fit when the tag is on; off, the original's bound holds."""
    bound = len(encode(tokenizer, actions.INVALID_ACTION_NOTICE))
    assert len(encode(tokenizer, actions.INVALID_ACTION_NOTICE_WITH_OPEN)) > bound
    LLMGenerationManager(tokenizer, None, make_config("http://x/retrieve", max_obs_length=bound))
    with pytest.raises(ValueError, match=rf"max_obs_length \({bound}\) is shorter than the invalid-action notice"):
        LLMGenerationManager(tokenizer, None, make_config("http://x/retrieve", open_tag=True, max_obs_length=bound))


# --- async mode: the same rows -----------------------------------------------------------------------


def test_async_rows_equal_sync_rows_with_opens(tokenizer, retrieval_url):
    s = _streams(tokenizer)
    scripts = {"q1": [s["search"], s["open1"], s["open99"], s["answer"]],
               "q2": [s["open1"], s["open1"], s["bad"], s["answer"]]}
    keys = ["q1", "q2"]
    sync_out, _, _, _ = run(tokenizer, scripts, keys, make_config(retrieval_url, open_tag=True, max_opens=2))
    rows, stats, engine = run_async(tokenizer, scripts, keys,
                                    make_config(retrieval_url, open_tag=True, max_opens=2, mode="async"))
    assert engine.meta[K.META_STOP] == ["</search>", "</answer>", "</open>"]
    for i, row in enumerate(rows):
        assert row.response() == response_of(sync_out, i)
    assert [row.n_opens for row in rows] == sync_out.meta_info["valid_open_stats"] == [2, 2]
    total = sum(stats, Counter())
    assert total["open_not_found"] == sync_out.meta_info["open_not_found"] == 1
    assert total["open_failures"] == 0


@pytest.fixture
def flaky_open_server(retrieval_url):
    """POST /open answers 503 to the first `fail` calls of each doc id, then forwards to the real server."""
    app, seen, fail = FastAPI(), Counter(), 2
    real = retrieval_url.removesuffix("/retrieve") + "/open"

    @app.post("/open")
    async def open_doc(request: Request) -> JSONResponse:
        body = await request.json()
        seen[body["doc_id"]] += 1
        if seen[body["doc_id"]] <= fail:
            return JSONResponse(status_code=503, content={"detail": "busy"})
        answer = requests.post(real, json=body, timeout=5)
        return JSONResponse(status_code=answer.status_code, content=answer.json())

    with serving(app) as base:
        yield f"{base}/retrieve", seen


def test_an_open_is_retried_as_a_search_is(tokenizer, flaky_open_server):
    """A 5xx from POST /open is resent up to retriever.max_retries times (backoff), as a search is:
    with 2 retries the page comes back on the third call; with 1 the open is counted as failed."""
    from search_r1.llm_agent.open_tag import OpenTag

    url, seen = flaky_open_server
    stats: Counter[str] = Counter()
    retried = OpenTag(make_config(url, open_tag=True, retrieval_max_retries=2))
    assert retried._backend().backoff_factor == 0.5 and retried._backend().max_retries == 2
    retried._backend().backoff_factor = 0.01
    page = retried.observe("1", stats)
    assert page.startswith(actions.INFORMATION_OPEN + "Eiffel Tower"), page   # CORPUS doc 1
    assert seen["1"] == 3 and not stats
    short = OpenTag(make_config(url, open_tag=True, retrieval_max_retries=1))
    short._backend().backoff_factor = 0.01
    assert short.observe("2", stats) == actions.render_open_failure()
    assert seen["2"] == 2 and stats["open_failures"] == 1
