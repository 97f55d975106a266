"""A single-turn toy task for CPU training runs: tests, the train-step benchmark.

The prompt asks the model to say a target word; the rule reward is 1 when the
sampled response (up to EOS) contains the target token, else 0. With a tiny,
randomly initialised model the word appears by chance in a few percent of
responses, which gives GRPO a signal to amplify.

    paths = write_toy_parquets("/tmp/toy", n_train=16, n_val=4)
    overrides = toy_overrides(model_dir, paths, "/tmp/toy/ckpt", adv_estimator="grpo")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from verl.utils import batch_keys as K

TOY_DATA_SOURCE = "toy_contains"
TARGET_WORD = "<answer>"          # an action tag: always a single token in verl.utils.tiny_model


@dataclass(frozen=True)
class ToyPaths:
    train: str
    val: str


def _rows(n: int, split: str, offset: int) -> list[dict[str, Any]]:
    return [{
        "data_source": TOY_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Say {TARGET_WORD} please. Question {offset + i}?"}],
        "ability": "toy",
        "reward_model": {"style": "rule", "ground_truth": {"target": [TARGET_WORD]}},
        "extra_info": {"split": split, "index": offset + i},
    } for i in range(n)]


def write_toy_parquets(folder: str | Path, n_train: int = 16, n_val: int = 4) -> ToyPaths:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, val = folder / "train.parquet", folder / "val.parquet"
    pd.DataFrame(_rows(n_train, "train", 0)).to_parquet(train)
    pd.DataFrame(_rows(n_val, "test", n_train)).to_parquet(val)
    return ToyPaths(str(train), str(val))


class ContainsTokenReward:
    """token_level_scores (B, R): 1 on the last real response token when the target token was sampled."""

    def __init__(self, tokenizer: Any, word: str = TARGET_WORD) -> None:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"ContainsTokenReward: {word!r} is {len(ids)} tokens; it must be a single token")
        self.token_id = ids[0]
        self.last_metrics: dict[str, float] = {}

    def __call__(self, data: Any) -> torch.Tensor:
        responses = data.batch[K.RESPONSES]
        width = responses.shape[-1]
        mask_BR = data.batch[K.ATTENTION_MASK][:, -width:].bool()
        hit_B = ((responses == self.token_id) & mask_BR).any(-1).float()
        scores_BR = torch.zeros(responses.shape, dtype=torch.float32)
        last = (mask_BR.long().sum(-1) - 1).clamp(min=0)
        scores_BR[torch.arange(len(hit_B)), last] = hit_B
        self.last_metrics = {"reward/hit_rate": hit_B.mean().item()}
        return scores_BR


def toy_overrides(model_dir: str, paths: ToyPaths, ckpt_dir: str, adv_estimator: str = "grpo",
                  n_workers: int = 2, batch_size: int = 4, n_agent: int = 2, response_length: int = 8,
                  steps: int = 1, val_before_train: bool = False) -> list[str]:
    """Hydra overrides for a tiny CPU run (hf rollout, do_search=false, jsonl logging)."""
    rollouts = batch_size * n_agent
    overrides = [
        f"data.train_files={paths.train}", f"data.val_files={paths.val}",
        f"data.train_batch_size={batch_size}", f"data.val_batch_size={batch_size}",
        "data.max_start_length=32", "data.max_prompt_length=64", f"data.max_response_length={response_length}",
        f"algorithm.adv_estimator={adv_estimator}",
        f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n_agent={n_agent}", "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.micro_batch_size={rollouts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rollouts}",  # counts rollouts: one optimizer step
        f"actor_rollout_ref.actor.ppo_micro_batch_size={rollouts}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size={rollouts}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size={rollouts}",
        f"critic.ppo_micro_batch_size={rollouts}",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=" + ("true" if adv_estimator == "grpo" else "false"),
        f"trainer.n_gpus_per_node={n_workers}", "trainer.nnodes=1", "trainer.device=cpu",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={ckpt_dir}",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.progress_bar=false", "trainer.save_hf_model=false",
        "reward_model.num_examine=0", "do_search=false",
        f"+trainer.val_before_train={str(val_before_train).lower()}",
    ]
    return overrides
