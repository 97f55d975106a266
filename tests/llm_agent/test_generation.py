"""The generation manager against a scripted engine and a real BM25 server over HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent import actions
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.search.client import RetrievalClient
from tests.conftest import free_port, serving
from tests.llm_agent.helpers import encode, make_gen_batch, prompt_ids
from verl.utils import batch_keys as K


def make_config(url: str, **overrides) -> GenerationConfig:
    fields = dict(max_turns=3, max_start_length=256, max_prompt_length=4096, max_response_length=64,
                  max_obs_length=1024, search_url=url, topk=2, retrieval_timeout=5.0, retrieval_max_retries=0)
    fields.update(overrides)
    return GenerationConfig(**fields)


def run(tokenizer, scripts, keys, config, is_validation=False, engine_cls=ScriptedRollout, **meta):
    engine = engine_cls(tokenizer, scripts)
    gen_batch, prompts = make_gen_batch(tokenizer, keys, **meta)
    out = LLMGenerationManager(tokenizer, engine, config, is_validation=is_validation).run_llm_loop(gen_batch, prompts)
    return out, engine, prompts, gen_batch


def observation_ids(tokenizer, url: str, query: str) -> list[int]:
    """What the manager should append for `query`: body and closing tag, each tokenized once."""
    hits = RetrievalClient(url, topk=2).retrieve([query])[0]
    text = actions.render_observation(hits)
    return encode(tokenizer, text[: -len(actions.INFORMATION_CLOSE)]) + encode(tokenizer, actions.INFORMATION_CLOSE)


def response_of(out, row: int) -> tuple[list[int], list[int]]:
    """Row's real response ids and its loss mask, padding removed."""
    n = int(out.batch[K.ATTENTION_MASK][row, out.batch[K.PROMPTS].shape[1]:].sum())
    return out.batch[K.RESPONSES][row, :n].tolist(), out.batch[K.LOSS_MASK][row, :n].tolist()


@pytest.fixture
def streams(tokenizer):
    enc = lambda s: encode(tokenizer, s)  # noqa: E731
    eos = tokenizer.eos_token_id
    return {
        "search1": enc("<think> first </think><search> capital of France </search>"),
        "search2": enc("<think> more </think><search> Eiffel Tower </search>"),
        "ramble": enc("\n\n<information>Doc 1(Title: fake) made up </information>\n\n<think> more </think>"),
        "answer": enc("<think> done </think><answer> Paris </answer>"),
        "bad": enc("<think> I wonder what to write </think> nothing"),
        "rome": enc("<answer> Rome </answer>"),
        "bye": enc("<think> bye </think>") + [eos],
        "eos": [eos],
    }


def test_two_searches_then_answer_have_exact_token_layout(tokenizer, retrieval_url, streams):
    s = streams
    scripts = {
        "q1": [s["search1"] + s["ramble"], s["search2"] + s["ramble"], s["answer"] + s["eos"] + s["ramble"]],
        "q2": [s["bad"], s["rome"] + s["eos"]],
        "q3": [s["bye"] + s["ramble"]],
    }
    out, engine, prompts, gen_batch = run(tokenizer, scripts, ["q1", "q2", "q3"], make_config(retrieval_url),
                                          do_sample=True, temperature=0.7)
    obs1 = observation_ids(tokenizer, retrieval_url, "capital of France")
    obs2 = observation_ids(tokenizer, retrieval_url, "Eiffel Tower")
    notice = encode(tokenizer, actions.INVALID_ACTION_NOTICE)
    expected = {
        0: [(s["search1"], 1), (obs1, 0), (s["search2"], 1), (obs2, 0), (s["answer"], 1)],
        1: [(s["bad"], 1), (notice, 0), (s["rome"], 1)],
        2: [(s["bye"], 1)],  # EOS emitted by the policy is kept and trained on
    }
    for row, segments in expected.items():
        ids, loss = response_of(out, row)
        assert ids == [t for seg, _ in segments for t in seg], f"row {row}"
        assert loss == [m for seg, m in segments for _ in seg], f"row {row}"

    b = out.batch
    prompt_mask = gen_batch.batch[K.ATTENTION_MASK]
    assert torch.equal(b[K.PROMPTS], prompts)
    assert torch.equal(b[K.INPUT_IDS], torch.cat([prompts, b[K.RESPONSES]], dim=1))
    assert torch.equal(b[K.INFO_MASK], torch.cat([prompt_mask, b[K.LOSS_MASK]], dim=1))
    response_attention = b[K.ATTENTION_MASK][:, prompts.shape[1]:]
    assert (b[K.RESPONSES][response_attention == 0] == tokenizer.pad_token_id).all()
    assert torch.equal(b[K.POSITION_IDS], (b[K.ATTENTION_MASK].cumsum(-1) - 1).clamp(min=0))
    assert b[K.LOSS_MASK].shape == b[K.RESPONSES].shape

    meta = out.meta_info
    assert meta["turns_stats"] == [3, 2, 1]
    assert meta["valid_search_stats"] == [2, 0, 0]
    assert meta["valid_action_stats"] == [3, 1, 0]
    assert meta["stop_reasons"]["answered"] == 2 and meta["stop_reasons"]["eos"] == 1
    assert meta["active_mask"] == [False, False, False]
    assert meta["search_failures"] == 0 and meta["obs_truncated"] == 0
    sent = engine.calls[0]["meta_info"]
    assert sent[K.META_STOP] == ["</search>", "</answer>"] and sent[K.META_RESPONSE_LENGTH] == 64
    assert sent[K.META_DO_SAMPLE] is True and sent[K.META_TEMPERATURE] == 0.7
    # Each turn only the rows still running are sent to the engine.
    assert [len(call["contexts"]) for call in engine.calls] == [3, 2, 1]


def test_manager_cuts_at_action_when_engine_ignores_stop_strings(tokenizer, retrieval_url, streams):
    s = streams
    scripts = {"q1": [s["search1"] + s["ramble"], s["answer"] + s["ramble"]]}
    on, _, _, _ = run(tokenizer, scripts, ["q1"], make_config(retrieval_url))
    off, engine, _, _ = run(tokenizer, scripts, ["q1"], make_config(retrieval_url, stop=()))
    assert engine.calls[0]["meta_info"][K.META_STOP] == []
    assert torch.equal(on.batch[K.RESPONSES], off.batch[K.RESPONSES])
    assert torch.equal(on.batch[K.LOSS_MASK], off.batch[K.LOSS_MASK])
    assert on.meta_info["generated_tokens"] == on.meta_info["kept_tokens"]
    assert off.meta_info["generated_tokens"] == off.meta_info["kept_tokens"] + 2 * len(s["ramble"])


def test_sampled_ids_are_kept_when_decode_encode_is_not_identity(tokenizer, retrieval_url):
    vocab = tokenizer.get_vocab()
    assert "th" in vocab and "t" in vocab and "h" in vocab
    split = encode(tokenizer, "<think> ") + [vocab["t"], vocab["h"]] + encode(tokenizer, "e </think>")
    turn1 = split + encode(tokenizer, "<search> capital of Italy </search>")
    turn2 = encode(tokenizer, "<answer> ") + [vocab["t"], vocab["h"]] + encode(tokenizer, "is </answer>")
    for turn in (turn1, turn2):
        assert encode(tokenizer, tokenizer.decode(turn)) != turn  # the trap is real
    out, _, _, _ = run(tokenizer, {"q1": [turn1, turn2]}, ["q1"], make_config(retrieval_url))
    ids, loss = response_of(out, 0)
    policy = [t for t, m in zip(ids, loss, strict=True) if m == 1]
    assert policy == turn1 + turn2
    assert ids[: len(turn1)] == turn1 and ids[-len(turn2):] == turn2


def test_final_turn_search_gets_notice_and_row_ends(tokenizer, retrieval_url, streams):
    search = streams["search1"] + streams["ramble"]
    out, engine, _, _ = run(tokenizer, {"q1": [search] * 5}, ["q1"], make_config(retrieval_url, max_turns=2))
    ids, loss = response_of(out, 0)
    budget = encode(tokenizer, actions.SEARCH_BUDGET_NOTICE)
    assert ids[-len(budget):] == budget and loss[-len(budget):] == [0] * len(budget)
    assert ids[-len(budget) - len(streams["search1"]):-len(budget)] == streams["search1"]
    meta = out.meta_info
    assert meta["turns_stats"] == [3] and meta["valid_search_stats"] == [2]
    assert meta["stop_reasons"]["max_turns"] == 1 and meta["active_mask"] == [True]
    assert len(engine.calls) == 3  # max_turns searches + one final turn, then nothing


def test_long_observation_is_truncated_keeping_closing_tag(tokenizer, retrieval_url, streams):
    s = streams
    full = observation_ids(tokenizer, retrieval_url, "capital of France")
    limit = max(len(encode(tokenizer, actions.INVALID_ACTION_NOTICE)),
                len(encode(tokenizer, actions.SEARCH_BUDGET_NOTICE))) + 4
    assert len(full) > limit
    out, _, _, _ = run(tokenizer, {"q1": [s["search1"], s["answer"]]}, ["q1"],
                       make_config(retrieval_url, max_obs_length=limit))
    ids, loss = response_of(out, 0)
    obs = ids[len(s["search1"]): len(ids) - len(s["answer"])]
    assert len(obs) == limit and loss.count(0) == limit
    close = encode(tokenizer, actions.INFORMATION_CLOSE)
    assert obs == full[: limit - len(close)] + close
    assert tokenizer.decode(obs).endswith("</information>\n\n")
    assert out.meta_info["obs_truncated"] == 1


def test_rolling_context_keeps_prompt_start_and_drops_oldest_turns(tokenizer, retrieval_url, streams):
    search = streams["search1"]
    turn_len = len(search) + len(observation_ids(tokenizer, retrieval_url, "capital of France"))
    prompt = prompt_ids(tokenizer, "q1")
    config = make_config(retrieval_url, max_turns=2, max_start_length=len(prompt) + 1,
                         max_prompt_length=len(prompt) + turn_len + 5)
    out, engine, _, _ = run(tokenizer, {"q1": [search] * 3}, ["q1"], config)
    contexts = [call["contexts"][0] for call in engine.calls]
    assert all(ctx[: len(prompt)] == prompt for ctx in contexts)
    assert all(len(ctx) <= config.max_prompt_length for ctx in contexts)
    assert [len(ctx) for ctx in contexts] == [len(prompt), len(prompt) + turn_len, len(prompt) + turn_len]
    assert out.meta_info["context_cuts"] == 1
    ids, _ = response_of(out, 0)
    # The trained response still holds every turn.
    assert len(ids) == 2 * turn_len + len(search) + len(encode(tokenizer, actions.SEARCH_BUDGET_NOTICE))


def test_row_that_cannot_fit_another_turn_stops_as_context_full(tokenizer, retrieval_url, streams):
    search = streams["search1"]
    turn_len = len(search) + len(observation_ids(tokenizer, retrieval_url, "capital of France"))
    # Room for exactly one more turn budget after the first search, not after the second.
    config = make_config(retrieval_url, max_turns=5, max_response_length=32, max_obs_length=512,
                         max_total_response_length=turn_len + 32 + 512)
    out, engine, _, _ = run(tokenizer, {"q1": [search] * 6, "q2": [streams["answer"]]}, ["q1", "q2"], config)
    meta = out.meta_info
    assert meta["stop_reasons"]["context_full"] == 1 and meta["stop_reasons"]["answered"] == 1
    assert meta["turns_stats"] == [2, 1] and meta["valid_search_stats"] == [2, 0]
    assert meta["active_mask"] == [True, False]
    ids, _ = response_of(out, 0)
    assert len(ids) == 2 * turn_len <= config.max_total_response_length


def test_prompt_longer_than_max_start_length_is_rejected(tokenizer, retrieval_url, streams):
    config = make_config(retrieval_url, max_start_length=4)
    with pytest.raises(ValueError, match="row 0"):
        run(tokenizer, {"q1": [streams["answer"]]}, ["q1"], config)


def test_no_think_rl_is_rejected_by_config(retrieval_url):
    with pytest.raises(ValueError, match="no_think_rl"):
        make_config(retrieval_url, no_think_rl=True)


@contextlib.contextmanager
def failing_server() -> Iterator[str]:
    """A /retrieve endpoint that always answers HTTP 500."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve() -> JSONResponse:
        return JSONResponse(status_code=500, content={"detail": "index exploded"})

    with serving(app) as base:
        yield f"{base}/retrieve"


@pytest.mark.parametrize("where", ["server_down", "server_500"])
def test_failed_search_becomes_counted_observation(tokenizer, streams, where):
    s = streams
    scripts = {"q1": [s["search1"], s["answer"]], "q2": [s["search2"], s["answer"]]}
    with contextlib.ExitStack() as stack:
        url = (f"http://127.0.0.1:{free_port()}/retrieve" if where == "server_down"
               else stack.enter_context(failing_server()))
        out, _, _, _ = run(tokenizer, scripts, ["q1", "q2"], make_config(url))
    failure = actions.render_search_failure()
    failure_ids = (encode(tokenizer, failure[: -len(actions.INFORMATION_CLOSE)])
                   + encode(tokenizer, actions.INFORMATION_CLOSE))
    ids, loss = response_of(out, 0)
    assert ids == s["search1"] + failure_ids + s["answer"]
    assert loss == [1] * len(s["search1"]) + [0] * len(failure_ids) + [1] * len(s["answer"])
    assert out.meta_info["search_failures"] == 2
    assert out.meta_info["stop_reasons"]["answered"] == 2


class SamplingScriptedRollout(ScriptedRollout):
    """Prepends random thinking tokens when asked to sample; greedy replays the script."""

    def emit(self, context, meta):
        stream = super().emit(context, meta)
        if meta["do_sample"]:
            noise = torch.randint(70, 90, (6,)).tolist()
            return encode(self.tokenizer, "<think>") + noise + stream
        return stream


def test_validation_is_greedy_and_deterministic(tokenizer, retrieval_url, streams):
    s = streams
    scripts = {"q1": [s["search1"], s["answer"]], "q2": [s["rome"]], "q3": [s["bye"]]}
    keys = ["q1", "q2", "q3"]
    outs = [run(tokenizer, scripts, keys, make_config(retrieval_url), is_validation=True,
                engine_cls=SamplingScriptedRollout, do_sample=True)[:2] for _ in range(2)]
    (first, engine), (second, _) = outs
    assert all(call["meta_info"][K.META_DO_SAMPLE] is False for call in engine.calls)
    for key in (K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.INFO_MASK, K.LOSS_MASK, K.POSITION_IDS):
        assert torch.equal(first.batch[key], second.batch[key]), key
    sampled = [run(tokenizer, scripts, keys, make_config(retrieval_url), engine_cls=SamplingScriptedRollout,
                   do_sample=True)[0] for _ in range(2)]
    assert not torch.equal(sampled[0].batch[K.RESPONSES], sampled[1].batch[K.RESPONSES])


class RecordingEngine:
    """Wraps a real engine and keeps each row's sampled ids per call."""

    def __init__(self, engine) -> None:
        self.engine, self.sampled = engine, []

    def generate_sequences(self, batch):
        out = self.engine.generate_sequences(batch)
        width = out.batch[K.RESPONSES].shape[1]
        mask = out.batch[K.ATTENTION_MASK][:, -width:].bool()
        self.sampled.append([row[m].tolist() for row, m in zip(out.batch[K.RESPONSES], mask, strict=True)])
        return out


def test_real_hf_rollout_is_deterministic_and_token_exact_in_validation(tokenizer, retrieval_url):
    from verl.utils.tiny_model import build_tiny_qwen2
    from verl.workers.rollout.hf_rollout import HFRollout

    torch.manual_seed(0)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1)
    config = make_config(retrieval_url, max_turns=1, max_response_length=12)
    runs = []
    for _ in range(2):
        engine = RecordingEngine(HFRollout(model, {"micro_batch_size": 8}, tokenizer))
        gen_batch, prompts = make_gen_batch(tokenizer, ["q1", "q2", "q3"], do_sample=True, temperature=1.0)
        manager = LLMGenerationManager(tokenizer, engine, config, is_validation=True)
        runs.append((manager.run_llm_loop(gen_batch, prompts), engine))
    (first, engine), (second, _) = runs
    for key in (K.RESPONSES, K.ATTENTION_MASK, K.LOSS_MASK):
        assert torch.equal(first.batch[key], second.batch[key]), key
    # The policy part of each row is exactly what the engine sampled, turn after turn.
    # Row r is in calls 0..turns[r]-1, at the position among the rows still running.
    turns = first.meta_info["turns_stats"]
    assert first.meta_info["generated_tokens"] == first.meta_info["kept_tokens"]
    assert len(engine.sampled) == max(turns)
    for row in range(3):
        expected = []
        for call in range(turns[row]):
            position = sum(1 for other in range(row) if turns[other] > call)
            expected += engine.sampled[call][position]
        ids, loss = response_of(first, row)
        assert [t for t, m in zip(ids, loss, strict=True) if m == 1] == expected


@pytest.fixture(scope="module")
def split_tag_tokenizer():
    """A byte-level BPE whose action tags are NOT single tokens, with '>.' merged into one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from verl.utils.tiny_model import CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    texts = ["<search> capital of France </search>. <answer> Paris </answer>. Question: q1? done"] * 50
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=SPECIAL_TOKENS[0], eos_token=EOS_TOKEN,
                                  padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.mark.parametrize("stop", [("</search>", "</answer>"), ()])
def test_multi_token_tags_are_cut_at_the_token_completing_them(split_tag_tokenizer, retrieval_url, stop):
    tok = split_tag_tokenizer
    search = encode(tok, "<search> capital of France </search>.")
    answer = encode(tok, "<answer> Paris </answer>.")
    assert len(encode(tok, "</search>")) > 1 and tok.decode(search[-1:]) == ">."  # the tag ends inside a token
    tail = encode(tok, " done done")
    out, _, _, _ = run(tok, {"q1": [search + tail, answer + tail]}, ["q1"], make_config(retrieval_url, stop=stop))
    ids, loss = response_of(out, 0)
    policy = [t for t, m in zip(ids, loss, strict=True) if m == 1]
    assert policy == search + answer
    assert ids[: len(search)] == search and ids[-len(answer):] == answer
    assert out.meta_info["valid_search_stats"] == [1] and out.meta_info["stop_reasons"]["answered"] == 1


def test_partial_rollout_records_the_version_that_sampled_each_turn(tokenizer, retrieval_url, streams):
    # A partial rollout's manager asks for the weights' version before every turn (the trainer pushes
    # newer weights there); each turn's tokens, its observation with it, carry that version.
    s = streams
    scripts = {"q1": [s["search1"], s["search2"], s["answer"] + s["eos"]], "q2": [s["rome"] + s["eos"]]}
    engine = ScriptedRollout(tokenizer, scripts)
    gen_batch, prompts = make_gen_batch(tokenizer, ["q1", "q2"])
    manager = LLMGenerationManager(tokenizer, engine, make_config(retrieval_url))
    asked = []
    manager.turn_version = lambda: asked.append(len(asked)) or 5 + len(asked)   # versions 6, 7, 8
    out = manager.run_llm_loop(gen_batch, prompts)
    assert asked == [0, 1, 2]
    obs1 = observation_ids(tokenizer, retrieval_url, "capital of France")
    obs2 = observation_ids(tokenizer, retrieval_url, "Eiffel Tower")
    versions = out.batch[K.TOKEN_VERSIONS]
    assert versions.shape == out.batch[K.RESPONSES].shape
    row0 = [6] * (len(s["search1"]) + len(obs1)) + [7] * (len(s["search2"]) + len(obs2)) + [8] * len(s["answer"])
    assert versions[0, : len(row0)].tolist() == row0 and (versions[0, len(row0):] == -1).all()
    row1 = [6] * len(s["rome"])   # the turn ends at </answer> (the EOS after it is not kept)
    assert versions[1, : len(row1)].tolist() == row1 and (versions[1, len(row1):] == -1).all()
    # without a version source nothing is recorded
    plain, _, _, _ = run(tokenizer, scripts, ["q1", "q2"], make_config(retrieval_url))
    assert K.TOKEN_VERSIONS not in plain.batch.keys()
