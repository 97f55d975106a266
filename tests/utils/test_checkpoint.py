"""Sharded checkpoints (2 gloo ranks): exact round trip of model, optimizer, schedule; HF export loads."""

from __future__ import annotations

import os
import traceback

import torch
from transformers import AutoModelForCausalLM

from tests.conftest import run_ranks
from tests.workers._batches import free_port

torch.set_num_threads(1)


def _train_step(module, optimizer, scheduler, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, module.config.vocab_size, (2, 10), generator=g)
    loss = module(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _local(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to_local().clone() for n, p in module.named_parameters()}


def _build(model_dir: str, mesh):
    from omegaconf import OmegaConf

    from verl.utils.fsdp_utils import apply_fsdp2, build_optimizer

    module = apply_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), mesh)
    optim_cfg = OmegaConf.create({"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01,
                                  "lr_warmup_steps_ratio": 0.5, "warmup_style": "cosine",
                                  "min_lr_ratio": 0.1, "total_training_steps": 10})
    optimizer, scheduler = build_optimizer(module, optim_cfg)
    return module, optimizer, scheduler


def _roundtrip(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        module, optimizer, scheduler = _build(model_dir, mesh)
        for step in range(3):
            _train_step(module, optimizer, scheduler, seed=step)
        ckpt = os.path.join(out_dir, "actor")
        hf_dir = os.path.join(out_dir, "hf")
        torch.manual_seed(1234 + rank)
        FSDPCheckpointManager(module, optimizer, scheduler, tok, hf_max_shard_mb=0.05).save_checkpoint(ckpt, global_step=3, hf_path=hf_dir)
        saved_params, saved_lr = _local(module), scheduler.get_last_lr()
        saved_rand = torch.rand(3)
        with torch.no_grad():  # logits of the saved model, for the HF-export comparison in the test
            logits = module(input_ids=torch.arange(3, 15).unsqueeze(0)).logits
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, "logits_step3.pt"))
        _train_step(module, optimizer, scheduler, seed=99)
        after_params = _local(module)

        # A fresh model / optimizer / schedule, restored from the shards, continues identically.
        module2, optimizer2, scheduler2 = _build(model_dir, mesh)
        step = FSDPCheckpointManager(module2, optimizer2, scheduler2, tok).load_checkpoint(ckpt)
        assert step == 3
        assert torch.equal(torch.rand(3), saved_rand), "torch RNG state not restored"
        assert scheduler2.get_last_lr() == saved_lr, (scheduler2.get_last_lr(), saved_lr)
        for name, value in _local(module2).items():
            assert torch.equal(value, saved_params[name]), f"model shard {name} differs after load"
        _train_step(module2, optimizer2, scheduler2, seed=99)
        for name, value in _local(module2).items():
            assert torch.equal(value, after_params[name]), f"{name} diverged after a step: optimizer state lost"
        assert os.path.exists(os.path.join(ckpt, f"extra_state_rank{rank}.pt"))

        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run_two_ranks(target, model_dir: str, out_dir) -> None:
    port = free_port()
    run_ranks(target, lambda r: (r, port, model_dir, str(out_dir)), out_dir)


def test_checkpoint_round_trips_model_optimizer_schedule_and_hf_export_loads(tiny_model_dir, tmp_path):
    _run_two_ranks(_roundtrip, tiny_model_dir, tmp_path)
    files = sorted(os.listdir(tmp_path / "actor"))
    assert "extra_state_rank0.pt" in files and "extra_state_rank1.pt" in files
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        hf_logits = exported(input_ids=torch.arange(3, 15).unsqueeze(0)).logits
    # Same weights and input, on the same CPU; only the module wrapper (FSDP vs plain HF) and
    # thread count differ, i.e. fp32 GEMM blocking: logits (|x| < ~5) move by ~1e-6. A wrong or
    # stale tensor in the export moves them by > 1e-2.
    torch.testing.assert_close(hf_logits, torch.load(tmp_path / "logits_step3.pt"), atol=1e-5, rtol=1e-5)
    # Streamed export: the ~0.4 MB model was flushed in several ~0.05 MB shards.
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert (tmp_path / "hf" / "tokenizer.json").exists() or (tmp_path / "hf" / "tokenizer_config.json").exists()


def _saved_dtypes(hf_dir) -> set[torch.dtype]:
    from safetensors import safe_open

    dtypes = set()
    for shard in hf_dir.glob("model-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            dtypes |= {f.get_tensor(name).dtype for name in f.keys()}
    return dtypes


def _config_dtype(hf_dir) -> str:
    import json

    saved = json.loads((hf_dir / "config.json").read_text())
    return saved.get("dtype") or saved.get("torch_dtype")


def test_hf_export_is_bf16_when_the_source_config_says_bf16(tiny_model_dir, tmp_path):
    """The workers load the model in fp32 (master weights); a checkpoint whose config.json says
    bfloat16 (as Qwen2.5's does) is exported in bf16, and its config says so."""
    import json
    import shutil

    from verl.utils.checkpoint.hf_export import export_hf_model

    source = tmp_path / "bf16_source"
    shutil.copytree(tiny_model_dir, source)
    config = json.loads((source / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (source / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    export_hf_model(model, None, str(tmp_path / "hf"))
    assert _saved_dtypes(tmp_path / "hf") == {torch.bfloat16}
    assert _config_dtype(tmp_path / "hf") == "bfloat16"
    assert model.config.dtype == torch.float32  # the live model's config is left alone
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert next(exported.parameters()).dtype == torch.bfloat16
    ids = torch.arange(3, 15).unsqueeze(0)
    with torch.no_grad():
        # bf16 keeps 8 bits of mantissa: the logits move by ~1e-2, a wrong tensor by far more.
        torch.testing.assert_close(exported(input_ids=ids).logits.float(), model(input_ids=ids).logits,
                                   atol=0.1, rtol=0.05)


def test_hf_export_keeps_fp32_for_an_fp32_model_trained_without_mixed_precision(tiny_model_dir, tmp_path):
    from verl.utils.checkpoint.hf_export import export_hf_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    export_hf_model(model, None, str(tmp_path / "hf"))
    assert _saved_dtypes(tmp_path / "hf") == {torch.float32}
    assert _config_dtype(tmp_path / "hf") == "float32"
    export_hf_model(model, None, str(tmp_path / "hf16"), dtype=torch.bfloat16)   # an explicit dtype wins
    assert _saved_dtypes(tmp_path / "hf16") == {torch.bfloat16} and _config_dtype(tmp_path / "hf16") == "bfloat16"


def test_hf_export_is_bf16_when_training_used_bf16_mixed_precision(tiny_model_dir, tmp_path):
    """FSDP2 with the GPU workers' policy (bf16 compute, fp32 master weights), here on one CPU rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl.utils.checkpoint.hf_export import export_dtype, export_hf_model
    from verl.utils.fsdp_utils import apply_fsdp2, gpu_mixed_precision

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        module = apply_fsdp2(model, init_device_mesh("cpu", (1,)), gpu_mixed_precision())
        assert next(module.parameters()).dtype == torch.float32 and export_dtype(module) == torch.bfloat16
        export_hf_model(module, None, str(tmp_path / "hf"))
    finally:
        dist.destroy_process_group()
    assert _saved_dtypes(tmp_path / "hf") == {torch.bfloat16}
    assert _config_dtype(tmp_path / "hf") == "bfloat16"
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").parameters()).dtype == torch.bfloat16
