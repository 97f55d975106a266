"""The GPU layout of a LoRA actor on 2 gloo ranks: the frozen base in bf16 beside the fp32 adapter in
the same FSDP2 units, under the bf16 mixed-precision policy the workers use on CUDA, with gradient
checkpointing. FSDP2 requires a uniform dtype among *trainable* parameters only: this checks that
the mix shards, gathers, back-propagates into the adapter alone (fp32 grads) and steps."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch

from tests.conftest import free_port, run_ranks


def _rank(rank: int, port: int, out: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from verl.utils.fsdp_utils import apply_fsdp2, gpu_mixed_precision
        from verl.utils.lora import LoraSpec, adapter_disabled, is_adapter_param

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        spec = LoraSpec(4, 8, "all-linear")
        spec.inject(model, frozen_dtype=torch.bfloat16)
        for name, module in model.named_modules():
            spec.init_adapter(name, module)
        model = apply_fsdp2(model, init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)), gpu_mixed_precision())
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(rank))
        model.train()
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        model.eval()
        with torch.no_grad():
            adapted = model(input_ids=ids).logits.float()
            with adapter_disabled(model):
                base = model(input_ids=ids).logits.float()
        named = dict(model.named_parameters())
        found = {"grads": grads, "adapters": sorted(n for n in named if is_adapter_param(n)),
                 "dtypes": {n: str(p.dtype) for n, p in named.items()},
                 "moved": float((adapted - base).abs().max())}
        Path(out, f"{rank}.json").write_text(json.dumps(found))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - join_ranks reports it
        Path(out, f"{rank}.err").write_text(traceback.format_exc())


def test_a_bf16_frozen_base_and_fp32_adapters_shard_train_and_step(tmp_path: Path) -> None:
    port = free_port()
    run_ranks(_rank, lambda rank: (rank, port, str(tmp_path)), tmp_path, world=2)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        adapters = found["adapters"]
        assert len(adapters) == 28   # 2 layers x 7 projections x (A, B)
        assert sorted(found["grads"]) == adapters and set(found["grads"].values()) == {"torch.float32"}
        assert {found["dtypes"][n] for n in adapters} == {"torch.float32"}
        assert {d for n, d in found["dtypes"].items() if n not in adapters} == {"torch.bfloat16"}
        # one AdamW step (lr 1e-2) moved lora_B off zero: the adapted logits differ from the base's
        assert found["moved"] > 1e-3
