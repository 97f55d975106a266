"""Supervised fine-tuning with a per-token loss weight (the demo's warm start).

    python -m verl.trainer.fsdp_sft_trainer data.train_files=data/sft/train.parquet \
        model.partial_pretrain=/path/to/hf_model trainer.default_local_dir=checkpoints/sft
    torchrun --nproc_per_node=2 -m verl.trainer.fsdp_sft_trainer ...   # FSDP2, one shard per process

Rows are read by `verl.utils.dataset.sft_dataset`: multi-turn trajectories are tokenized
segment by segment, so each token's weight comes from the segment (prompt / policy /
observation) that produced it. The loss is the weighted token mean over the global batch.
With more than one process the model is sharded with FSDP2 (`fully_shard`, one unit per
decoder layer; gloo on CPU, nccl on GPU); a single process trains the plain module.
AdamW, linear warm-up then cosine decay. The result is an HF folder (safetensors +
tokenizer) that `from_pretrained`, the PPO trainer and infer.py load.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from tqdm import tqdm

from verl.utils.dataset.sft_dataset import SFTDataset, collate_right_padded
from verl.utils.torch_functional import get_cosine_schedule_with_warmup
from verl.utils.tracking import Tracking


@dataclass
class SFTResult:
    checkpoint_dir: Path
    steps: int
    final_loss: float
    wall_seconds: float
    history: list[dict] = field(default_factory=list)   # per logged step: metrics


CONFIG_DIR = Path(__file__).parent / "config"


def compose_sft_config(overrides: list[str] | None = None) -> DictConfig:
    """The config `python -m verl.trainer.fsdp_sft_trainer <overrides>` would see."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="sft_trainer", overrides=list(overrides or []))


def _init_distributed(device: torch.device) -> tuple[int, int]:
    from verl.utils.device import dist_backend_for

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=dist_backend_for(device))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be auto|cpu|cuda, got {name!r}")
    if name == "cuda":
        # Each torchrun process owns the GPU of its LOCAL_RANK; without set_device, FSDP2 and
        # NCCL would put every rank on cuda:0.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _global_sum(value: float, device: torch.device, world_size: int) -> float:
    """`value` summed over all ranks; the tensor lives on `device` (NCCL reduces CUDA tensors only)."""
    if world_size == 1:
        return value
    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: each decoder layer is its own unit, the root holds embeddings and head."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_state_dict(model: torch.nn.Module, world_size: int) -> dict[str, torch.Tensor]:
    if world_size == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def weighted_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], weight_total: float) -> torch.Tensor:
    """sum_t w_t * CE(token t | tokens < t) / weight_total (the global batch's weight sum).

    The output head and the cross-entropy run only at the positions that predict a weighted token
    in some row (transformers' `logits_to_keep`, through the model's own forward, so FSDP gathers
    the head as usual): with prompts and observations at weight 0, most positions of a multi-turn
    row, and the vocabulary-sized softmax is most of a small model's step."""
    # Token t is predicted from position t-1; its weight is the weight of token t.
    weight_BT = batch["loss_weight"][:, 1:]
    target_BT = batch["input_ids"][:, 1:]
    keep_K = torch.nonzero((weight_BT != 0).any(dim=0)).flatten()
    if keep_K.numel() == 0:     # nothing weighted in this micro-batch: one position keeps the graph whole
        keep_K = torch.zeros(1, dtype=torch.long, device=weight_BT.device)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": batch["position_ids"], "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits_BKV = model(**inputs, logits_to_keep=keep_K).logits
    else:                       # a model class without it (remote code): every position, then the kept ones
        logits_BKV = model(**inputs).logits[:, keep_K]
    ce_BK = torch.nn.functional.cross_entropy(logits_BKV.float().transpose(1, 2), target_BT[:, keep_K], reduction="none")
    return (ce_BK * weight_BT[:, keep_K]).sum() / weight_total


def _total_steps(cfg: DictConfig, batches_per_epoch: int) -> int:
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    return int(cfg.trainer.total_epochs) * batches_per_epoch


def run_sft(config: DictConfig) -> SFTResult:
    """Train per `config` (the sft_trainer.yaml schema) and save an HF checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    cfg = config
    if cfg.model.partial_pretrain is None:
        raise ValueError("model.partial_pretrain must name an HF model folder")
    if cfg.trainer.num_threads is not None:
        torch.set_num_threads(int(cfg.trainer.num_threads))
    device = _pick_device(cfg.trainer.device)
    rank, world_size = _init_distributed(device)
    torch.manual_seed(int(cfg.trainer.seed))

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.partial_pretrain,
                                              trust_remote_code=cfg.model.trust_remote_code)
    dataset = SFTDataset(
        OmegaConf.to_container(cfg.data.train_files) if not isinstance(cfg.data.train_files, str)
        else cfg.data.train_files,
        tokenizer, max_length=int(cfg.data.max_length),
        loss_weights=OmegaConf.to_container(cfg.data.loss_weights), prompt_key=cfg.data.prompt_key,
        response_key=cfg.data.response_key, truncation=cfg.data.truncation)

    global_bs, micro_bs = int(cfg.data.train_batch_size), int(cfg.data.micro_batch_size_per_gpu)
    if global_bs % (micro_bs * world_size) != 0:
        raise ValueError(f"data.train_batch_size={global_bs} must be a multiple of "
                         f"data.micro_batch_size_per_gpu={micro_bs} x world size {world_size}")
    accum = global_bs // (micro_bs * world_size)
    generator = torch.Generator().manual_seed(int(cfg.trainer.seed))
    sampler = (DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=int(cfg.trainer.seed))
               if world_size > 1 else RandomSampler(dataset, generator=generator))
    loader = DataLoader(dataset, batch_size=micro_bs, sampler=sampler, drop_last=True,
                        collate_fn=lambda ex: collate_right_padded(ex, tokenizer.pad_token_id))
    batches_per_epoch = len(loader) // accum
    if batches_per_epoch == 0:
        raise ValueError(f"{len(dataset)} rows are fewer than one global batch ({global_bs})")
    total_steps = _total_steps(cfg, batches_per_epoch)

    model = AutoModelForCausalLM.from_pretrained(cfg.model.partial_pretrain, dtype=torch.float32,
                                                 trust_remote_code=cfg.model.trust_remote_code).to(device)
    if cfg.model.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    if world_size > 1:
        model = _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas),
                                  weight_decay=float(cfg.optim.weight_decay))
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=int(math.ceil(float(cfg.optim.warmup_steps_ratio) * total_steps)),
        num_training_steps=total_steps, min_lr_ratio=float(cfg.optim.min_lr_ratio))

    out_dir = Path(cfg.trainer.default_local_dir)
    tracker = Tracking(cfg.trainer.project_name, cfg.trainer.experiment_name, list(cfg.trainer.logger),
                       config=cfg, log_dir=cfg.trainer.log_dir or out_dir / "logs") if rank == 0 else None
    history: list[dict] = []
    step, epoch, loss_value = 0, 0, float("nan")
    micro_iter = iter(loader)
    bar = tqdm(total=total_steps, desc="SFT steps", disable=rank != 0 or not cfg.trainer.get("progress_bar", False))
    while step < total_steps:
        micro_batches = []
        while len(micro_batches) < accum:
            try:
                micro_batches.append(next(micro_iter))
            except StopIteration:
                epoch += 1
                if isinstance(sampler, DistributedSampler):
                    sampler.set_epoch(epoch)
                micro_iter = iter(loader)
        # Normalise by the weight of the whole global batch, so accumulation and sharding
        # give the same gradient as one big batch.
        weight_total = _global_sum(sum(float(mb["loss_weight"][:, 1:].sum()) for mb in micro_batches),
                                   device, world_size)
        weight_total = max(weight_total, 1e-8)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in micro_batches:
            mb = {k: v.to(device) for k, v in mb.items()}
            # FSDP averages gradients over processes; scale back up to a global sum.
            loss = weighted_lm_loss(model, mb, weight_total) * world_size
            loss.backward()
            loss_sum += float(loss.detach()) / world_size
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.optim.clip_grad))
        optimizer.step()
        scheduler.step()
        step += 1
        bar.update(1)
        loss_value = _global_sum(loss_sum, device, world_size)
        if tracker is not None and (step % int(cfg.trainer.log_freq) == 0 or step == total_steps):
            metrics = {"train/loss": loss_value, "train/lr": scheduler.get_last_lr()[0],
                       "train/grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                                                else grad_norm),
                       "train/epoch": epoch}
            tracker.log(metrics, step)
            history.append({"step": step, **metrics})

    bar.close()
    state = _full_state_dict(model, world_size)
    hf_dir = out_dir / "huggingface"
    if rank == 0:
        save_hf_checkpoint(cfg.model.partial_pretrain, state, tokenizer, hf_dir)
        tracker.finish()
    if world_size > 1:
        dist.barrier()
    return SFTResult(hf_dir, step, loss_value, time.time() - start, history)


def save_hf_checkpoint(base_path: str, state: dict[str, torch.Tensor], tokenizer, out_dir: Path) -> Path:
    """Write `state` into a fresh copy of the base model's architecture, HF format, atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    config = AutoConfig.from_pretrained(base_path)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    shell.load_state_dict(state, assign=True, strict=False)
    shell.tie_weights()
    shell.generation_config.pad_token_id = tokenizer.pad_token_id
    shell.generation_config.eos_token_id = tokenizer.eos_token_id
    shell.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


# version_base 1.3: the job runs in the caller's directory, so relative data paths work.
@hydra.main(config_path="config", config_name="sft_trainer", version_base="1.3")
def main(config: DictConfig) -> None:
    result = run_sft(config)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"SFT done: {result.steps} steps, loss {result.final_loss:.4f}, "
              f"{result.wall_seconds:.0f}s; HF checkpoint at {result.checkpoint_dir}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
