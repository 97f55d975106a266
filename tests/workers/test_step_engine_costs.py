"""What one step of the async rollout's HF engine costs, counted (`RolloutCounters`): on a GPU these
counts, not the arithmetic, decide the step's wall time (docs/rollout.md "Sync and async on a GPU").

A step is one batched decode forward over every running row, one device-to-host copy, and one
draw per sampled row (its own generator) plus a constant for the batch, however many rows run
and however many join or leave; requests that continue a trajectory join in groups."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers.test_hf_rollout import ROLLOUT_CFG
from verl.utils import batch_keys as K
from verl.workers.rollout.counters import RolloutCounters
from verl.workers.rollout.hf_rollout import HFRollout

torch.set_num_threads(1)

TEXTS = ["Question: where was the author born?", "Paris", "The quick brown fox jumps over", "a b c",
         "Question: who wrote the book about the river?", "the river", "born in", "fox"]
STEPS = 5


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _engine(model, tok, response_length: int = STEPS, micro_batch_size: int = 16):
    rollout = HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, "response_length": response_length,
                                                 "micro_batch_size": micro_batch_size}), tok)
    # Sampled (each row its own generator), no EOS: every row runs the whole response_length.
    return rollout.step_engine({K.META_EOS_TOKEN_ID: -1, K.META_PAD_TOKEN_ID: tok.pad_token_id,
                                K.META_DO_SAMPLE: True})


def _run(model, tok, rows: int) -> RolloutCounters:
    """`rows` requests joining together; forwards counted from the start, host syncs and ops over
    the decoding steps after the first (the first one also admits them: prompts laid out on the host)."""
    engine = _engine(model, tok)
    with RolloutCounters(model) as counts:
        for i in range(rows):
            engine.add(str(i), tok(TEXTS[i])["input_ids"], seed=100 + i)
        finished = engine.step()
        counts.watch(engine, "step")
        while engine.has_unfinished():
            finished += engine.step()
    assert len(finished) == rows and all(len(c.token_ids) == STEPS for _, c in finished)
    return counts


def test_a_step_is_one_forward_one_host_copy_and_one_draw_per_row(model_and_tokenizer):
    model, tok = model_and_tokenizer
    few, many = _run(model, tok, 2), _run(model, tok, 8)
    watched_steps = STEPS - 1
    for counts, rows in ((few, 2), (many, 8)):
        # One prefill for the rows that joined together, then one decode forward a step (the last
        # step samples and finishes every row: nothing left to decode).
        assert (counts.prefill_forwards, counts.decode_forwards) == (1, STEPS - 1)
        assert counts.decode_rows == rows * (STEPS - 1)
        # One device->host copy a step, whatever the rows (ids and log-probs together).
        assert counts.host_syncs_outside_forward == watched_steps, counts.sync_names
    # Six more rows cost six more draws a step (each row's own generator), nothing else.
    extra_per_step = (many.ops_outside_forward - few.ops_outside_forward) / watched_steps
    assert extra_per_step <= 6, (few.op_names, many.op_names)


def test_rows_joining_and_leaving_read_nothing_back_from_the_device(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _engine(model, tok, response_length=8)
    with RolloutCounters(model) as counts:
        counts.watch(engine, "step")
        counts.watch(engine, "abort")
        for i in range(6):
            engine.add(str(i), tok(TEXTS[i])["input_ids"], seed=i)
        engine.step()
        engine.step()
        engine.abort(["0", "3"])                    # two rows leave: their columns and cache rows go
        engine.step()
        for i in range(6, 8):                        # two join the running batch (left-padded, stacked)
            engine.add(str(i), tok(TEXTS[i])["input_ids"], seed=i)
        steps = 3
        while engine.has_unfinished():
            engine.step()
            steps += 1
    assert counts.prefill_forwards == 2
    assert counts.host_syncs_outside_forward == steps, counts.sync_names


def test_continuations_wait_for_their_cohort_or_for_a_group_worth_a_forward(model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = _engine(model, tok, response_length=16)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    with RolloutCounters(model) as counts:
        for name in ("a", "b", "c"):
            engine.add(name, ids[0], seed=0)
        engine.step()                                # cohort 0: a, b, c
        engine.add("x", ids[1], seed=0)
        engine.add("y", ids[2], seed=0)
        engine.step()                                # first requests follow nothing: cohort 1 at once
        assert [live.cohort for live in engine._live] == [0, 0, 0, 1, 1]
        engine.abort(["a"])                          # a finished its turn; its next one arrives
        engine.add("a2", ids[3], seed=0, after_cohort=0)
        engine.step()
        # b and c (a's cohort) still decode, and one request is not worth a forward for four rows.
        assert [w.request_id for w in engine._waiting] == ["a2"] and counts.prefill_forwards == 2
        engine.abort(["b", "c"])                     # a's cohort is done: sync mode would start the next turn
        engine.step()
        assert not engine._waiting and counts.prefill_forwards == 3
        assert [live.request_id for live in engine._live] == ["x", "y", "a2"]
        # A straggler: as many wait as decode, so they join though their cohort (a2's) still runs.
        engine.abort(["x", "y"])
        engine.add("x2", ids[4], seed=0, after_cohort=2)
        engine.step()
        assert not engine._waiting and counts.prefill_forwards == 4
