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


def _saved_rank(rank: int, port: int, model_dir: str, adapter: str, out: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from verl.utils.lora import FrozenAdapter, LoraSpec, is_adapter_param, merged_state
        from verl.utils.model import build_causal_lm
        from verl.utils.sharded_init import load_sharded_model

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        # as the worker builds it from actor_rollout_ref.model (its own rank / alpha give way to the folder's)
        spec = LoraSpec.from_model_config({"lora_rank": 1, "lora_alpha": 1, "lora_adapter_path": adapter})
        module, _ = load_sharded_model(lambda: build_causal_lm(model_dir), model_dir, mesh, "cpu",
                                       prepare=lambda m: spec.inject(m), adapter=spec)
        ids = torch.tensor([[3, 17, 42, 5, 9, 11, 2, 8], [7, 7, 30, 1, 60, 4, 12, 99]])

        def log_probs() -> torch.Tensor:
            with torch.no_grad():
                return torch.log_softmax(module(input_ids=ids).logits.float(), dim=-1)

        found = {"start": log_probs()}
        merged = dict(merged_state(module))   # a collective: every rank
        if rank == 0:
            found["merged"] = merged
        frozen = FrozenAdapter(spec, module)
        generator = torch.Generator().manual_seed(rank)
        with torch.no_grad():   # training moved the adapter (each rank its own shard)
            for name, param in module.named_parameters():
                if is_adapter_param(name):
                    local = param.to_local()
                    local.add_(torch.randn(local.shape, generator=generator) * 0.05)
        found["moved"] = log_probs()
        with frozen.swapped_in(module):
            found["reference"] = log_probs()
        found["after"] = log_probs()
        torch.save(found, Path(out, f"{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - join_ranks reports it
        Path(out, f"{rank}.err").write_text(traceback.format_exc())


def test_a_saved_rslora_dora_adapter_loads_sharded_as_peft_loads_it_and_is_the_reference(tiny_model_dir: str,
                                                                                          tmp_path: Path) -> None:
    """lora_adapter_path through the sharded load on 2 ranks: an adapter PEFT saved with rsLoRA, DoRA and
    rank / alpha patterns computes PEFT's log-probs, merged too; the starting adapter swapped in for the
    reference (lora_reference=start_adapter) gives the starting policy's log-probs after the adapter moved,
    and the moved adapter is back, bit for bit, after the block."""
    from transformers import AutoModelForCausalLM

    from tests.utils.test_lora_saved import peft_log_probs, save_peft_adapter

    adapter = tmp_path / "adapter"
    save_peft_adapter(tiny_model_dir, adapter, r=4, lora_alpha=8, use_rslora=True, use_dora=True,
                      target_modules="all-linear", rank_pattern={"q_proj": 8}, alpha_pattern={"v_proj": 32})
    expected = peft_log_probs(tiny_model_dir, adapter)
    port = free_port()
    run_ranks(_saved_rank, lambda rank: (rank, port, tiny_model_dir, str(adapter), str(tmp_path)), tmp_path, world=2)
    for rank in (0, 1):
        found = torch.load(tmp_path / f"{rank}.pt")
        torch.testing.assert_close(found["start"], expected, rtol=1e-5, atol=1e-5)
        assert float((found["moved"] - found["start"]).abs().max()) > 1e-2
        torch.testing.assert_close(found["reference"], found["start"], rtol=0, atol=1e-6)
        torch.testing.assert_close(found["after"], found["moved"], rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert merged.load_state_dict(torch.load(tmp_path / "0.pt")["merged"], strict=False).unexpected_keys == []
    from tests.utils.test_lora_saved import log_probs

    torch.testing.assert_close(log_probs(merged), expected, rtol=1e-5, atol=1e-5)
