"""Data-parallel loss scaling: a 2-rank FSDP update computes the single-process gradient (actor, critic).

FSDP averages gradients over the ranks, so each rank's micro-batch loss must be weighted by its
share of the GLOBAL mini-batch times the number of ranks (`tf.micro_batch_share`). Compared here
are the gradients themselves, taken before the optimizer step (values and norm): AdamW would hide
a gradient halved on 2 ranks, and gradient clipping would not.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import join_ranks, start_ranks
from tests.workers._batches import free_port, make_ppo_batch
from verl.utils import batch_keys as K
from verl.utils.fsdp_utils import apply_fsdp2
from verl.utils.model import load_value_model
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic

ROWS = 6        # the global mini-batch; each of the 2 ranks holds 3 rows (uneven token counts)


class _GradientRecorder(torch.optim.SGD):
    """An optimizer whose step only records the (full, unsharded) gradient of every parameter."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.named = list(module.named_parameters())
        super().__init__([p for _, p in self.named], lr=0.0)
        self.grads: list[dict[str, torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = {}
        for name, p in self.named:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = grad.detach().clone()
        self.grads.append(grads)


def _config(mini_batch_size: int, loss_agg_mode: str = "token-mean") -> Any:
    return OmegaConf.create({
        "ppo_mini_batch_size": mini_batch_size, "ppo_micro_batch_size": 1, "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 64, "grad_clip": None, "clip_ratio": 0.2, "entropy_coeff": 0.01,
        "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
        "loss_agg_mode": loss_agg_mode, "ppo_epochs": 1, "shuffle": False,
    })


def _batch(vocab: int, loss_agg_mode: str = "token-mean") -> Any:
    data = make_ppo_batch(vocab, batch_size=ROWS, seed=11)
    # A nonzero ratio and KL, so every loss term carries gradient.
    g = torch.Generator().manual_seed(3)
    data.batch[K.OLD_LOG_PROBS] = -3.0 - torch.rand(ROWS, data.batch[K.RESPONSES].shape[1], generator=g)
    data.batch[K.REF_LOG_PROB] = data.batch[K.OLD_LOG_PROBS] - 0.2
    data.meta_info.update({K.META_TEMPERATURE: 1.0})
    if loss_agg_mode != "token-mean":
        # a row rejected whole on rank 0 only: the ranks hold 2 and 3 rows of the seq-mean, and each
        # must weigh its rows by the global count (5), not its own
        data.batch[K.RESPONSE_MASK][1] = 0
    return data


def _critic_config(mini_batch_size: int) -> Any:
    return OmegaConf.create({
        "ppo_mini_batch_size": mini_batch_size, "ppo_micro_batch_size": 1, "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 64, "grad_clip": None, "cliprange_value": 0.5,
        "loss_agg_mode": "token-mean", "ppo_epochs": 1, "shuffle": False,
    })


def _load(role: str, model_dir: str) -> torch.nn.Module:
    if role == "actor":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)   # the value head is freshly initialised: the same one in every process
    return load_value_model(model_dir)


def _update(module: torch.nn.Module, data: Any, mini_batch_size: int,
            role: str = "actor", loss_agg_mode: str = "token-mean") -> tuple[dict[str, torch.Tensor], float]:
    optimizer = _GradientRecorder(module)
    if role == "actor":
        metrics = DataParallelPPOActor(_config(mini_batch_size, loss_agg_mode), module,
                                       optimizer).update_policy(data)
    else:
        metrics = DataParallelPPOCritic(_critic_config(mini_batch_size), module, optimizer).update_critic(data)
    assert len(optimizer.grads) == 1, "one mini-batch, one optimizer step"
    return optimizer.grads[0], metrics[f"{role}/grad_norm"][0]


def _two_rank_update(rank: int, port: int, model_dir: str, result_dir: str, role: str = "actor",
                     loss_agg_mode: str = "token-mean") -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        data = _batch(AutoConfig.from_pretrained(model_dir).vocab_size, loss_agg_mode)
        half = ROWS // 2
        shard = data[rank * half: (rank + 1) * half]
        module = apply_fsdp2(_load(role, model_dir), init_device_mesh("cpu", (2,)))
        grads, norm = _update(module, shard, mini_batch_size=half, role=role, loss_agg_mode=loss_agg_mode)
        if rank == 0:
            tokens = [float(data.batch[K.RESPONSE_MASK][r * half:(r + 1) * half].sum()) for r in range(2)]
            torch.save({"grads": grads, "norm": norm, "tokens": tokens}, os.path.join(result_dir, "two_rank.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _assert_two_ranks_match_one_process(role: str, model_dir: str, tmp_path: Any,
                                        loss_agg_mode: str = "token-mean") -> None:
    port = free_port()
    procs = start_ranks(_two_rank_update, lambda r: (r, port, model_dir, str(tmp_path), role, loss_agg_mode))

    # Meanwhile the reference: the whole mini-batch in this process, no process group, no FSDP.
    torch.set_num_threads(1)
    data = _batch(AutoConfig.from_pretrained(model_dir).vocab_size, loss_agg_mode)
    ref_grads, ref_norm = _update(_load(role, model_dir), data, mini_batch_size=ROWS, role=role,
                                  loss_agg_mode=loss_agg_mode)

    join_ranks(procs, tmp_path)
    got = torch.load(tmp_path / "two_rank.pt")
    assert got["tokens"][0] != got["tokens"][1], "the ranks must hold unequal token counts"
    assert ref_norm > 0
    assert abs(got["norm"] - ref_norm) <= 1e-4 * ref_norm, (got["norm"], ref_norm)
    assert set(got["grads"]) == set(ref_grads)
    for name, expected in ref_grads.items():
        torch.testing.assert_close(got["grads"][name], expected, rtol=0,
                                   atol=1e-7 + 1e-4 * float(expected.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow   # two spawned ranks load torch and the model: ~100 s on a busy 2-core machine
def test_two_rank_update_has_the_single_process_gradient(tiny_model_dir, tmp_path):
    _assert_two_ranks_match_one_process("actor", tiny_model_dir, tmp_path)


@pytest.mark.slow   # as above
def test_two_rank_seq_mean_update_with_a_row_rejected_whole_has_the_single_process_gradient(tiny_model_dir, tmp_path):
    _assert_two_ranks_match_one_process("actor", tiny_model_dir, tmp_path, "seq-mean-token-sum")


@pytest.mark.slow   # as above
def test_two_rank_critic_update_has_the_single_process_gradient(tiny_model_dir, tmp_path):
    _assert_two_ranks_match_one_process("critic", tiny_model_dir, tmp_path)
