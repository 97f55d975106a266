"""Continuous batching (async rollout engines): requests that join and leave between decode steps
get exactly what the batch engine gives them, and sampling depends only on each request's seed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers.test_hf_rollout import ROLLOUT_CFG, make_prompts, manual_greedy
from verl.utils import batch_keys as K
from verl.workers.rollout.async_engine import AsyncEngine, Completion
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.hf_step_engine import HFStepEngine

torch.set_num_threads(1)

PROMPTS = ["Question: where was the author born?", "Paris", "The quick brown fox jumps over",
           "a b c", "Question: who wrote the book about the river?"]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _rollout(model, tok, **cfg) -> HFRollout:
    return HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, **cfg}), tok)


def _meta(tok, **meta) -> dict:
    return {K.META_EOS_TOKEN_ID: tok.eos_token_id, K.META_PAD_TOKEN_ID: tok.pad_token_id,
            K.META_DO_SAMPLE: False, **meta}


async def _staggered(engine: AsyncEngine, prompts: list[list[int]], seeds: list[int]) -> list:
    """Request i is submitted after i engine steps, so rows join a batch already decoding."""
    async def one(i: int):
        while engine.steps < i:
            await asyncio.sleep(0)
        return await engine.generate(prompts[i], seed=seeds[i])

    # A first request keeps the engine stepping while the later ones wait for their turn.
    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def test_greedy_staggered_requests_equal_unbatched_decoding(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = [tok(text)["input_ids"] for text in PROMPTS]
    engine = AsyncEngine(_rollout(model, tok, response_length=12).step_engine(_meta(tok, **{K.META_EOS_TOKEN_ID: -1})))
    outs = asyncio.run(_staggered(engine, ids, seeds=[0] * len(ids)))
    for prompt, out in zip(ids, outs, strict=True):
        assert out.token_ids == manual_greedy(model, prompt, 12)
        assert len(out.log_probs) == 12
    # Later requests joined while earlier ones were decoding: fewer steps than one after another.
    assert engine.steps < 12 * len(ids)


def test_stop_strings_and_eos_end_a_request_where_the_batch_engine_ends_it(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = _rollout(model, tok, response_length=16)
    # A stop string made of text the tiny model writes greedily, so some rows stop early.
    probe = rollout.generate_sequences(make_prompts(tok, PROMPTS, **{K.META_EOS_TOKEN_ID: -1}))
    first_text = tok.decode(probe.batch[K.RESPONSES][0][:3].tolist())
    stop = first_text.strip()[:3] or "e"
    meta = _meta(tok, stop=[stop])
    batch_out = rollout.generate_sequences(make_prompts(tok, PROMPTS, **meta))
    mask = batch_out.batch[K.ATTENTION_MASK][:, -16:]
    expected = [r[m.bool()].tolist() for r, m in zip(batch_out.batch[K.RESPONSES], mask, strict=True)]
    assert any(len(e) < 16 for e in expected)     # the stop string ended at least one row
    engine = AsyncEngine(rollout.step_engine(meta))
    outs = asyncio.run(_staggered(engine, [tok(t)["input_ids"] for t in PROMPTS], [0] * len(PROMPTS)))
    assert [o.token_ids for o in outs] == expected
    batch_lp = [lp[m.bool()].tolist() for lp, m in zip(batch_out.batch[K.ROLLOUT_LOG_PROBS], mask, strict=True)]
    for got, want in zip(outs, batch_lp, strict=True):
        # Same logits up to float rounding of differently padded batches (float32, a tiny model).
        assert got.log_probs == pytest.approx(want, abs=1e-4)


def test_sampling_depends_on_the_request_seed_not_on_its_neighbours(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = _rollout(model, tok, response_length=10)
    meta = _meta(tok, **{K.META_DO_SAMPLE: True, K.META_EOS_TOKEN_ID: -1})
    ids = [tok(t)["input_ids"] for t in PROMPTS]
    seeds = [11, 22, 33, 44, 55]
    together = asyncio.run(_staggered(AsyncEngine(rollout.step_engine(meta)), ids, seeds))

    async def alone(i: int):
        return await AsyncEngine(rollout.step_engine(meta)).generate(ids[i], seed=seeds[i])

    for i in range(len(ids)):
        assert asyncio.run(alone(i)).token_ids == together[i].token_ids
    other_seed = asyncio.run(AsyncEngine(rollout.step_engine(meta)).generate(ids[0], seed=12345))
    assert other_seed.token_ids != together[0].token_ids


def test_max_num_seqs_bounds_the_running_batch(model_and_tokenizer):
    model, tok = model_and_tokenizer
    step_engine = _rollout(model, tok, response_length=6, micro_batch_size=2).step_engine(
        _meta(tok, **{K.META_EOS_TOKEN_ID: -1}))
    assert isinstance(step_engine, HFStepEngine)
    widths = []
    original = step_engine.step

    def recording_step():
        out = original()
        widths.append(len(step_engine._live) + len(out))
        return out

    step_engine.step = recording_step
    ids = [tok(t)["input_ids"] for t in PROMPTS]

    async def all_at_once():
        engine = AsyncEngine(step_engine)
        return await asyncio.gather(*(engine.generate(p, seed=0) for p in ids))

    outs = asyncio.run(all_at_once())
    assert max(widths) == 2
    assert [o.token_ids for o in outs] == [manual_greedy(model, p, 6) for p in ids]


def test_an_engine_error_reaches_every_waiting_request(model_and_tokenizer):
    model, tok = model_and_tokenizer
    step_engine = _rollout(model, tok).step_engine(_meta(tok))

    def broken_step():
        raise RuntimeError("engine died")

    step_engine.step = broken_step

    async def two():
        engine = AsyncEngine(step_engine)
        return await asyncio.gather(engine.generate([5, 6], seed=0), engine.generate([7], seed=0),
                                    return_exceptions=True)

    results = asyncio.run(two())
    assert all(isinstance(r, RuntimeError) and "engine died" in str(r) for r in results)


def test_per_request_generators_live_on_the_engines_device(model_and_tokenizer, monkeypatch):
    """On CUDA, multinomial over CUDA probabilities needs a CUDA generator: each request's generator
    is made on the device the module computes on (here: cpu; recorded, so a missing device fails)."""
    from verl.workers.rollout import hf_step_engine

    model, tok = model_and_tokenizer
    made_on: list[object] = []
    real_generator = torch.Generator

    def recording_generator(*args, **kwargs):
        made_on.append(kwargs.get("device", args[0] if args else None))
        return real_generator(*args, **kwargs)

    monkeypatch.setattr(hf_step_engine.torch, "Generator", recording_generator)
    engine = _rollout(model, tok, response_length=3).step_engine(_meta(tok, **{K.META_DO_SAMPLE: True}))
    engine.add("a", tok("Paris")["input_ids"], seed=1)
    engine.add("b", tok("a b c")["input_ids"], seed=2)
    engine.step()
    assert made_on == [engine.device, engine.device]


class _FailingStepEngine:
    """A step engine whose second step raises; records what it was asked to abort."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0

    def add(self, request_id, prompt_ids, seed, max_tokens=None):
        self.live.append(request_id)

    def has_unfinished(self):
        return bool(self.live)

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        self.live = [r for r in self.live if r not in request_ids]

    def step(self):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("engine broke")
        return []


def test_a_failing_engine_step_aborts_every_request_in_flight():
    step_engine = _FailingStepEngine()
    engine = AsyncEngine(step_engine)

    async def main():
        return await asyncio.gather(*(engine.generate([1, 2], seed=i) for i in range(3)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "engine broke" in str(r) for r in results)
    assert sorted(step_engine.aborted) == ["0", "1", "2"] and not step_engine.live


def test_hf_step_engine_abort_drops_waiting_and_decoding_requests(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _rollout(model, tok, response_length=8, micro_batch_size=8).step_engine(
        _meta(tok, **{K.META_EOS_TOKEN_ID: -1}))
    for name, text in (("a", "Paris"), ("b", "a b c"), ("c", "The quick brown fox jumps over")):
        engine.add(name, tok(text)["input_ids"], seed=0)
    engine.step()                              # a, b, c decoding
    engine.add("d", tok("Paris")["input_ids"], seed=0)
    engine.abort(["b", "d"])
    assert [live.request_id for live in engine._live] == ["a", "c"] and not engine._waiting
    finished = []
    while engine.has_unfinished():
        finished += [rid for rid, _ in engine.step()]
    assert sorted(finished) == ["a", "c"]


class _SlowStepEngine:
    """One request, finished by a step that takes `seconds`; records what happened, in which thread."""

    def __init__(self, seconds: float, off_loop: bool) -> None:
        self.seconds, self.steps_off_loop = seconds, off_loop
        self.events: list[str] = []
        self.step_threads: list[int] = []
        self._live: list[str] = []

    def add(self, request_id, prompt_ids, seed, max_tokens=None):
        self._live.append(request_id)

    def has_unfinished(self):
        return bool(self._live)

    def step(self):
        self.step_threads.append(threading.get_ident())
        self.events.append("step begins")
        time.sleep(self.seconds)
        self.events.append("step ends")
        done, self._live = self._live, []
        return [(rid, Completion([1], [0.0])) for rid in done]

    def abort(self, request_ids):
        self.events.append("abort")
        self._live = [r for r in self._live if r not in request_ids]


@pytest.mark.parametrize("off_loop", [True, False])
def test_a_step_off_the_loop_lets_other_coroutines_run_meanwhile(off_loop):
    """A search's HTTP exchange needs the event loop: stepped on the loop, it advanced once a step."""
    step_engine = _SlowStepEngine(0.3, off_loop)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await AsyncEngine(step_engine).generate([1], seed=0)
        task.cancel()
        return ticks

    ticks = asyncio.run(main())
    assert (step_engine.step_threads[0] != threading.get_ident()) == off_loop
    assert (ticks >= 5) == off_loop, ticks


def test_cancelling_waits_for_the_step_in_flight_before_aborting():
    step_engine = _SlowStepEngine(0.3, off_loop=True)

    async def main():
        engine = AsyncEngine(step_engine)
        request = asyncio.create_task(engine.generate([1], seed=0))
        while not step_engine.events:
            await asyncio.sleep(0.01)
        engine._runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(main())
    assert step_engine.events == ["step begins", "step ends", "abort"]
