"""ReMax's greedy baseline rollout (Li et al. 2023, arXiv:2310.10505) and the batch keys the
registered estimators may read, for the sync trainer (ray_trainer.RayPPOTrainer._rollout).

With `algorithm.adv_estimator=remax` each step first rolls out every prompt once more with sampling
off -- the same generation path as the sampled rollout (the generation manager with its searches,
or the plain engine call) -- scores it through the same path as the sampled rows (the reward
function, then DAPO's overlong shaping when on: reward_shaping.score_rollouts), and stores that
score on each of the prompt's sampled rows as `reward_baselines` (B,). veRL does the same (its
`gen_max` phase): one greedy rollout per prompt, before the prompts are repeated, its score repeated
onto the prompt's samples.
"""

from __future__ import annotations

from copy import deepcopy
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from verl.trainer.ppo.reward_shaping import OverlongBuffer, score_rollouts
from verl.utils import batch_keys as K

if TYPE_CHECKING:   # verl.protocol imports tensordict (and with it torch._dynamo): preflight's config checks read
    from verl.protocol import DataProto  # this module's settings without it

REMAX = "remax"
# batch tensors passed to every estimator that names them (veRL's names)
ESTIMATOR_BATCH_KEYS = (K.REWARD_BASELINES, K.OLD_LOG_PROBS, K.ROLLOUT_IS_WEIGHTS, K.SUM_PI_SQUARED)


def enabled(config: DictConfig) -> bool:
    """Whether the run needs the greedy baseline rollout."""
    return str(config.algorithm.adv_estimator) == REMAX


def greedy_baselines(trainer: Any, prompts: DataProto, step: int) -> torch.Tensor:
    """The reward of one greedy rollout per row of `prompts` (the batch before repeating), (P,).

    `trainer._generate(..., greedy=True)` runs the training rollout's path with do_sample false;
    `score_rollouts` scores it as the trainer scores the sampled rows (`trainer.reward_fn`, then the
    overlong penalty of reward_model.overlong_buffer), so baseline and samples are on one scale."""
    greedy_batch = deepcopy(prompts)
    output, _ = trainer._generate(greedy_batch, validation=False, step=step, greedy=True)
    config = trainer.config
    score_rollouts(trainer.reward_fn, output, OverlongBuffer.from_config(config), int(config.data.max_response_length))
    return output.batch[K.TOKEN_LEVEL_SCORES].float().sum(dim=-1)


def add_baselines(batch: DataProto, baselines_P: torch.Tensor, samples_per_prompt: int) -> None:
    """Each prompt's greedy score onto its samples (the rows `batch.repeat(interleave=True)` made)."""
    if baselines_P.shape[0] * samples_per_prompt != len(batch):
        raise ValueError(f"remax: {baselines_P.shape[0]} greedy baselines for {len(batch)} rows "
                         f"({samples_per_prompt} samples per prompt)")
    batch.batch[K.REWARD_BASELINES] = baselines_P.repeat_interleave(samples_per_prompt)


def estimator_batch_keys(batch: DataProto) -> dict[str, torch.Tensor]:
    """The optional batch tensors the estimator may take (veRL passes the same by name)."""
    keys = batch.batch.keys()
    return {key: batch.batch[key] for key in ESTIMATOR_BATCH_KEYS if key in keys}


def config_errors(cfg: DictConfig) -> list[str]:
    """Where the greedy baseline rollout is not wired: the pipelines."""
    if not enabled(cfg):
        return []
    pipeline = str(cfg.trainer.get("pipeline", "sync"))
    if pipeline != "sync":
        return [f"algorithm.adv_estimator=remax needs trainer.pipeline=sync (got {pipeline}): its greedy baseline "
                "rollout runs in the sync trainer's step; a pipeline's rollout pool generates the next batch "
                "while this one trains, and the greedy pass is not wired there"]
    return []
