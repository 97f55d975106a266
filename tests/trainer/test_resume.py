"""Checkpoints: atomic step folders, keep-last-K, resume modes, and an exact resume of training, also from
the checkpoint before a corrupt newest one (the manifest check, through run_ppo)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from tests.trainer.test_checkpoint_manifest import _truncate
from verl.trainer import main_ppo
from verl.trainer.ppo import checkpointing as ck
from verl.utils.checkpoint.manifest import MANIFEST_FILE, CorruptCheckpointError, verify_manifest

# Metrics that depend on the clock, not on the computation.
CLOCK_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")


def _save(root: Path, step: int, keep: int = 3) -> Path:
    tmp = ck.begin_checkpoint(root, step)
    (tmp / "actor").mkdir()
    ck.save_driver_state(tmp, step, {"pos": step}, extra={"kl_coef": 0.5})
    return ck.finalize_checkpoint(root, step, keep)


def test_checkpoint_appears_only_when_complete_and_latest_points_at_it(tmp_path: Path) -> None:
    tmp = ck.begin_checkpoint(tmp_path, 5)
    assert tmp.name == "global_step_5.tmp"
    assert ck.find_resume_dir(tmp_path, "auto") is None  # a half-written folder is not a checkpoint
    ck.save_driver_state(tmp, 5, {"pos": 1})
    final = ck.finalize_checkpoint(tmp_path, 5, max_to_keep=3)
    assert final == tmp_path / "global_step_5" and not tmp.exists()
    assert (tmp_path / ck.LATEST_FILE).read_text() == "5"
    state = ck.load_driver_state(ck.find_resume_dir(tmp_path, "auto"))
    assert state.global_step == 5 and state.dataloader_state == {"pos": 1}


def test_only_the_last_k_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["global_step_3", "global_step_4"]
    assert ck.load_driver_state(tmp_path / "global_step_4").extra == {"kl_coef": 0.5}


def test_checkpoints_are_ordered_by_step_number_not_by_name(tmp_path: Path) -> None:
    # By name global_step_10 sorts before global_step_8: keeping "the last two" would then delete 10.
    for step in (8, 9, 10):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["global_step_9", "global_step_10"]
    assert not (tmp_path / "global_step_8").exists()
    (tmp_path / ck.LATEST_FILE).unlink()     # without the pointer the folders alone say which is newest
    assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_10"


def test_resume_modes(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    assert ck.find_resume_dir(tmp_path, "disable") is None
    assert ck.find_resume_dir(tmp_path, "auto") == tmp_path / "global_step_2"
    assert ck.find_resume_dir(tmp_path, str(tmp_path / "global_step_1")) == tmp_path / "global_step_1"
    assert ck.find_resume_dir(tmp_path / "empty", "auto") is None
    with pytest.raises(FileNotFoundError, match="global_step_9"):
        ck.find_resume_dir(tmp_path, str(tmp_path / "global_step_9"))
    (tmp_path / "not_a_step").mkdir()
    with pytest.raises(ValueError, match="not_a_step"):
        ck.find_resume_dir(tmp_path, str(tmp_path / "not_a_step"))


def _train(model_dir: str, data, ckpt: Path, steps: int, extra: list[str] = ()) -> list[dict]:
    overrides = toy_overrides(model_dir, data, str(ckpt), adv_estimator="gae", steps=steps)
    cfg = main_ppo.compose_config([*overrides, "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2",
                                   "actor_rollout_ref.rollout.temperature=1.0", *extra])
    tok = AutoTokenizer.from_pretrained(model_dir)
    return main_ppo.run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))


def _computed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(CLOCK_PREFIXES)}


@pytest.mark.slow   # six run_ppo calls (one only validates, two stop at load): in CI's slow suite (the default suite's 15-minute goal)
def test_two_steps_then_resume_matches_three_steps_exactly_and_a_corrupt_newest_checkpoint_falls_back(
        ray_cluster, tiny_model_dir: str, tmp_path: Path, caplog) -> None:
    # 8 prompts, batch 4: step 3 starts a new epoch, so the resumed sampler must also get the
    # next epoch's order right. PPO: actor, critic, optimizers, LR schedule and worker RNG all matter.
    data = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    straight = _train(tiny_model_dir, data, tmp_path / "straight", steps=3)
    ckpt = tmp_path / "resumed"
    first = _train(tiny_model_dir, data, ckpt, steps=2)
    assert ck.find_resume_dir(ckpt, "auto") == ckpt / "global_step_2"
    assert [h["step"] for h in straight] == [1, 2, 3] and [h["step"] for h in first] == [1, 2]
    assert _computed(first[1]) == _computed(straight[1])

    # The newest checkpoint is corrupt (rank 1's shard half written, as a full disk leaves it): auto
    # resume says so, falls back to step 1, and steps 2 and 3 trained again are the straight run's.
    bad = ckpt / "global_step_2" / "actor" / "dcp" / "__1_0.distcp"
    _truncate(bad)
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        second = _train(tiny_model_dir, data, ckpt, steps=3)
    assert str(bad) in caplog.text and "resuming from" in caplog.text
    assert [h["step"] for h in second] == [2, 3]
    assert _computed(second[0]) == _computed(straight[1])
    assert _computed(second[1]) == _computed(straight[2])
    assert [p.name for p in ck.list_checkpoints(ckpt)] == ["global_step_2", "global_step_3"]
    assert verify_manifest(ckpt / "global_step_2").intact   # the re-save replaced the corrupt folder

    # val_only on the finished run: loads the latest checkpoint, validates, trains nothing
    val = _train(tiny_model_dir, data, ckpt, steps=3, extra=["+trainer.val_only=true"])
    assert len(val) == 1 and val[0]["step"] == 3 and any(k.startswith("val/test_score/") for k in val[0])

    # Nothing intact left: the run stops naming each corrupt file.
    for step in (2, 3):
        _truncate(ckpt / f"global_step_{step}" / "actor" / "dcp" / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint") as info:
        _train(tiny_model_dir, data, ckpt, steps=3)
    for step in (2, 3):
        assert str(ckpt / f"global_step_{step}" / "actor" / "dcp" / "__0_0.distcp") in str(info.value)

    # As saved before manifests: resumed unverified, the workers' load fails and the error says so.
    for step in (2, 3):
        (ckpt / f"global_step_{step}" / MANIFEST_FILE).unlink()
    with pytest.raises(RuntimeError, match="a worker failed to load it") as info:
        _train(tiny_model_dir, data, ckpt, steps=3)
    assert str(ckpt / "global_step_3") in str(info.value) and "no manifest.json" in str(info.value)
