"""DAPO pieces: overlong reward shaping (reward_shaping.py) and dynamic sampling (dynamic_sampling.py):
group filtering, accumulation over generation batches, trimming, the cap, the config rules."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from verl.protocol import DataProto
from verl.trainer.config_check import config_errors
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.dynamic_sampling import (
    DynamicSamplingError,
    DynamicSamplingTraining,
    FilterGroups,
    GroupCollector,
    concat_padded,
    kept_rows,
)
from verl.trainer.ppo.reward_shaping import OverlongBuffer, overlong_penalty, score_rollouts
from verl.utils import batch_keys as K

PAD = 7


# --------------------------------------------------------------------------- overlong shaping
def test_overlong_penalty_matches_hand_computed_values() -> None:
    # max 100, buffer 20: no penalty up to 80 tokens, then -(len - 80) / 20 * factor
    lengths = torch.tensor([0, 50, 80, 81, 90, 100])
    got = overlong_penalty(lengths, max_response_length=100, buffer_len=20, penalty_factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -1.0])
    half = overlong_penalty(lengths, 100, 20, 0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.025, -0.25, -0.5])


def _scored_batch(mask_BR: torch.Tensor, uids: list[str]) -> DataProto:
    return DataProto.from_dict(tensors={K.RESPONSE_MASK: mask_BR.clone(), K.RESPONSES: torch.ones_like(mask_BR)},
                               non_tensors={K.UID: np.array(uids, dtype=object)})


def _last_token_scores(values: list[float]) -> Any:
    """A reward function putting values[i] on row i's last policy token."""
    def reward_fn(batch: DataProto) -> torch.Tensor:
        mask = batch.batch[K.RESPONSE_MASK]
        scores = torch.zeros(mask.shape)
        for row, value in enumerate(values):
            scores[row, int(torch.nonzero(mask[row]).max())] = value
        return scores
    return reward_fn


def test_overlong_shaping_counts_the_longest_turn_and_lands_on_the_last_policy_token() -> None:
    # tag protocol: max_response_length 8 bounds each turn; buffer 4: from the 5th token, -0.25 a token.
    mask = torch.tensor([
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],     # one turn of 6: -0.5
        [1, 1, 0, 0, 0, 0, 0, 0, 1, 1],     # two turns of 2 around an observation: no penalty
        [1, 1, 1, 1, 1, 1, 1, 1, 0, 0],     # 8: -1.0
        [1, 1, 1, 1, 0, 0, 1, 1, 1, 1],     # 8 policy tokens, but turns of 4: no penalty
    ])
    batch = _scored_batch(mask, ["a", "a", "b", "b"])
    shaping = OverlongBuffer(enable=True, len=4, penalty_factor=1.0, log=True)
    metrics = score_rollouts(_last_token_scores([1.0, 1.0, 0.0, 0.0]), batch, shaping, 8, row_values=True)
    scores = batch.batch[K.TOKEN_LEVEL_SCORES]
    assert scores[0, 5].item() == pytest.approx(0.5) and scores[1, 9].item() == pytest.approx(1.0)
    assert scores[2, 7].item() == pytest.approx(-1.0)
    assert scores.sum(-1).tolist() == pytest.approx([0.5, 1.0, -1.0, 0.0])   # nothing anywhere else
    assert batch.non_tensor_batch["score"].tolist() == [1.0, 1.0, 0.0, 0.0]     # before shaping
    assert batch.non_tensor_batch["seq_reward"].tolist() == pytest.approx([0.5, 1.0, -1.0, 0.0])
    assert batch.non_tensor_batch["acc"].tolist() == [1.0, 1.0, 0.0, 0.0]      # no EM breakdown: the score
    assert metrics["reward/overlong_reward_mean"] == pytest.approx(-1.5 / 4)
    assert metrics["reward/overlong_fraction"] == pytest.approx(2 / 4)


def test_tool_protocol_overlong_counts_the_whole_response_with_tool_messages() -> None:
    # veRL's length: every real response token. 3 policy + 4 tool-message tokens = 7 of max 8, buffer 4: -0.75
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 0]])
    batch = _scored_batch(mask, ["a"])
    batch.batch[K.ATTENTION_MASK] = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]])   # 2 prompt + 8 response
    cfg = compose_config(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                          "data.max_response_length=8", "actor_rollout_ref.rollout.multi_turn.enable=true"])
    shaping = OverlongBuffer.from_config(cfg)
    assert shaping.whole_response
    score_rollouts(_last_token_scores([1.0]), batch, shaping, 8)
    assert batch.batch[K.TOKEN_LEVEL_SCORES][0, 6].item() == pytest.approx(0.25)


def test_shaping_off_leaves_the_scores_and_writes_no_row_values() -> None:
    batch = _scored_batch(torch.ones(2, 6, dtype=torch.long), ["a", "a"])
    score_rollouts(_last_token_scores([1.0, 0.0]), batch, OverlongBuffer(), 6)
    assert batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 0.0]
    assert "acc" not in batch.non_tensor_batch


def test_overlong_buffer_keys_are_checked() -> None:
    cfg = compose_config(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                          "data.max_response_length=8", "reward_model.overlong_buffer.penalty_factor=0.5"])
    assert OverlongBuffer.from_config(cfg) == OverlongBuffer(enable=True, len=4, penalty_factor=0.5, log=False,
                                                             whole_response=False)
    bad = compose_config(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=9",
                          "data.max_response_length=8"])
    assert any("reward_model.overlong_buffer.len=9" in e for e in config_errors(bad))


# --------------------------------------------------------------------------- filtering
def test_groups_whose_metric_is_all_equal_are_dropped_singletons_kept() -> None:
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert kept_rows(uids, values).tolist() == [True, True, False, False, True, False, False]


def _gen_batch(groups: dict[str, list[float]], prompt_w: int = 3, resp_w: int = 4) -> DataProto:
    """Rows grouped by uid; metric `acc` per row; prompts left-padded, responses right-padded."""
    uids = [uid for uid, vals in groups.items() for _ in vals]
    acc = [v for vals in groups.values() for v in vals]
    b = len(uids)
    resp = torch.arange(1, b * resp_w + 1).reshape(b, resp_w)
    prompts = torch.full((b, prompt_w), 100)
    mask = torch.ones(b, prompt_w + resp_w, dtype=torch.long)
    return DataProto.from_dict(
        tensors={K.PROMPTS: prompts, K.RESPONSES: resp, K.INPUT_IDS: torch.cat([prompts, resp], 1),
                 K.ATTENTION_MASK: mask, K.POSITION_IDS: torch.arange(prompt_w + resp_w).expand(b, -1).clone(),
                 K.RESPONSE_MASK: torch.ones(b, resp_w, dtype=torch.long)},
        non_tensors={K.UID: np.array(uids, dtype=object), "acc": np.array(acc)})


def test_collector_accumulates_over_generation_batches_and_trims_to_whole_groups() -> None:
    sampling = FilterGroups(enable=True, metric="acc", max_num_gen_batches=0, gen_batch_size=3)
    collector = GroupCollector(sampling, train_batch_size=3, pad_token_id=PAD)
    collector.add(_gen_batch({"a": [1, 0], "b": [1, 1], "c": [0, 0]}))          # keeps a
    assert not collector.ready
    collector.check_cap()                                                         # no cap: no error
    collector.add(_gen_batch({"d": [0, 1], "e": [0, 0], "f": [1, 0]}, prompt_w=2, resp_w=6))   # keeps d, f
    collector.add(_gen_batch({"g": [1, 0], "h": [1, 1], "i": [0, 1]}))           # keeps g, i: 5 >= 3
    assert collector.ready
    batch, metrics = collector.take()
    assert batch.non_tensor_batch[K.UID].tolist() == ["a", "a", "d", "d", "f", "f"]
    assert metrics["train/num_gen_batches"] == 3.0
    assert metrics["train/filter_groups/generated"] == 9.0
    assert metrics["train/filter_groups/kept"] == 5.0
    assert metrics["train/filter_groups/filtered"] == 4.0
    assert metrics["train/filter_groups/filtered_ratio"] == pytest.approx(4 / 9)
    assert metrics["train/filter_groups/unused"] == 2.0
    # padded to the widest prompt (3, left) and response (6, right)
    assert batch.batch[K.PROMPTS].shape == (6, 3) and batch.batch[K.RESPONSES].shape == (6, 6)
    assert batch.batch[K.RESPONSES][0].tolist() == [1, 2, 3, 4, PAD, PAD]
    assert batch.batch[K.ATTENTION_MASK][2].tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert batch.batch[K.INPUT_IDS][2, 0].item() == PAD
    assert batch.batch[K.RESPONSE_MASK][0].tolist() == [1, 1, 1, 1, 0, 0]
    assert collector.num_gen_batches == 0 and collector.kept == 0    # reset for the next step


def test_cap_with_too_few_groups_raises_naming_the_key() -> None:
    sampling = FilterGroups(enable=True, metric="acc", max_num_gen_batches=2, gen_batch_size=2)
    collector = GroupCollector(sampling, train_batch_size=2, pad_token_id=PAD)
    collector.add(_gen_batch({"a": [1, 1], "b": [0, 1]}))
    collector.check_cap()
    collector.add(_gen_batch({"c": [0, 0], "d": [1, 1]}))
    with pytest.raises(DynamicSamplingError, match=r"kept 1 groups.*max_num_gen_batches=2"):
        collector.check_cap()


def test_concat_padded_pads_positions_on_and_keeps_equal_widths() -> None:
    narrow, wide = _gen_batch({"a": [1, 0]}, resp_w=2), _gen_batch({"b": [1, 0]}, resp_w=4)
    out = concat_padded([narrow, wide], PAD)
    assert out.batch[K.POSITION_IDS][0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    same = concat_padded([narrow, narrow], PAD)
    assert torch.equal(same.batch[K.RESPONSES][:2], narrow.batch[K.RESPONSES])


def test_concat_padded_pads_every_key_a_multi_turn_rollout_carries() -> None:
    # the tag / tool protocols' extra keys: info_mask (whole sequence), loss_mask, engine log-probs and
    # token versions (response); versions pad with -1 (no version), the rest with 0
    parts = []
    for prompt_w, resp_w in ((2, 3), (3, 5)):
        part = _gen_batch({f"g{prompt_w}": [1, 0]}, prompt_w=prompt_w, resp_w=resp_w)
        part.batch[K.INFO_MASK] = torch.ones(2, prompt_w + resp_w, dtype=torch.long)
        part.batch[K.LOSS_MASK] = torch.ones(2, resp_w, dtype=torch.long)
        part.batch[K.ROLLOUT_LOG_PROBS] = torch.full((2, resp_w), -0.5)
        part.batch[K.TOKEN_VERSIONS] = torch.zeros(2, resp_w, dtype=torch.long)
        part.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] = prompt_w == 2
        parts.append(part)
    out = concat_padded(parts, PAD)
    assert out.batch[K.INFO_MASK][0].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
    assert out.batch[K.LOSS_MASK][0].tolist() == [1, 1, 1, 0, 0]
    assert out.batch[K.ROLLOUT_LOG_PROBS][0].tolist() == [-0.5, -0.5, -0.5, 0.0, 0.0]
    assert out.batch[K.TOKEN_VERSIONS][0].tolist() == [0, 0, 0, -1, -1]
    assert out.batch[K.INPUT_IDS].shape == (4, 8) and out.batch[K.INPUT_IDS][0, 0].item() == PAD
    assert out.meta_info[K.META_ROLLOUT_LOG_PROBS_MATCH_ACTOR] is False    # holds only if it holds for every part


# --------------------------------------------------------------------------- the trainer's step
class _StubTrainer(DynamicSamplingTraining):
    """_sampling_step's view of RayPPOTrainer: a rollout that returns queued groups, a train step that records."""

    def __init__(self, rollouts: list[dict[str, list[float]]], cap: int = 0) -> None:
        self.config = compose_config(["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                                      "data.gen_batch_size=3", "algorithm.filter_groups.enable=true",
                                      f"algorithm.filter_groups.max_num_gen_batches={cap}",
                                      "data.max_response_length=4"])

        class _Run:
            sampling = FilterGroups.from_config(self.config)
        self.run, self.global_step, self.trained = _Run(), 0, []
        self.tokenizer = type("Tok", (), {"pad_token_id": PAD})()
        self.rollouts = list(rollouts)
        self.reward_fn = lambda batch: batch.batch.pop("planned")

    def _rollout(self, batch: DataProto, step: int, metrics: dict, timing: dict) -> DataProto:
        out = _gen_batch(self.rollouts.pop(0))
        planned = torch.zeros(len(out), 4)
        planned[:, -1] = torch.tensor(out.non_tensor_batch.pop("acc"), dtype=torch.float32)
        out.batch["planned"] = planned
        metrics["env/finish_ratio"] = 1.0
        return out

    def _train_on(self, batch: DataProto, metrics: dict, timing: dict) -> DataProto:
        self.trained.append(batch)
        self.global_step += 1
        return batch

    def _step_metrics(self, batch: DataProto, metrics: dict, timing: dict) -> dict:
        return {**metrics, "timed_step": "step" in timing}


def test_sampling_step_collects_then_trains_once_on_the_kept_groups() -> None:
    trainer = _StubTrainer([{"a": [0, 0], "b": [1, 0], "c": [1, 1]}, {"d": [1, 1], "e": [0, 1], "f": [0, 1]}])
    assert trainer._sampling_step(DataProto()) is None and trainer.trained == []
    metrics = trainer._sampling_step(DataProto())
    assert metrics is not None and metrics["train/num_gen_batches"] == 2.0 and metrics["timed_step"]
    assert metrics["train/filter_groups/filtered"] == 3.0 and metrics["env/finish_ratio"] == 1.0
    (batch,) = trainer.trained
    assert batch.non_tensor_batch[K.UID].tolist() == ["b", "b", "e", "e"]
    assert batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_sampling_step_stops_at_the_cap() -> None:
    trainer = _StubTrainer([{"a": [0, 0], "b": [1, 1], "c": [1, 1]}] * 2, cap=2)
    assert trainer._sampling_step(DataProto()) is None
    with pytest.raises(DynamicSamplingError, match="max_num_gen_batches=2"):
        trainer._sampling_step(DataProto())


# --------------------------------------------------------------------------- config rules
DAPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=true",
        "data.train_batch_size=8", "data.gen_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=hf"]


@pytest.mark.parametrize("pipeline", [[], ["trainer.pipeline=one_step_off", "trainer.rollout_pool=1"],
                                      ["trainer.pipeline=async", "trainer.rollout_pool=1", "trainer.max_staleness=2"]])
def test_a_dapo_config_passes_the_checks(pipeline: list[str]) -> None:
    cfg = compose_config(DAPO + pipeline)
    assert [e for e in config_errors(cfg) if "filter_groups" in e or "gen_batch_size" in e] == []
    sampling = FilterGroups.from_config(cfg)
    assert sampling == FilterGroups(enable=True, metric="acc", max_num_gen_batches=0, gen_batch_size=16)


@pytest.mark.parametrize("extra, needle", [
    (["actor_rollout_ref.rollout.n=1"], "nothing to compare"),
    (["trainer.pipeline=one_step_off", "trainer.rollout_pool=1", "+trainer.pipeline_wait_for_sync=true"],
     "pipeline_wait_for_sync=true: a pipeline that waits for each update rolls out one batch a step"),
    (["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"], "seq_final_reward"),
    (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric='accuracy' is unknown"),
    (["data.gen_batch_size=4"], "data.gen_batch_size=4 must be an int >= data.train_batch_size=8"),
    (["algorithm.filter_groups.enable=false"], "data.gen_batch_size=16 differs"),
])
def test_dapo_contradictions_name_their_keys(extra: list[str], needle: str) -> None:
    errors = config_errors(compose_config(DAPO + extra))
    assert any(needle in e for e in errors), errors


# --------------------------------------------------------------------------- the real trainer, scripted workers
def test_fit_draws_generation_batches_across_epochs_until_enough_groups_then_trains_once(
        tiny_model_dir: str, tmp_path) -> None:
    from tests.trainer.test_main_ppo import _scripted_trainer

    # 8 training prompts in generation batches of 8 (one a epoch), train batches of 4 prompts x 2 samples
    trainer = _scripted_trainer(tiny_model_dir, tmp_path, extra=(
        "algorithm.filter_groups.enable=true", "data.gen_batch_size=8",
        "algorithm.filter_groups.max_num_gen_batches=3"))
    assert trainer.train_dataloader.batch_size == 8
    calls: list[list[str]] = []

    def reward(batch: DataProto) -> torch.Tensor:
        """Call 1: only the first 2 groups differ (1, 0); call 2: every group does."""
        uids = batch.non_tensor_batch[K.UID].tolist()
        calls.append(uids)
        scores = torch.zeros(batch.batch[K.RESPONSES].shape)
        varying = 4 if len(calls) == 1 else len(uids)
        scores[0:varying:2, -1] = 1.0
        return scores

    trainer.reward_fn = reward
    history = trainer.fit()
    assert [h["step"] for h in history] == [1] and len(calls) == 2
    step = history[0]
    # 8 groups a batch: 2 kept of the first, 8 of the second; 4 trained
    assert step["train/num_gen_batches"] == 2.0 and step["train/filter_groups/generated"] == 16.0
    assert step["train/filter_groups/kept"] == 10.0 and step["train/filter_groups/filtered"] == 6.0
    assert step["train/filter_groups/unused"] == 6.0
    assert step["train/epoch"] == 1.0   # its second generation batch is the second pass over the 8 prompts
    (update,) = trainer.actor_rollout_wg.updates
    trained = update.non_tensor_batch[K.UID].tolist()
    # the 2 kept groups of the first batch and the first 2 of the second, every row of each
    assert sorted(set(trained)) == sorted(set(calls[0][:4]) | set(calls[1][:4])) and len(trained) == 8
    # GRPO advantages of a (1, 0) group are +-0.707, nonzero on every row trained
    assert (update.batch[K.ADVANTAGES].abs().sum(-1) > 0).all()


def test_fit_stops_at_the_cap_when_every_group_is_all_right(tiny_model_dir: str, tmp_path) -> None:
    from tests.trainer.test_main_ppo import _scripted_trainer

    trainer = _scripted_trainer(tiny_model_dir, tmp_path, extra=(
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"))
    # ContainsTokenReward: every scripted response holds the target token, so every group scores 1, 1
    with pytest.raises(DynamicSamplingError, match="kept 0 groups.*max_num_gen_batches=2"):
        trainer.fit()
    assert len(trainer.actor_rollout_wg.generate_calls) == 2 and trainer.actor_rollout_wg.updates == []


# --------------------------------------------------------------------------- the pipelines' producer
@pytest.mark.parametrize("bound", [1, 2])
def test_a_pipeline_producer_with_varying_batches_per_step_keeps_the_staleness_bound(bound: int) -> None:
    """Dynamic sampling in a pipeline: the producer rolls out generation batches past total_steps (a step
    takes as many as it needs), with at most bound - 1 untaken in the queue, so every batch the trainer
    takes is at most `bound` updates stale; a step here needs 3 batches."""
    import threading
    import time

    from verl.trainer.ppo.pipeline import RolloutProducer

    starts: list[tuple[int, int]] = []
    lock = threading.Lock()

    def rollout(batch, index, metrics, timing):
        with lock:
            starts.append((index, producer.taken))
        return batch

    def batches():
        while True:
            yield DataProto(), {}

    producer = RolloutProducer(rollout, lambda: 0, steps_done=0, total_steps=2, bound=bound,
                               batches_per_step_vary=True)
    producer.start(batches())
    staleness, steps = [], 0
    for taken in range(1, 10):
        item, _ = producer.next_batch()
        staleness.append(steps - item.version)
        if taken % 3 == 0:          # the third batch completes a step: log-probs, then the update and step count
            time.sleep(0.05)        # meanwhile the producer pushes the current weights and rolls the next batch
            with producer.updating():
                time.sleep(0.05)
                steps += 1
                producer.step_done(steps)
        time.sleep(0.02)            # the trainer is slower than the rollout: the producer waits on the bound
    producer.stop()
    assert steps == 3 > producer.total_steps       # not cut at total_steps
    assert all(index - taken <= bound - 1 for index, taken in starts), starts
    assert max(staleness) <= bound and max(staleness) >= 1, staleness
