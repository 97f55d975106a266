"""A request's own decode budget (`max_tokens`) in the async rollout's step engines.

The tool protocol's trajectories each have what is left of their response budget; the async loop
passes it with every request (`AsyncEngine.generate(..., max_tokens=...)`), and the engine decodes
no more than that: no compute past a row's budget, nothing sampled past it to throw away.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers.test_hf_rollout import ROLLOUT_CFG, manual_greedy
from tests.workers.test_vllm_contract import FakeEngine, FakeParams
from verl.utils import batch_keys as K
from verl.workers.rollout.async_engine import AsyncEngine, request_max_tokens
from verl.workers.rollout.hf_rollout import HFRollout
from verl.workers.rollout.vllm_rollout import VLLMStepEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_request_budget_is_checked_against_the_engines_response_length():
    assert request_max_tokens("r", None, 12) == 12
    assert request_max_tokens("r", 1, 12) == 1 and request_max_tokens("r", 12, 12) == 12
    for bad in (0, 13):
        with pytest.raises(ValueError, match=rf"^request r7: max_tokens must be in \[1, response_length=12\], "
                                             rf"got {bad}$"):
            request_max_tokens("r7", bad, 12)


def test_hf_step_engine_stops_each_request_at_its_own_budget(model_and_tokenizer):
    model, tok = model_and_tokenizer
    meta = {K.META_EOS_TOKEN_ID: -1, K.META_PAD_TOKEN_ID: tok.pad_token_id, K.META_DO_SAMPLE: False}
    rollout = HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, "response_length": 12}), tok)
    engine = AsyncEngine(rollout.step_engine(meta))
    prompts = [tok(text)["input_ids"] for text in ("Paris", "a b c", "The quick brown fox")]
    budgets = [3, None, 7]

    async def main():
        return await asyncio.gather(*(engine.generate(p, seed=0, max_tokens=b)
                                      for p, b in zip(prompts, budgets, strict=True)))

    outs = asyncio.run(main())
    assert [len(out.token_ids) for out in outs] == [3, 12, 7]
    for prompt, out in zip(prompts, outs, strict=True):     # the same greedy tokens, only fewer
        assert out.token_ids == manual_greedy(model, prompt, len(out.token_ids))
        assert len(out.log_probs) == len(out.token_ids)
    assert engine.steps == 12 and not engine.engine._max_tokens    # nothing left behind

    step_engine = rollout.step_engine(meta)
    with pytest.raises(ValueError, match="request 9: max_tokens must be in"):
        step_engine.add("9", prompts[0], seed=0, max_tokens=13)
    step_engine.add("1", prompts[0], seed=0, max_tokens=2)
    step_engine.abort(["1"])
    assert not step_engine._max_tokens and not step_engine.has_unfinished()


def test_vllm_step_engine_gives_each_request_its_budget():
    engine = FakeEngine([])
    shared = FakeParams(temperature=0.0, max_tokens=12)
    step = VLLMStepEngine(engine, shared, "3-", seeded=False)
    step.add("0", [3, 4], seed=1)
    step.add("1", [3, 4], seed=1, max_tokens=5)
    assert engine.requests["3-0"] is shared                     # no budget: the call's params as they are
    assert engine.requests["3-1"].max_tokens == 5 and shared.max_tokens == 12
    seeded = VLLMStepEngine(engine, FakeParams(temperature=1.0, max_tokens=12), "4-", seeded=True)
    seeded.add("0", [3], seed=11, max_tokens=4)
    assert (engine.requests["4-0"].seed, engine.requests["4-0"].max_tokens) == (11, 4)
    with pytest.raises(ValueError, match="request 2: max_tokens must be in"):
        step.add("2", [3], seed=1, max_tokens=13)
