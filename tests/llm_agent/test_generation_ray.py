"""The manager driving a real 2-worker Ray worker group that hosts the scripted engine."""

from __future__ import annotations

import pickle

import pytest
import torch

from scripts.bench.rollout import ScriptedRollout
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from tests.llm_agent.helpers import encode, make_gen_batch
from tests.llm_agent.scripted_worker import ScriptedRolloutWorker
from verl.utils import batch_keys as K


def scripts_for(tokenizer, n_rows: int) -> dict[str, list[list[int]]]:
    """Row i searches i % 3 times, then answers: rows finish at different turns."""
    enc = lambda s: encode(tokenizer, s)  # noqa: E731
    return {f"q{i}": [enc(f"<search> capital of row {i} </search>")] * (i % 3)
            + [enc(f"<answer> city {i} </answer>") + [tokenizer.eos_token_id]] for i in range(n_rows)}


def test_scripted_engine_survives_pickle_round_trip(tokenizer):
    engine = ScriptedRollout(tokenizer, scripts_for(tokenizer, 2))
    clone = pickle.loads(pickle.dumps(engine))
    batch, _ = make_gen_batch(tokenizer, ["q1"])
    batch.meta_info.update({K.META_EOS_TOKEN_ID: tokenizer.eos_token_id, K.META_PAD_TOKEN_ID: tokenizer.pad_token_id,
                            K.META_RESPONSE_LENGTH: 32, K.META_STOP: ["</search>"]})
    assert torch.equal(clone.generate_sequences(batch).batch[K.RESPONSES],
                       engine.generate_sequences(batch).batch[K.RESPONSES])


# 5 rows: the same path with more rows per worker (slow suite: the default suite keeps 3, one odd split)
@pytest.mark.parametrize("n_rows", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_batch_not_divisible_by_workers_rolls_out_like_one_engine(ray_cluster, tokenizer, retrieval_url, n_rows):
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    scripts = scripts_for(tokenizer, n_rows)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ScriptedRolloutWorker, tokenizer, scripts))
    config = GenerationConfig(max_turns=3, max_start_length=256, max_prompt_length=4096, max_response_length=32,
                              max_obs_length=1024, search_url=retrieval_url, topk=2)
    keys = [f"q{i}" for i in range(n_rows)]
    try:
        gen_batch, prompts = make_gen_batch(tokenizer, keys)
        out = LLMGenerationManager(tokenizer, group, config).run_llm_loop(gen_batch, prompts)
    finally:
        group.shutdown()
        pool.release()
    gen_batch, prompts = make_gen_batch(tokenizer, keys)
    local = LLMGenerationManager(tokenizer, ScriptedRollout(tokenizer, scripts), config).run_llm_loop(gen_batch, prompts)
    assert len(out) == n_rows
    for key in (K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.INFO_MASK, K.LOSS_MASK):
        assert torch.equal(out.batch[key], local.batch[key]), key
    assert out.meta_info["valid_search_stats"] == [i % 3 for i in range(n_rows)]
    assert out.meta_info["stop_reasons"]["answered"] == n_rows
