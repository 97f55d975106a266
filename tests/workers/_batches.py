"""Synthetic PPO batches and config nodes for the worker tests (no rollout needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from omegaconf import OmegaConf

from tests.conftest import free_port as free_port  # re-exported: a port below the ephemeral range
from verl.protocol import DataProto
from verl.utils import batch_keys as K

CONFIG_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "verl", "trainer", "config", "ppo_trainer.yaml")


def load_trainer_config(model_path: str, **overrides: object):
    """The real ppo_trainer.yaml with the model path set and dotted `overrides` applied."""
    cfg = OmegaConf.load(CONFIG_PATH)
    cfg.actor_rollout_ref.model.path = model_path
    cfg.critic.model.path = model_path
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


@contextmanager
def actor_rollout_workers(model_path: str, workers: int = 2, **overrides: object) -> Iterator[Any]:
    """`workers` real FSDP actor/rollout workers in Ray (role actor_rollout), models loaded, over the
    trainer config with `overrides`; shut down and their bundles released on exit."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_trainer_config(model_path, **overrides)
    OmegaConf.resolve(cfg)
    pool = RayResourcePool([workers], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref,
                                                      role="actor_rollout"))
    try:
        group.init_model()
        yield group
    finally:
        group.shutdown()
        pool.release()


def make_ppo_batch(vocab_size: int, batch_size: int = 6, prompt_len: int = 8, response_len: int = 6,
                   seed: int = 0, pad_id: int = 0) -> DataProto:
    """Left-padded prompts + right-padded responses of varying lengths, with PPO tensors filled in."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, prompt_len + 1, (batch_size,), generator=g)
    resp_lens = torch.randint(1, response_len + 1, (batch_size,), generator=g)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_lens[:, None]).long()
    resp_mask = (torch.arange(response_len) < resp_lens[:, None]).long()
    prompts = torch.randint(3, vocab_size, (batch_size, prompt_len), generator=g) * prompt_mask + pad_id * (1 - prompt_mask)
    responses = torch.randint(3, vocab_size, (batch_size, response_len), generator=g) * resp_mask + pad_id * (1 - resp_mask)
    attention_mask = torch.cat([prompt_mask, resp_mask], dim=-1)
    position_ids = (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0)
    # A policy-token mask with an "observation" hole in some rows, as state masking makes.
    response_mask = resp_mask.clone()
    response_mask[::2, 1:2] = 0
    tensors = {
        K.PROMPTS: prompts,
        K.RESPONSES: responses,
        K.INPUT_IDS: torch.cat([prompts, responses], dim=-1),
        K.ATTENTION_MASK: attention_mask,
        K.POSITION_IDS: position_ids,
        K.RESPONSE_MASK: response_mask,
        K.ADVANTAGES: torch.randn(batch_size, response_len, generator=g) * resp_mask,
        K.RETURNS: torch.randn(batch_size, response_len, generator=g) * resp_mask,
        K.VALUES: torch.zeros(batch_size, response_len),
        K.OLD_LOG_PROBS: torch.zeros(batch_size, response_len),
        K.REF_LOG_PROB: torch.zeros(batch_size, response_len),
    }
    return DataProto.from_dict(tensors=tensors)
