"""The rollout's per-row record of what each turn did (`agent_trace`, read by the trajectory dumps):
token counts that tile the response exactly as the loss mask does, the queries sent and the ids
the server answered with, tool calls, and the stop reason."""

from __future__ import annotations

import pickle

from search_r1.llm_agent import tools
from search_r1.llm_agent.trajectory import RowTrace, TurnTrace
from search_r1.search.client import RetrievalClient
from tests.llm_agent.helpers import encode
from tests.llm_agent.test_generation import make_config, response_of, run
from tests.llm_agent.test_tool_protocol import RECIPE_TOOL_CONFIG, call, run_tool, tool_gen_config
from verl.utils import batch_keys as K


def _mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(policy, observation) token counts per turn, read off a 0/1 mask."""
    runs, pos = [], 0
    while pos < len(mask):
        start = pos
        while pos < len(mask) and mask[pos] == 1:
            pos += 1
        mid = pos
        while pos < len(mask) and mask[pos] == 0:
            pos += 1
        runs.append((mid - start, pos - mid))
    return runs


def test_each_turn_records_its_spans_queries_and_the_ids_the_server_returned(tokenizer, retrieval_url):
    enc = lambda s: encode(tokenizer, s)  # noqa: E731
    scripts = {
        "q1": [enc("<think> a </think><search> capital of France </search>"),
               enc("<think> b </think><search> Eiffel Tower </search>"),
               enc("<answer> Paris </answer>") + [tokenizer.eos_token_id]],
        "q2": [enc("<think> hm </think> nothing"), enc("<answer> Rome </answer>")],
        "q3": [enc("<think> bye </think>") + [tokenizer.eos_token_id]],
    }
    out, _, _, _ = run(tokenizer, scripts, ["q1", "q2", "q3"], make_config(retrieval_url))
    traces = out.non_tensor_batch[K.AGENT_TRACE]
    assert len(traces) == 3 and all(isinstance(t, RowTrace) for t in traces)
    client = RetrievalClient(retrieval_url, topk=2)
    expected_ids = [tuple(h.doc_id for h in hits) for hits in client.retrieve(["capital of France", "Eiffel Tower"])]

    for row, trace in enumerate(traces):
        _, mask = response_of(out, row)
        assert [(t.policy_tokens, t.obs_tokens) for t in trace.turns] == _mask_runs(mask), f"row {row}"
    q1, q2, q3 = traces
    assert [t.action for t in q1.turns] == ["search", "search", "answer"]
    assert [t.queries for t in q1.turns] == [("capital of France",), ("Eiffel Tower",), ()]
    assert [t.doc_ids for t in q1.turns] == [(expected_ids[0],), (expected_ids[1],), ()]
    assert q1.stop_reason == "answered"
    # an invalid action is answered with the notice (an observation) and searches nothing
    assert [t.action for t in q2.turns] == ["invalid", "answer"] and q2.turns[0].obs_tokens > 0
    assert q2.turns[0].queries == () and q2.turns[0].doc_ids == ()
    assert q3.stop_reason == "eos" and len(q3.turns) == 1 and q3.turns[0].obs_tokens == 0


def test_a_failed_search_records_the_query_and_no_ids(tokenizer):
    scripts = {"q1": [encode(tokenizer, "<search> anything </search>"), encode(tokenizer, "<answer> x </answer>")]}
    # nothing listens on this port: the search fails and becomes an observation
    out, _, _, _ = run(tokenizer, scripts, ["q1"], make_config("http://127.0.0.1:9/retrieve", retrieval_timeout=0.5))
    first = out.non_tensor_batch[K.AGENT_TRACE][0].turns[0]
    assert first.queries == ("anything",) and first.doc_ids == () and first.obs_tokens > 0


def test_tool_calls_record_their_names_queries_and_ids(tool_tokenizer, tmp_path, retrieval_url):
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(RECIPE_TOOL_CONFIG.format(url=retrieval_url))
    tool_config = tools.load_tool_config(path)
    tok = tool_tokenizer
    search = encode(tok, call(["capital of France", "Eiffel Tower"]))
    answer = encode(tok, "<think> found </think>\n<answer> Paris </answer>") + [tok.eos_token_id]
    out, _ = run_tool(tok, {"q1": [search, answer]}, ["q1"], tool_gen_config(tool_config))
    trace = out.non_tensor_batch[K.AGENT_TRACE][0]
    hits = RetrievalClient(retrieval_url, topk=3).retrieve(["capital of France", "Eiffel Tower"])
    first = trace.turns[0]
    assert first.calls == ("search",) and first.queries == ("capital of France", "Eiffel Tower")
    assert first.doc_ids == tuple(tuple(h.doc_id for h in q) for q in hits)
    _, mask = response_of(out, 0)
    assert [(t.policy_tokens, t.obs_tokens) for t in trace.turns] == _mask_runs(mask)
    assert trace.stop_reason == "answered"


def test_a_trace_survives_pickling() -> None:
    """The async loop's rows come back from Ray workers with their traces."""
    trace = RowTrace("answered", (TurnTrace(3, 5, "search", ("q",), (("1", "2"),)), TurnTrace(2, 0, "answer")))
    assert pickle.loads(pickle.dumps(trace)) == trace
