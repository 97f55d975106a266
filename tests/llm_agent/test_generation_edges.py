"""Edges of the generation manager and its helpers (tag protocol): config validation with errors
that name the setting, the pure tensor helpers, per-request seeds, the composed batch's keys,
shapes and statistics, the retriever plumbing (sync and async), and the cut of a turn.

Fast and offline: scripted engines and in-memory retrieval clients stand in for the model and
the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import yaml

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions, tools
from search_r1.llm_agent.actions import Action, parse_action
from search_r1.llm_agent.async_generation import AsyncAgentLoop, request_seed
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager, eos_token_ids
from search_r1.llm_agent.tensor_helper import (
    cut_to_effective_len,
    left_pad,
    masked_rows,
    position_ids_from_mask,
    right_pad,
)
from search_r1.llm_agent.trajectory import _Row, _TurnResult
from search_r1.search.client import RetrievalError
from search_r1.search.schema import Hit
from tests.llm_agent.helpers import encode, make_gen_batch, prompt_ids
from verl.utils import batch_keys as K
from verl.workers.rollout.async_engine import Completion

URL = "http://127.0.0.1:9/retrieve"   # never contacted: the tests pass their own clients


def tags_config(**overrides: Any) -> GenerationConfig:
    fields: dict[str, Any] = dict(max_turns=2, max_start_length=256, max_prompt_length=4096,
                                  max_response_length=64, max_obs_length=1024, search_url=URL, topk=2,
                                  retrieval_timeout=5.0, retrieval_max_retries=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


def recipe_tool_config(**search: Any) -> dict:
    """The recipe's search tool config as GenerationConfig.tool_config, with `search` settings changed."""
    from tests.llm_agent.test_tool_protocol import RECIPE_TOOL_CONFIG

    config = tools.parse_tool_config(yaml.safe_load(RECIPE_TOOL_CONFIG.format(url=URL))).to_dict()
    config["search"].update(search)
    return config


def tool_config(**overrides: Any) -> GenerationConfig:
    fields: dict[str, Any] = dict(max_turns=2, max_start_length=1024, max_prompt_length=2048,
                                  max_response_length=400, max_total_response_length=400, max_obs_length=300,
                                  protocol="tool", tool_config=recipe_tool_config(), max_assistant_turns=3)
    fields.update(overrides)
    return GenerationConfig(**fields)


def error_of(make: Any) -> str:
    with pytest.raises(ValueError) as err:
        make()
    return str(err.value)


# --- GenerationConfig: tags protocol -----------------------------------------------------------


def test_unknown_protocol_and_mode_are_named():
    assert error_of(lambda: tags_config(protocol="json")) == (
        "GenerationConfig.protocol must be 'tags' or 'tool', got 'json'")
    assert error_of(lambda: tags_config(mode="batch")) == (
        "GenerationConfig.mode (actor_rollout_ref.rollout.mode) must be 'sync' or 'async', got 'batch'")


def test_serve_app_replaces_the_search_url():
    assert tags_config(serve_app="retriever").search_url == "ray-serve://retriever"
    assert tags_config(serve_app=None).search_url == URL


@pytest.mark.parametrize("name", ["max_start_length", "max_prompt_length", "max_response_length",
                                  "max_obs_length", "topk"])
def test_lengths_below_one_are_named(name):
    message = error_of(lambda: tags_config(**{name: 0}))
    assert message == f"GenerationConfig.{name} must be >= 1, got 0"


def test_smallest_valid_settings_are_accepted():
    config = GenerationConfig(max_turns=0, max_start_length=1, max_prompt_length=2, max_response_length=1,
                              max_obs_length=1, topk=1, max_total_response_length=2)
    assert (config.max_turns, config.topk, config.max_total_response_length) == (0, 1, 2)
    assert config.stop == ("</search>", "</answer>") and isinstance(config.stop, tuple)


def test_negative_max_turns_is_named():
    assert error_of(lambda: tags_config(max_turns=-1)) == "GenerationConfig.max_turns must be >= 0, got -1"


def test_start_length_must_be_below_prompt_length():
    message = error_of(lambda: tags_config(max_start_length=100, max_prompt_length=100))
    assert message.startswith("GenerationConfig.max_start_length (100) must be < max_prompt_length (100)")
    assert tags_config(max_start_length=99, max_prompt_length=100).max_start_length == 99


def test_no_think_rl_error_explains_why():
    assert error_of(lambda: tags_config(no_think_rl=True)) == (
        "GenerationConfig.no_think_rl (algorithm.no_think_rl) is not supported: it re-encodes decoded policy text, "
        "which breaks token-exact rollouts")


def test_total_response_budget_must_fit_one_turn():
    # one turn = max_response_length + max_obs_length = 64 + 100
    assert tags_config(max_obs_length=100, max_total_response_length=164).max_total_response_length == 164
    assert error_of(lambda: tags_config(max_obs_length=100, max_total_response_length=163)) == (
        "GenerationConfig.max_total_response_length (163) must fit one turn: "
        "max_response_length + max_obs_length = 164")


def test_stop_strings_become_a_tuple():
    assert tags_config(stop=["</search>"]).stop == ("</search>",)


# --- GenerationConfig: tool protocol -----------------------------------------------------------


def test_tool_protocol_requires_a_tool_config_and_a_total_budget():
    assert error_of(lambda: tool_config(tool_config=None)) == (
        "GenerationConfig.tool_config (multi_turn.tool_config_path) is required with protocol='tool'")
    assert error_of(lambda: tool_config(max_total_response_length=None)) == (
        "GenerationConfig.max_total_response_length (data.max_response_length, the budget of all turns) is "
        "required with protocol='tool'")


def test_tool_budget_is_not_checked_against_one_tags_turn():
    # The tool protocol's budget covers all turns; a turn may use what is left of it.
    config = tool_config(max_response_length=400, max_obs_length=300, max_total_response_length=100)
    assert config.max_total_response_length == 100


@pytest.mark.parametrize("name", ["max_assistant_turns", "max_user_turns"])
def test_tool_turn_limits_below_one_are_named(name):
    assert error_of(lambda: tool_config(**{name: 0})) == (
        f"GenerationConfig.{name} (multi_turn.{name}) must be >= 1 or null, got 0")
    assert getattr(tool_config(**{name: 1}), name) == 1
    assert getattr(tool_config(**{name: None}), name) is None


def test_tool_parallel_calls_and_truncate_side_are_named():
    assert error_of(lambda: tool_config(max_parallel_calls=0)) == (
        "GenerationConfig.max_parallel_calls (multi_turn.max_parallel_calls) must be >= 1, got 0")
    assert error_of(lambda: tool_config(tool_response_truncate_side="top")) == (
        f"GenerationConfig.tool_response_truncate_side must be one of {tools.TRUNCATE_SIDES}, got 'top'")


def test_tool_stop_strings_follow_the_parallel_calls():
    assert tool_config(max_parallel_calls=1).stop == (tools.TOOL_CALL_CLOSE,)
    assert tool_config(max_parallel_calls=2).stop == ()


def test_search_tool_settings_win_over_the_retriever_settings():
    config = tool_config(tool_config=recipe_tool_config(retrieval_service_url="http://tool/retrieve", topk=5,
                                                        timeout=7), search_url=URL, topk=2)
    assert (config.search_url, config.topk, config.retrieval_timeout) == ("http://tool/retrieve", 5, 7.0)
    assert isinstance(config.retrieval_timeout, float)


@pytest.mark.parametrize("num_workers, rate_limit, global_limit, num_gpus, expected", [
    (10, 4, True, 1, 4),      # the global rate limit caps the workers
    (10, 4, False, 1, 10),    # without it, num_workers alone
    (9, 40, True, 2, 4),      # split over the rollout workers, rounded down
    (1, 1, True, 1, 1),
    (3, 3, False, 4, 1),      # at least one request in flight per worker
])
def test_retrieval_concurrency_splits_the_tool_limits(num_workers, rate_limit, global_limit, num_gpus, expected):
    config = tool_config(tool_config=recipe_tool_config(num_workers=num_workers, rate_limit=rate_limit,
                                                        enable_global_rate_limit=global_limit), num_gpus=num_gpus)
    assert config.retrieval_concurrency == expected and isinstance(config.retrieval_concurrency, int)
    # an explicit setting is kept
    assert tool_config(retrieval_concurrency=3).retrieval_concurrency == 3


# --- small pure helpers ---------------------------------------------------------------------------


def test_eos_token_ids_accepts_one_id_or_several():
    assert eos_token_ids({K.META_EOS_TOKEN_ID: 7}) == frozenset({7})
    assert eos_token_ids({K.META_EOS_TOKEN_ID: [3, 5]}) == frozenset({3, 5})
    assert eos_token_ids({K.META_EOS_TOKEN_ID: (torch.tensor(4), 6)}) == frozenset({4, 6})


def test_request_seed_is_the_documented_formula():
    assert request_seed(7, 2, 3) == 7 * 1_000_003 + 2 * 7_919 + 3
    assert request_seed(0, 0, 5) == 5
    assert request_seed(0, 3, 0) == 3 * 7_919
    # reduced into a non-negative int64 (what engines accept as a seed)
    modulus = 2**63 - 1
    assert request_seed(modulus, 1, 1) == 7_919 + 1
    big = request_seed(2**62, 0, 0)
    assert big == (2**62 * 1_000_003) % modulus and 0 <= big < 2**63 - 1
    assert request_seed(2**70, 0, 0) < 2**63
    assert request_seed(4611686018427387904, 0, 0) == 4611686018427387904 * 1_000_003 % modulus


def test_invalid_action_has_empty_content():
    assert parse_action("no tags at all") == Action("invalid", "", 0)
    assert parse_action("<search>   </search>") == Action("invalid", "", 0)


def test_left_pad_to_a_wider_width_and_empty_batches():
    ids, mask = left_pad([[5, 6], [7]], pad_token_id=9, width=4)
    assert ids.tolist() == [[9, 9, 5, 6], [9, 9, 9, 7]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    empty_ids, empty_mask = left_pad([], pad_token_id=0)
    assert empty_ids.shape == (0, 0) and empty_mask.shape == (0, 0)
    with pytest.raises(ValueError, match=r"^row 1 has 3 tokens, more than the padded width 2$"):
        left_pad([[1], [1, 2, 3]], pad_token_id=0, width=2)


def test_right_pad_defaults_to_the_longest_row():
    out = right_pad([[1, 2, 3], [4]], pad_value=0)
    assert out.tolist() == [[1, 2, 3], [4, 0, 0]] and out.dtype == torch.long
    assert right_pad([], pad_value=0).shape == (0, 0)
    assert right_pad([[], []], pad_value=-1).tolist() == [[], []]
    with pytest.raises(ValueError, match=r"^row 0 has 2 values, more than the padded width 1$"):
        right_pad([[1, 2]], pad_value=0, width=1)


def test_position_ids_of_a_single_mask_row():
    assert position_ids_from_mask(torch.tensor([0, 1, 1, 0])).tolist() == [0, 0, 1, 1]


def test_cut_to_effective_len_keeps_the_longest_row():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]])
    ids = torch.tensor([[0, 5, 6, 7], [0, 0, 0, 8]])
    assert cut_to_effective_len({"ids": ids}, mask)["ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert cut_to_effective_len({"m": right}, right, left_padded=False)["m"].tolist() == [[1, 1, 1], [1, 0, 0]]
    none = torch.zeros((0, 3), dtype=torch.long)
    assert cut_to_effective_len({"ids": none}, none)["ids"].shape == (0, 0)
    assert cut_to_effective_len({"ids": none}, none, left_padded=False)["ids"].shape == (0, 0)


def test_masked_rows_rejects_shapes_that_differ():
    assert masked_rows(torch.tensor([[1.5, 2.5], [3.5, 4.5]]), torch.tensor([[0, 1], [1, 1]])) == [[2.5], [3.5, 4.5]]
    with pytest.raises(ValueError, match=r"^values \(2, 2\) and mask \(2, 3\) differ in shape$"):
        masked_rows(torch.zeros(2, 2), torch.zeros(2, 3))


def test_row_log_probs_are_zero_on_observations():
    row = _Row(prompt_ids=[1])
    row.append_turn([10, 11], [20], [-0.5, -0.25])
    row.append_turn([12], [21, 22], [-1.0])
    assert row.response_log_probs() == [-0.5, -0.25, 0.0, -1.0, 0.0, 0.0]
    row.append_turn([13], [], None)
    assert row.response_log_probs() is None


# --- the manager: construction, engine meta, composition ------------------------------------------


class _NoPadTokenizer:
    pad_token_id = 0
    eos_token_id = None


def test_tokenizer_without_pad_or_eos_is_rejected(tokenizer):
    assert error_of(lambda: LLMGenerationManager(_NoPadTokenizer(), None, tags_config())) == (
        "tokenizer must define both pad_token_id and eos_token_id")


class _LengthTokenizer:
    """Encodes each fixed text to a chosen number of tokens (to see which text does not fit)."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [5] * self.lengths[text]


@pytest.mark.parametrize("longest, name", [(actions.INVALID_ACTION_NOTICE, "the invalid-action notice"),
                                           (actions.SEARCH_BUDGET_NOTICE, "the search-budget notice"),
                                           (actions.INFORMATION_CLOSE, "the </information> closing")])
def test_observation_budget_names_the_text_that_does_not_fit(longest, name):
    lengths = {actions.INVALID_ACTION_NOTICE: 3, actions.SEARCH_BUDGET_NOTICE: 3, actions.INFORMATION_CLOSE: 3}
    lengths[longest] = 9
    assert error_of(lambda: LLMGenerationManager(_LengthTokenizer(lengths), None, tags_config(max_obs_length=8))) \
        == f"max_obs_length (8) is shorter than {name} (9 tokens)"
    assert LLMGenerationManager(_LengthTokenizer(lengths), None, tags_config(max_obs_length=9)).config.max_obs_length == 9


class _BosTokenizer:
    """The tiny tokenizer, adding a BOS when asked for special tokens (as Llama's does by default)."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.pad_token_id, self.eos_token_id = tok, tok.pad_token_id, tok.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([999] if add_special_tokens else []) + self.tok.encode(text, add_special_tokens=False)


def test_observations_are_encoded_without_special_tokens(tokenizer):
    manager = LLMGenerationManager(_BosTokenizer(tokenizer), None, tags_config())
    assert manager.text.encode(actions.SEARCH_BUDGET_NOTICE) == encode(tokenizer, actions.SEARCH_BUDGET_NOTICE)
    ids, truncated = manager._observation_ids(actions.render_search_failure())
    assert 999 not in ids and not truncated


def _rows_without_turns(n: int) -> list[_Row]:
    return [_Row(prompt_ids=[3, 4]) for _ in range(n)]


def test_composed_batch_of_empty_responses_keeps_one_column(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config())
    prompts, prompt_mask = left_pad([[3, 4], [3, 4]], tokenizer.pad_token_id)
    out = manager._compose_final_output(_rows_without_turns(2), prompts, prompt_mask, Counter(), {"generate": 0.5})
    b = out.batch
    assert b[K.RESPONSES].tolist() == [[tokenizer.pad_token_id]] * 2
    for key in (K.LOSS_MASK, K.CONTEXT_CUT_MASK):
        assert b[key].tolist() == [[0], [0]], key
    assert b[K.ATTENTION_MASK].tolist() == [[1, 1, 0], [1, 1, 0]]
    assert b[K.INFO_MASK].tolist() == [[1, 1, 0], [1, 1, 0]]
    meta = out.meta_info
    # a fresh manager's engines have reported nothing against the actor's log-probs
    assert meta[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is True
    assert meta["stop_reasons"] == dict.fromkeys(actions.STOP_REASONS, 0)
    assert meta["active_mask"] == [True, True] and meta["timing_s"] == {"generate": 0.5}


def test_context_cut_mask_marks_only_rows_sampled_from_a_cut_context(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config())
    rows = _rows_without_turns(3)
    for row in rows:
        row.append_turn([10, 11], [20, 21], None)
        row.append_turn([12], [], None)
    rows[1].cut_from = 0       # cut from its first turn on
    rows[2].cut_from = 4       # cut from its second turn on
    prompts, prompt_mask = left_pad([r.prompt_ids for r in rows], tokenizer.pad_token_id)
    out = manager._compose_final_output(rows, prompts, prompt_mask, Counter(), {})
    assert out.batch[K.LOSS_MASK].tolist() == [[1, 1, 0, 0, 1]] * 3
    assert out.batch[K.CONTEXT_CUT_MASK].tolist() == [[0, 0, 0, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 0, 1]]
    assert K.ROLLOUT_LOG_PROBS not in out.batch.keys()


class _MetaEngine(ScriptedRollout):
    """A scripted engine that reports, per call, whether its log-probs match the actor's."""

    def __init__(self, tokenizer: Any, scripts: dict, flags: list[bool | None]) -> None:
        super().__init__(tokenizer, scripts)
        self.flags = flags

    def generate_sequences(self, prompts: Any) -> Any:
        out = super().generate_sequences(prompts)
        flag = self.flags[len(self.calls) - 1]
        if flag is not None:
            out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = flag
        return out


def _streams(tokenizer: Any) -> dict[str, list[int]]:
    return {q: encode(tokenizer, f"<think> hmm </think><search> {q} </search>") for q in ("alpha", "beta", "gamma")} | {
        "answer": encode(tokenizer, "<answer> Paris </answer>")}


class _Client:
    """A blocking retrieval client: one hit per query, titled by the query."""

    def __init__(self, fail: bool = False, short: bool = False) -> None:
        self.calls: list[tuple[list[str], Any, Any]] = []
        self.fail, self.short = fail, short

    def retrieve(self, queries: list[str], topk: Any = None, return_scores: Any = False) -> list[list[Hit]]:
        self.calls.append((list(queries), topk, return_scores))
        if self.fail:
            raise RetrievalError("index exploded")
        hits = [[Hit.from_contents(str(i), f'"{q}"\nabout {q}', 1.0)] for i, q in enumerate(queries)]
        return hits[:1] if self.short else hits


def _row_ids(out: Any, row: int) -> list[int]:
    n = int(out.batch[K.ATTENTION_MASK][row, out.batch[K.PROMPTS].shape[1]:].sum())
    return out.batch[K.RESPONSES][row, :n].tolist()


def _obs_ids(tokenizer: Any, text: str) -> list[int]:
    return encode(tokenizer, text[: -len(actions.INFORMATION_CLOSE)]) + encode(tokenizer, actions.INFORMATION_CLOSE)


class _Clock:
    """perf_counter that advances 0.375 s per reading."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 0.375
        return self.now


def test_sync_rollout_sends_each_row_its_own_hits_and_times_the_turns(tokenizer, monkeypatch):
    from search_r1.llm_agent import generation

    monkeypatch.setattr(generation, "time", _Clock())
    s = _streams(tokenizer)
    keys = ["alpha", "beta", "gamma"]
    engine = _MetaEngine(tokenizer, {k: [s[k], s["answer"]] for k in keys}, [False, True])
    client = _Client()
    gen_batch, prompts = make_gen_batch(tokenizer, keys)
    out = LLMGenerationManager(tokenizer, engine, tags_config(), retrieval_client=client).run_llm_loop(
        gen_batch, prompts)
    assert client.calls == [(keys, 2, True)]
    for row, key in enumerate(keys):
        hit = Hit.from_contents("0", f'"{key}"\nabout {key}', 1.0)
        assert _row_ids(out, row) == s[key] + _obs_ids(tokenizer, actions.render_observation([hit])) + s["answer"]
    meta = out.meta_info
    # two turns: each reads the clock around the engine call and around the retrieval call
    assert meta["timing_s"] == {"generate": 0.75, "retrieval": 0.75}
    # the first call's engine did not match the actor's log-probs: the whole rollout does not
    assert meta[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is False
    sent = engine.calls[0]["meta_info"]
    assert sent[K.META_DO_SAMPLE] is True and sent[K.META_TEMPERATURE] == 1.0
    assert sent[K.META_EOS_TOKEN_ID] == tokenizer.eos_token_id and sent[K.META_PAD_TOKEN_ID] == tokenizer.pad_token_id


def test_engine_meta_from_the_batch_is_passed_on(tokenizer):
    s = _streams(tokenizer)
    engine = _MetaEngine(tokenizer, {"alpha": [s["answer"]]}, [None])
    gen_batch, prompts = make_gen_batch(tokenizer, ["alpha"], do_sample=False, temperature=0.5,
                                        eos_token_id=[tokenizer.eos_token_id, 7], pad_token_id=tokenizer.pad_token_id)
    out = LLMGenerationManager(tokenizer, engine, tags_config()).run_llm_loop(gen_batch, prompts)
    sent = engine.calls[0]["meta_info"]
    assert sent[K.META_DO_SAMPLE] is False and sent[K.META_TEMPERATURE] == 0.5
    assert sent[K.META_EOS_TOKEN_ID] == [tokenizer.eos_token_id, 7]
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is True


def test_retrieval_errors_in_sync_mode(tokenizer):
    s = _streams(tokenizer)
    keys = ["alpha", "beta", "gamma"]
    scripts = {k: [s[k], s["answer"]] for k in keys}
    with pytest.raises(ValueError, match=r"^retrieval returned 1 result lists for 3 queries$"):
        LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, scripts), tags_config(),
                             retrieval_client=_Client(short=True)).run_llm_loop(*make_gen_batch(tokenizer, keys))
    no_url = tags_config(search_url=None)
    with pytest.raises(ValueError) as err:
        LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, scripts), no_url).run_llm_loop(
            *make_gen_batch(tokenizer, keys))
    assert str(err.value) == "GenerationConfig.search_url (retriever.url) is required when the policy searches"


def test_retriever_is_opened_with_the_configured_settings(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config(topk=4, retrieval_timeout=2.5,
                                                                retrieval_max_retries=1))
    client = manager._retriever()
    assert (client.topk, client.timeout, client.max_retries) == (4, 2.5, 1)
    assert manager._retriever() is client


class _ShortEngine(ScriptedRollout):
    def generate_sequences(self, prompts: Any) -> Any:
        return super().generate_sequences(prompts).slice(0, 1)


def test_engine_returning_fewer_rows_is_an_error(tokenizer):
    s = _streams(tokenizer)
    config = tags_config(max_response_length=5, max_obs_length=1024)
    engine = _ShortEngine(tokenizer, {k: [s["answer"]] for k in ("alpha", "beta", "gamma")})
    with pytest.raises(ValueError) as err:
        LLMGenerationManager(tokenizer, engine, config).run_llm_loop(
            *make_gen_batch(tokenizer, ["alpha", "beta", "gamma"]))
    assert str(err.value) == "generate_sequences returned 1 rows of 'responses' for 3 prompts"


def test_initial_input_ids_that_do_not_fit_are_rejected(tokenizer):
    gen_batch, prompts = make_gen_batch(tokenizer, ["alpha", "beta"])
    manager = LLMGenerationManager(tokenizer, None, tags_config())
    assert error_of(lambda: manager.run_llm_loop(gen_batch, prompts[:1])) == (
        f"initial_input_ids (1, {prompts.shape[1]}) does not fit gen_batch 'input_ids' (2, {prompts.shape[1]})")
    assert error_of(lambda: manager.run_llm_loop(gen_batch, prompts + 1)) == (
        "initial_input_ids must be the last columns of gen_batch 'input_ids'")


def test_prompt_of_exactly_max_start_length_is_accepted(tokenizer):
    s = _streams(tokenizer)
    length = len(prompt_ids(tokenizer, "alpha"))
    config = tags_config(max_start_length=length)
    out = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, {"alpha": [s["answer"]]}), config).run_llm_loop(
        *make_gen_batch(tokenizer, ["alpha"]))
    assert _row_ids(out, 0) == s["answer"]


def test_eos_after_the_action_is_cut_when_the_engine_has_no_stop_strings(tokenizer):
    s = _streams(tokenizer)
    eos = tokenizer.eos_token_id
    config = tags_config(stop=())
    out = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, {"alpha": [s["answer"] + [eos]]}),
                               config).run_llm_loop(*make_gen_batch(tokenizer, ["alpha"]))
    assert _row_ids(out, 0) == s["answer"]
    assert (out.meta_info["generated_tokens"], out.meta_info["kept_tokens"]) == (len(s["answer"]) + 1,
                                                                               len(s["answer"]))


def test_token_versions_cover_an_empty_response(tokenizer):
    engine = ScriptedRollout(tokenizer, {"alpha": [[]]})
    manager = LLMGenerationManager(tokenizer, engine, tags_config(max_turns=0))
    manager.turn_version = lambda: 3
    out = manager.run_llm_loop(*make_gen_batch(tokenizer, ["alpha"]))
    assert out.batch[K.RESPONSES].shape == (1, 1)
    assert out.batch[K.TOKEN_VERSIONS].tolist() == [[-1]]
    assert out.meta_info["stop_reasons"][actions.INVALID_ACTION] == 1


def test_shortest_prefix_finds_the_first_satisfying_length(tokenizer):
    text = LLMGenerationManager(tokenizer, None, tags_config()).text
    sampled = list(range(10, 30))
    for n in (1, 2, 3, 7, 19, 20):
        target = len(text.decode(sampled[:n]))
        found = text.shortest_prefix(sampled, lambda decoded, target=target: len(decoded) >= target)
        assert found == sampled[:n], n


# --- async: one trajectory's searches ---------------------------------------------------------------


class _AsyncClient:
    def __init__(self, fail: bool = False, short: bool = False) -> None:
        self.sync = _Client(fail=fail, short=short)

    async def retrieve(self, queries: list[str], topk: Any = None, return_scores: Any = False) -> list[list[Hit]]:
        return self.sync.retrieve(queries, topk=topk, return_scores=return_scores)


class _AsyncEngine:
    def __init__(self, streams: list[list[int]]) -> None:
        self.streams, self.seeds = list(streams), []

    async def generate(self, context: list[int], seed: int, max_tokens: int | None = None,
                       follows: Completion | None = None) -> Completion:
        self.seeds.append(seed)
        ids = self.streams.pop(0)
        return Completion(token_ids=ids, log_probs=[-1.0] * len(ids))


def _search_turn(query: str) -> _TurnResult:
    return _TurnResult(kept_ids=[1], action=Action("search", query, 5), emitted_eos=False, generated=1,
                       queries=(query,))


def test_async_act_asks_the_client_and_counts_failures(tokenizer):
    manager = LLMGenerationManager(tokenizer, None, tags_config(mode="async"))
    client = _AsyncClient()
    loop = AsyncAgentLoop(manager, None, client, frozenset({tokenizer.eos_token_id}))
    stats: Counter[str] = Counter()
    observation = asyncio.run(loop._act(_search_turn("alpha"), stats))
    assert observation == actions.render_observation([Hit.from_contents("0", '"alpha"\nabout alpha', 1.0)])
    assert client.sync.calls == [(["alpha"], 2, True)]
    stats = Counter(search_failures=2)
    failing = AsyncAgentLoop(manager, None, _AsyncClient(fail=True), frozenset())
    assert asyncio.run(failing._act(_search_turn("alpha"), stats)) == actions.render_search_failure()
    assert stats["search_failures"] == 3
    with pytest.raises(ValueError, match=r"^retrieval returned 1 result lists for 2 queries$"):
        short = AsyncAgentLoop(manager, None, _AsyncClient(short=True), frozenset())
        res = dataclasses.replace(_search_turn("alpha"), queries=("alpha", "beta"))
        asyncio.run(short._act(res, Counter()))
    no_client = AsyncAgentLoop(manager, None, None, frozenset())
    with pytest.raises(ValueError) as err:
        asyncio.run(no_client._act(_search_turn("alpha"), Counter()))
    assert str(err.value) == "GenerationConfig.search_url (retriever.url) is required when the policy searches"


def test_async_trajectory_adds_up_its_retrieval_waits(tokenizer, monkeypatch):
    from search_r1.llm_agent import async_generation

    monkeypatch.setattr(async_generation, "time", _Clock())
    s = _streams(tokenizer)
    manager = LLMGenerationManager(tokenizer, None, tags_config(mode="async"))
    engine = _AsyncEngine([s["alpha"], s["beta"], s["answer"]])
    loop = AsyncAgentLoop(manager, engine, _AsyncClient(), frozenset({tokenizer.eos_token_id}))
    row = _Row(prompt_ids=prompt_ids(tokenizer, "alpha"))
    stats = asyncio.run(loop.trajectory(row, 1, 7))
    assert row.stop_reason == actions.ANSWERED and row.n_searches == 2
    assert stats["retrieval_ms"] == 750          # two waits of 0.375 s
    assert engine.seeds == [request_seed(7, 1, t) for t in range(3)]


def test_async_trajectory_stops_when_no_turn_fits(tokenizer):
    s = _streams(tokenizer)
    config = tags_config(mode="async", max_response_length=64, max_obs_length=1024, max_total_response_length=1088)
    manager = LLMGenerationManager(tokenizer, None, config)
    engine = _AsyncEngine([s["alpha"], s["answer"]])
    loop = AsyncAgentLoop(manager, engine, _AsyncClient(), frozenset({tokenizer.eos_token_id}))
    row = _Row(prompt_ids=prompt_ids(tokenizer, "alpha"))
    stats = asyncio.run(loop.trajectory(row, 0, 1))
    assert row.stop_reason == actions.CONTEXT_FULL and row.n_turns == 1 and len(engine.seeds) == 1
    assert isinstance(stats, Counter) and stats["retrieval_ms"] >= 0


def test_run_shard_without_a_retriever_and_with_one(tokenizer, monkeypatch):
    from search_r1.llm_agent.async_generation import run_shard
    from search_r1.search import serve_client
    from tests.llm_agent.test_rollout_behaviours import ScriptedStepEngine

    s = _streams(tokenizer)
    scripts = {"alpha": [s["answer"]]}
    config = tags_config(mode="async", search_url=None)
    rows, stats, _ = run_shard(tokenizer, config, ScriptedStepEngine(tokenizer, scripts, config),
                               [prompt_ids(tokenizer, "alpha")], 3, frozenset({tokenizer.eos_token_id}))
    assert rows[0].stop_reason == actions.ANSWERED and len(stats) == 1

    opened: list[tuple[str, dict]] = []

    class Closing(_AsyncClient):
        closed = False

        async def aclose(self) -> None:
            Closing.closed = True

    def fake_open(url: str, **settings: Any) -> Closing:
        opened.append((url, settings))
        return Closing()

    monkeypatch.setattr(serve_client, "open_async_retrieval_client", fake_open)
    config = tags_config(mode="async", topk=4, retrieval_timeout=2.5, retrieval_max_retries=1,
                         retrieval_concurrency=6)
    scripts = {"alpha": [s["alpha"], s["answer"]]}
    rows, _, _ = run_shard(tokenizer, config, ScriptedStepEngine(tokenizer, scripts, config),
                           [prompt_ids(tokenizer, "alpha")], 3, frozenset({tokenizer.eos_token_id}))
    assert opened == [(URL, {"topk": 4, "timeout": 2.5, "max_retries": 1, "pool_size": 6})]
    assert Closing.closed and rows[0].n_searches == 1
