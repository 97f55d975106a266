"""Log-prob / entropy head benchmark: the plain chunked path vs the fused head.

What it measures, printed as one JSON object, for M positions x H hidden x V vocabulary (a
Qwen2.5-like vocabulary with a hidden size scaled down to fit a CPU):

- the bytes autograd saves for backward per position (parameters left out: the lm_head
  weight is saved by reference), via `torch.autograd.graph.saved_tensors_hooks`;
- the forward + backward wall time (median of `--repeats`).

"old" is the path the actor took before issue 21 item 19: lm_head -> / T ->
`logprobs_from_logits` + `entropy_from_logits` (chunked in the forward pass, but autograd
keeps each chunk's fp32 logits and softmax: O(V) bytes per position). "new" is
`verl.utils.logprob_head.log_probs_and_entropy`: it saves the hidden state and two floats per
position and recomputes each chunk's logits in backward (one extra matmul).

    python -m scripts.bench.logprob_head                              # V=151936, H=256, M=256
    python -m scripts.bench.logprob_head --dtype bfloat16 --tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from verl.utils import torch_functional as tf
from verl.utils.logprob_head import SavedTensorBytes, log_probs_and_entropy

Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def old_head(hidden_MH: torch.Tensor, weight_VH: torch.Tensor, labels_M: torch.Tensor,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous actor head: full (M, V) logits, then the chunked helpers."""
    logits_MV = F.linear(hidden_MH, weight_VH) / temperature
    return tf.logprobs_from_logits(logits_MV, labels_M), tf.entropy_from_logits(logits_MV)


def new_head(hidden_MH: torch.Tensor, weight_VH: torch.Tensor, labels_M: torch.Tensor,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs, entropy = log_probs_and_entropy(hidden_MH, weight_VH, None, labels_M, temperature, True)
    return log_probs, entropy


def measure(head: Head, tokens: int, hidden: int, vocab: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Saved bytes per token (first run) and the median forward + backward seconds."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype))
    hidden_MH = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    coef_lp, coef_ent = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    seconds, saved_bytes = [], 0
    for attempt in range(repeats):
        weight.grad = hidden_MH.grad = None
        start = time.perf_counter()
        with SavedTensorBytes(exclude=[weight]) as saved:
            log_probs, entropy = head(hidden_MH, weight, labels, 0.9)
            loss = (log_probs * coef_lp).sum() + (entropy * coef_ent).sum()
        loss.backward()
        seconds.append(time.perf_counter() - start)
        if attempt == 0:
            saved_bytes = saved.nbytes
        del log_probs, entropy, loss
    return {"saved_bytes_per_token": saved_bytes / tokens, "saved_mb": saved_bytes / 2**20,
            "fwd_bwd_s": statistics.median(seconds)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    old = measure(old_head, args.tokens, args.hidden, args.vocab, dtype, args.repeats)
    new = measure(new_head, args.tokens, args.hidden, args.vocab, dtype, args.repeats)
    return {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
                  "threads": args.threads},
        "old": old, "new": new,
        "saved_bytes_ratio_old_over_new": old["saved_bytes_per_token"] / new["saved_bytes_per_token"],
        "time_ratio_new_over_old": new["fwd_bwd_s"] / old["fwd_bwd_s"],
        "old_saved_bytes_per_token_per_vocab": old["saved_bytes_per_token"] / args.vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="positions M (response tokens of a micro-batch)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H (Qwen2.5-1.5B: 1536)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen2.5: 151936)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
