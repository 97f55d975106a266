"""Trajectory dumps through the real trainer (Ray workers, FSDP on gloo, HF rollout, the toy task):
one rollout file a step and one validation file a validation, and a run resumed from a checkpoint
that neither duplicates nor loses a step's file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scripts.bench.toy_task import ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer import main_ppo
from verl.trainer.ppo import checkpointing as ck


def _train(model_dir: str, data, root: Path, steps: int) -> list[dict]:
    # one worker: the driver writes the dumps and the checkpoint's step (a second worker is ~9 s of CPU a run)
    overrides = toy_overrides(model_dir, data, str(root / "ckpt"), adv_estimator="grpo", steps=steps, n_workers=1)
    cfg = main_ppo.compose_config([
        *overrides, "trainer.save_freq=2", "trainer.test_freq=1",
        f"trainer.rollout_data_dir={root / 'dumps' / 'rollout'}",
        f"trainer.validation_data_dir={root / 'dumps' / 'validation'}",
        "trainer.dump_max_rows=6"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    return main_ppo.run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))


def _read(folder: Path) -> dict[int, list[dict]]:
    return {int(p.stem): [json.loads(line) for line in p.read_text().splitlines()] for p in folder.glob("*.jsonl")}


@pytest.mark.slow   # two runs of the real trainer: ~2 min on 2 busy cores
def test_a_resumed_run_neither_duplicates_nor_loses_a_step_file(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    data = write_toy_parquets(tmp_path / "data", n_train=8, n_val=2)
    _train(tiny_model_dir, data, tmp_path, steps=3)
    rollout, validation = tmp_path / "dumps" / "rollout", tmp_path / "dumps" / "validation"
    first = _read(rollout)
    assert sorted(first) == [1, 2, 3] and sorted(_read(validation)) == [1, 2, 3]
    for step, rows in first.items():
        # 4 prompts x 2 samples a step, capped at 6 rows: whole groups of 2, so 3 groups
        assert len(rows) == 6 and all(r["step"] == step for r in rows)
        assert len({r["uid"] for r in rows}) == 3
        assert all(r["trained_tokens"] > 0 and r["advantage"] is not None and r["turns"] for r in rows)
    assert all(len(rows) == 2 and rows[0]["score"] is not None for rows in _read(validation).values())

    # the run died after step 3 before saving it (its last checkpoint is step 2), and a later
    # attempt had already got to step 4
    shutil.rmtree(tmp_path / "ckpt" / "global_step_3")
    (tmp_path / "ckpt" / ck.LATEST_FILE).write_text("2")
    (rollout / "4.jsonl").write_text((rollout / "3.jsonl").read_text())
    resumed = _train(tiny_model_dir, data, tmp_path, steps=3)
    assert [h["step"] for h in resumed] == [3]
    second = _read(rollout)
    assert sorted(second) == [1, 2, 3]                 # step 4 was the dead run's: gone
    assert second[1] == first[1] and second[2] == first[2]   # the checkpointed steps' files are kept
    assert {r["uid"] for r in second[3]} != {r["uid"] for r in first[3]}   # step 3 is the resumed run's
    assert sorted(_read(validation)) == [1, 2, 3]
