"""rollout.mode=async through the real Ray worker group (FSDP actor workers, HF engine) and a real
BM25 server: the same batch as sync mode under greedy decoding, exact masks, failure observations,
and one GRPO step with search via run_ppo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from search_r1.llm_agent import actions
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from search_r1.prompt import make_prefix
from tests.trainer import test_search_e2e
from tests.trainer._search_model import QUESTIONS, TOPK
from tests.trainer.test_search_e2e import SearchWorld, _assert_searched_against_the_server, _run_with_search
from tests.workers._batches import actor_rollout_workers, free_port
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.utils.dataset.rl_dataset import prompt_to_text

search_world = test_search_e2e.search_world   # the module-scoped fixture: server, warmed-up model, data

RESPONSE_LENGTH = 40
N_ROWS = 5          # odd: the worker group pads the batch for its 2 workers and drops the padding


def rollout_workers(model_dir: str, engine: str):
    """Two real FSDP actor/rollout workers in Ray with the given engine."""
    return actor_rollout_workers(model_dir, **{
        "actor_rollout_ref.rollout.name": engine, "data.max_prompt_length": 512,
        "actor_rollout_ref.rollout.enforce_eager": True,    # vLLM: see tests/conftest.py, VLLM_ENGINES_IN_TESTS
        "data.max_response_length": RESPONSE_LENGTH, "actor_rollout_ref.rollout.micro_batch_size": 4})


@pytest.fixture(scope="module")
def rollout_group(ray_cluster, search_world: SearchWorld):
    with rollout_workers(search_world.model_dir, "hf") as group:
        yield group


def _tokenizer(world: SearchWorld):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world.model_dir)


def _gen_batch(tok) -> tuple[DataProto, torch.Tensor]:
    prompts = [tok.encode(prompt_to_text([{"role": "user", "content": make_prefix(QUESTIONS[i % 2].question)}], tok),
                          add_special_tokens=False) for i in range(N_ROWS)]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                         K.POSITION_IDS: position_ids_from_mask(mask)},
                                meta_info={K.META_DO_SAMPLE: True, K.META_TEMPERATURE: 0.7})
    return batch, ids


def _config(url: str, mode: str, **kw) -> GenerationConfig:
    return GenerationConfig(max_turns=2, max_start_length=160, max_prompt_length=512,
                            max_response_length=RESPONSE_LENGTH, max_obs_length=160, search_url=url, topk=TOPK,
                            mode=mode, **kw)


def _roll(group, world: SearchWorld, mode: str, validation: bool, **kw) -> DataProto:
    tok = _tokenizer(world)
    batch, ids = _gen_batch(tok)
    manager = LLMGenerationManager(tok, group, _config(f"{world.server_url}/retrieve", mode, **kw),
                                   is_validation=validation)
    return manager.run_llm_loop(batch, ids)


STAT_KEYS = ("turns_stats", "active_mask", "valid_action_stats", "valid_search_stats", "search_failures",
             "obs_truncated", "context_cuts", "generated_tokens", "kept_tokens", "stop_reasons")


def assert_greedy_async_equals_sync(group, world: SearchWorld) -> None:
    sync = _roll(group, world, "sync", validation=True)
    async_ = _roll(group, world, "async", validation=True)
    for key in (K.PROMPTS, K.RESPONSES, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.INFO_MASK, K.LOSS_MASK,
                K.CONTEXT_CUT_MASK):
        assert torch.equal(sync.batch[key], async_.batch[key]), key
    for key in STAT_KEYS:
        assert sync.meta_info[key] == async_.meta_info[key], key
    assert sum(async_.meta_info["valid_search_stats"]) > 0
    assert async_.meta_info["stop_reasons"]["answered"] == N_ROWS
    # Same logits up to the rounding of differently padded batches (float32, tiny model).
    assert torch.allclose(sync.batch[K.ROLLOUT_LOG_PROBS], async_.batch[K.ROLLOUT_LOG_PROBS], atol=1e-4)
    assert set(async_.meta_info["timing_s"]) == {"generate", "retrieval"}


def test_greedy_async_rollout_equals_sync_rollout(rollout_group, search_world: SearchWorld) -> None:
    assert_greedy_async_equals_sync(rollout_group, search_world)


def test_sampled_async_rollout_is_token_exact_with_exact_masks(rollout_group, search_world: SearchWorld) -> None:
    out = _roll(rollout_group, search_world, "async", validation=False)
    tok = _tokenizer(search_world)
    meta = out.meta_info
    # The engine stopped at the stop strings: every sampled id was kept, none re-encoded or cut.
    assert meta["generated_tokens"] == meta["kept_tokens"] == int(out.batch[K.LOSS_MASK].sum())
    width = out.batch[K.PROMPTS].shape[1]
    assert torch.equal(out.batch[K.INFO_MASK][:, width:], out.batch[K.LOSS_MASK])
    real = out.batch[K.ATTENTION_MASK][:, width:].bool()
    lp = out.batch[K.ROLLOUT_LOG_PROBS]
    for row in range(N_ROWS):
        loss_mask = out.batch[K.LOSS_MASK][row].bool()
        observation = out.batch[K.RESPONSES][row][real[row] & ~loss_mask].tolist()
        n_searches = meta["valid_search_stats"][row]
        assert tok.decode(observation).count("<information>") == n_searches
        # log-probs on exactly the sampled tokens
        assert bool((lp[row][~loss_mask] == 0).all()) and bool((lp[row][loss_mask] <= 0).all())
    assert sum(meta["stop_reasons"].values()) == N_ROWS


def test_unreachable_retriever_becomes_failure_observations(rollout_group, search_world: SearchWorld) -> None:
    tok = _tokenizer(search_world)
    batch, ids = _gen_batch(tok)
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    manager = LLMGenerationManager(tok, rollout_group, _config(dead, "async", retrieval_max_retries=0,
                                                               retrieval_timeout=5.0), is_validation=True)
    out = manager.run_llm_loop(batch, ids)
    searches = sum(out.meta_info["valid_search_stats"])
    assert searches > 0 and out.meta_info["search_failures"] == searches
    failure = actions.render_search_failure().strip()
    texts = [tok.decode(r) for r in out.batch[K.RESPONSES].tolist()]
    assert sum(t.count(failure) for t in texts) == searches


@pytest.mark.slow   # a run_ppo step with search: in CI's slow suite (the default suite's 15-minute goal)
def test_grpo_step_with_search_in_async_mode(ray_cluster, search_world: SearchWorld, tmp_path: Path) -> None:
    step, served = _run_with_search(search_world, tmp_path, "grpo", extra=["actor_rollout_ref.rollout.mode=async"])
    _assert_searched_against_the_server(step, served)
