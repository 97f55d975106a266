"""Issue 13 items 9, 16, 11 on a real CUDA device (run by hand on a GPU machine; needs torch and
transformers only): python -m scripts.gpu_checks.issue13_rollout_and_reduce"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl.utils import seqlen_balancing
from verl.workers.rollout.hf_rollout import HFRollout, SamplingParams


class CharTokenizer:
    """Token i decodes to one letter: enough for the stop-string matcher."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def tiny_qwen2(vocab: int, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return Qwen2ForCausalLM(cfg).to("cuda", dtype).eval()


def item9_prompt_forward_memory() -> None:
    model = tiny_qwen2(151_936, torch.bfloat16)
    ids = torch.randint(0, 151_936, (64, 2048), device="cuda")
    for kwargs in ({"logits_to_keep": 1}, {}):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, **kwargs)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"item 9: prompt forward 64 x 2048, vocab 151936, bf16, {kwargs or 'full logits'}: "
              f"logits {tuple(out.logits.shape)}, peak extra {peak:.2f} GiB")
        del out


def item9_16_rollout() -> None:
    model = tiny_qwen2(512, torch.float32)
    rollout = HFRollout(model, {"response_length": 16}, CharTokenizer())
    torch.manual_seed(1)
    batch, prompt_len, steps = 8, 12, 16
    ids = torch.randint(0, 512, (batch, prompt_len), device="cuda")
    mask = torch.ones_like(ids)
    pos = torch.arange(prompt_len, device="cuda").expand(batch, -1)
    shapes: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(lambda m, a, o: shapes.append(tuple(o.logits.shape)))
    int_calls = [0]
    real_int = torch.Tensor.__int__

    def counting_int(self: torch.Tensor) -> int:
        int_calls[0] += 1
        return real_int(self)

    torch.Tensor.__int__ = counting_int
    try:
        params = SamplingParams(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, response_length=steps,
                                eos_token_ids=(-1,), pad_token_id=0, stop=("QQ",), ignore_eos=False)
        responses, response_mask, _ = rollout._generate_micro_batch(ids, mask, pos, params)
    finally:
        torch.Tensor.__int__ = real_int
        handle.remove()
    print(f"item 9: first forward logits {shapes[0]} (prompt {tuple(ids.shape)}); int() calls in the loop: "
          f"{int_calls[0]} (item 16)")
    assert shapes[0] == (batch, 1, 512) and int_calls[0] == 0
    with torch.no_grad():
        for row in range(batch):
            ref: list[int] = []
            for _ in range(steps):
                logits = model(input_ids=torch.cat([ids[row], torch.tensor(ref, device="cuda", dtype=torch.long)])[None]).logits
                ref.append(int(logits[0, -1].argmax()))
            n = int(response_mask[row].sum())
            got = responses[row, :n].tolist()
            assert got == ref[:n], (row, got, ref)
            text = CharTokenizer().decode(got)
            assert (n == steps) or text.endswith("QQ") or "QQ" in text[-3:], (row, text)
    print("items 9, 16: cached greedy on CUDA equals full-logits uncached greedy for every row; stops honoured")


def item11_reduce_on_device() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        try:
            dist.all_reduce(torch.tensor([3]), op=dist.ReduceOp.MAX)
            print("item 11: NCCL-only group accepted a CPU tensor (unexpected)")
        except Exception as exc:  # noqa: BLE001 - we print what NCCL says
            print(f"item 11: NCCL-only group refuses a CPU tensor: {type(exc).__name__}: {str(exc)[:120]}")
        real_ws = seqlen_balancing.dist.get_world_size
        seqlen_balancing.dist.get_world_size = lambda *a, **k: 2   # take the multi-rank path on one GPU
        try:
            got = seqlen_balancing._agree_on_max(3, device=torch.device("cuda", 0))
        finally:
            seqlen_balancing.dist.get_world_size = real_ws
        assert got == 3
        print("item 11: _agree_on_max(3, device=cuda:0) reduced through the real NCCL group ->", got)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    item9_16_rollout()
    item11_reduce_on_device()
    item9_prompt_forward_memory()
    print("ALL OK")
