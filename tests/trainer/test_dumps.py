"""Trajectory dumps (verl/trainer/ppo/dumps.py, dump_rows.py): veRL's fields and ours, turns that
are exactly the rollout's policy and observation spans, whole GRPO groups under the row cap, atomic
step files, and a resumed run that neither duplicates nor loses a step."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer._dump_batch import HOSTILE, bm25_url, make_tokenizer, rolled_out_batch
from verl.trainer.config_schema import ConfigError
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.dump_rows import dump_rows, picked_rows, token_pieces
from verl.trainer.ppo.dumps import (
    DumpConfig,
    TrajectoryDumps,
    dump_config_errors,
    prune_after,
    step_files,
    val_generation_samples,
    write_step_file,
)
from verl.utils import batch_keys as K

VERL_KEYS = {"input", "output", "gts", "score", "step"}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with bm25_url(tmp_path_factory.mktemp("bm25")) as u:
        yield u


@pytest.fixture(scope="module")
def batch(tokenizer, url):
    return rolled_out_batch(tokenizer, url)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    out, start = [], None
    for k, m in enumerate([*mask, 1 - value]):
        if m == value and start is None:
            start = k
        elif m != value and start is not None:
            out.append((start, k))
            start = None
    return out


def test_a_rows_turns_are_the_policy_and_observation_spans_of_the_rollout(tokenizer, batch) -> None:
    rows = dump_rows(batch, tokenizer, 7, range(len(batch)))
    width = batch.batch[K.RESPONSES].shape[1]
    for i, row in enumerate(rows):
        n = int(batch.batch[K.ATTENTION_MASK][i, -width:].sum())
        ids = batch.batch[K.RESPONSES][i, :n].tolist()
        mask = batch.batch[K.LOSS_MASK][i, :n].tolist()
        observations = [_decode(tokenizer, ids[a:b]) for a, b in _spans(mask, 0)]
        policies = [_decode(tokenizer, ids[a:b]) for a, b in _spans(mask, 1)]
        # every masked (not trained) span is exactly one observation of the dump, in order, and back
        assert [t["observation"] for t in row["turns"] if t["observation"]] == observations, f"row {i}"
        assert [t["policy"] for t in row["turns"] if t["policy"]] == policies, f"row {i}"
        assert "".join(t["policy"] + t["observation"] for t in row["turns"]) == _decode(tokenizer, ids)
        for t in row["turns"]:
            assert t["tokens"] is None or "".join(t["tokens"]) == t["policy"]
            assert t["trained"] == t["policy_tokens"]      # response_mask = loss_mask here
        assert VERL_KEYS <= set(row) and row["step"] == 7
        assert row["trained_tokens"] == sum(mask) and row["response_length"] == n
    q1 = rows[0]
    assert [t["queries"] for t in q1["turns"]] == [["capital of France"], ["Eiffel Tower"], []]
    assert all(len(ids) == 2 for t in q1["turns"][:2] for ids in t["doc_ids"])
    assert q1["n_searches"] == 2 and q1["stop_reason"] == "answered" and q1["correct"] is True
    assert q1["reward_parts"]["em"] == 1 and q1["reward_parts"]["answer"] == "Paris" and q1["gts"] == {"target": ["Paris"]}
    assert q1["data_source"] == "nq" and q1["index"] == 1 and q1["uid"] == batch.non_tensor_batch[K.UID][0]
    q2 = rows[2]
    assert [t["action"] for t in q2["turns"]] == ["invalid", "answer"] and q2["correct"] is False
    assert rows[4]["stop_reason"] == "eos" and len(rows[4]["turns"]) == 1
    assert HOSTILE in rows[6]["turns"][-1]["policy"]   # text is dumped as written


def test_advantages_and_log_probs_per_policy_token(tokenizer, batch) -> None:
    rows = dump_rows(batch, tokenizer, 1, range(len(batch)))
    # the made-up ramp on row 0 varies per token: a list, one value a policy token, in order
    ramp = rows[0]["turns"][0]["adv"]
    assert isinstance(ramp, list) and len(ramp) == rows[0]["turns"][0]["policy_tokens"] and ramp == sorted(ramp)
    # GRPO's outcome advantage is one number for the whole row
    q2 = rows[2]
    adv = batch.batch[K.ADVANTAGES][2][batch.batch[K.RESPONSE_MASK][2].bool()]
    assert all(t["adv"] == pytest.approx(float(adv[0]), abs=1e-4) for t in q2["turns"])
    assert q2["advantage"] == pytest.approx(float(adv.mean()), abs=1e-4)
    lp = batch.batch[K.OLD_LOG_PROBS][2][batch.batch[K.LOSS_MASK][2].bool()].tolist()
    assert [v for t in q2["turns"] for v in t["lp"]] == pytest.approx(lp, abs=1e-3)


def test_trained_counts_follow_the_response_mask(tokenizer, batch) -> None:
    cut = batch.select(batch_keys=list(batch.batch.keys()), non_tensor_batch_keys=list(batch.non_tensor_batch),
                       deepcopy=True)
    first = torch.nonzero(cut.batch[K.RESPONSE_MASK][0]).flatten()[:3]
    cut.batch[K.RESPONSE_MASK][0, first] = 0   # e.g. tokens sampled from a cut context
    row = dump_rows(cut, tokenizer, 1, [0])[0]
    assert row["turns"][0]["trained"] == row["turns"][0]["policy_tokens"] - 3
    assert row["trained_tokens"] == int(cut.batch[K.RESPONSE_MASK][0].sum())


def test_a_batch_without_agent_trace_is_cut_where_the_loss_mask_changes(tokenizer, batch) -> None:
    plain = batch.select(batch_keys=list(batch.batch.keys()),
                         non_tensor_batch_keys=[k for k in batch.non_tensor_batch if k != K.AGENT_TRACE])
    with_trace = dump_rows(batch, tokenizer, 1, [0])[0]["turns"]
    without = dump_rows(plain, tokenizer, 1, [0])[0]["turns"]
    assert [(t["policy"], t["observation"]) for t in without] == [(t["policy"], t["observation"]) for t in with_trace]


def test_the_rollouts_tool_rewards_are_shown_with_the_rewards_parts(tokenizer, batch) -> None:
    scored = batch.select(batch_keys=list(batch.batch.keys()), non_tensor_batch_keys=list(batch.non_tensor_batch))
    n = len(scored)
    scored.non_tensor_batch[K.TOOL_REWARDS] = np.array([[0.5, 0.25]] + [[]] * (n - 1), dtype=object)
    scored.non_tensor_batch[K.REWARD_SCORES] = np.array([{"search": 1.0}] + [{}] * (n - 1), dtype=object)
    first, second = dump_rows(scored, tokenizer, 1, [0, 1])
    assert first["reward_parts"]["tool_rewards"] == [0.5, 0.25] and first["reward_parts"]["reward_scores"] == {"search": 1.0}
    assert "tool_rewards" not in second["reward_parts"] and second["reward_parts"]["em"] == 1


def test_token_pieces_join_to_the_text_or_are_left_out(tokenizer) -> None:
    ids = tokenizer.encode("<think> the Eiffel Tower </think>", add_special_tokens=False)
    text = tokenizer.decode(ids)
    assert "".join(token_pieces(tokenizer, ids, text)) == text
    assert token_pieces(tokenizer, ids, text + "x") is None


def test_the_row_cap_keeps_whole_groups_and_validation_keeps_the_first_rows(batch) -> None:
    # 4 groups of 2 rows: a cap of 5 keeps two whole groups, never a part of the third
    assert picked_rows(batch, 5, whole_groups=True) == [0, 1, 2, 3]
    assert picked_rows(batch, None, whole_groups=True) == list(range(8))
    assert picked_rows(batch, 1, whole_groups=True) == [0]      # a group larger than the cap: its first rows
    assert picked_rows(batch, 3, whole_groups=False) == [0, 1, 2]
    order = torch.tensor([3, 0, 5, 1, 2, 4, 6, 7])   # balance_batch reorders rows; groups stay together
    shuffled = batch.select(batch_keys=list(batch.batch.keys()), non_tensor_batch_keys=list(batch.non_tensor_batch),
                            deepcopy=True)
    shuffled.reorder(order)
    uids = shuffled.non_tensor_batch[K.UID].tolist()
    picked = picked_rows(shuffled, 4, whole_groups=True)
    assert len(picked) == 4 and all(uids.count(uids[i]) == sum(uids[j] == uids[i] for j in picked) for i in picked)


def test_a_step_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    path = write_step_file(tmp_path / "d", 3, [{"step": 3, "x": "é"}, {"step": 3, "x": 1}])
    assert path == tmp_path / "d" / "3.jsonl"
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [
        {"step": 3, "x": "é"}, {"step": 3, "x": 1}]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["3.jsonl"]   # no temporary file left
    with pytest.raises(ValueError):   # NaN is no JSON: refused before the file is replaced
        write_step_file(tmp_path / "d", 3, [{"step": 3, "x": float("nan")}])
    assert json.loads(path.read_text().splitlines()[0])["x"] == "é"


def test_a_resumed_run_rewrites_the_steps_past_its_checkpoint_and_keeps_the_others(tmp_path: Path) -> None:
    folder = tmp_path / "rollout"
    for step in range(1, 6):   # a run that crashed after step 5, whose last checkpoint is step 3
        write_step_file(folder, step, [{"step": step, "run": "first"}])
    (folder / ".6.jsonl.tmp").write_text("half a file")   # killed while writing step 6
    (folder / "notes.txt").write_text("mine")
    assert prune_after(folder, 3) == [4, 5]
    assert sorted(step_files(folder)) == [1, 2, 3]
    assert sorted(p.name for p in folder.iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl", "notes.txt"]
    # a fresh run (step 0) in the same folder starts it empty: no step of another run stays
    assert prune_after(folder, 0) == [1, 2, 3] and not step_files(folder)


def _config(**trainer):
    return OmegaConf.create({"trainer": {"rollout_data_dir": None, "validation_data_dir": None,
                                         "log_val_generations": 0, "dump_max_rows": 1000, **trainer}})


def test_bad_dump_keys_are_refused_naming_the_key(tmp_path: Path) -> None:
    assert dump_config_errors(_config()) == []
    assert "trainer.dump_max_rows" in dump_config_errors(_config(dump_max_rows=0))[0]
    assert "trainer.log_val_generations" in dump_config_errors(_config(log_val_generations=-1))[0]
    same = dump_config_errors(_config(rollout_data_dir=str(tmp_path / "d"), validation_data_dir=str(tmp_path / "d")))
    assert "trainer.rollout_data_dir and trainer.validation_data_dir" in same[0]
    with pytest.raises(ConfigError, match="dump_max_rows"):
        DumpConfig.from_config(_config(dump_max_rows="many"))


def test_the_trainer_config_declares_veRLs_dump_keys(tmp_path: Path) -> None:
    cfg = compose_config([f"trainer.rollout_data_dir={tmp_path / 'r'}", f"trainer.validation_data_dir={tmp_path / 'v'}",
                          "trainer.log_val_generations=3", "trainer.dump_max_rows=50"])
    dumps = DumpConfig.from_config(cfg)
    assert dumps == DumpConfig(tmp_path / "r", tmp_path / "v", 50, 3)
    assert DumpConfig.from_config(compose_config([])) == DumpConfig(None, None, 1000, 0)


class _Tables:
    """A tracker with tables (Tracking.log_table's signature)."""

    def __init__(self) -> None:
        self.logged: list[tuple] = []

    def log_table(self, name, columns, rows, step) -> None:
        self.logged.append((name, columns, rows, step))


def test_training_and_validation_files_and_the_validation_samples(tokenizer, batch, tmp_path: Path) -> None:
    cfg = DumpConfig(tmp_path / "rollout", tmp_path / "validation", max_rows=3, log_val_generations=2)
    dumps = TrajectoryDumps(cfg, tokenizer)
    tables = _Tables()
    dumps.start(0, tables)
    path = dumps.write_rollout(batch, 4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.name == "4.jsonl" and len(rows) == 2 and {r["uid"] for r in rows} == {batch.non_tensor_batch[K.UID][0]}
    # validation: two batches, the first 3 rows kept; samples drawn from every row
    val = batch.select(batch_keys=[k for k in batch.batch.keys() if k not in (K.TOKEN_LEVEL_SCORES, K.ADVANTAGES)],
                       non_tensor_batch_keys=[k for k in batch.non_tensor_batch if k != K.REWARD_EXTRA_INFO])
    scores = batch.batch[K.TOKEN_LEVEL_SCORES].sum(-1)
    dumps.add_validation(val[:4], scores[:4])
    dumps.add_validation(val[4:], scores[4:])
    path = dumps.end_validation(4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path == tmp_path / "validation" / "4.jsonl" and len(rows) == 3 and all(r["step"] == 4 for r in rows)
    assert [r["score"] for r in rows] == pytest.approx(scores[:3].tolist())
    (name, columns, logged, step), = tables.logged
    assert name == "val/generations" and columns == ["step", "input", "output", "score"] and step == 4
    assert len(logged) == 2 and all(r[0] == 4 for r in logged)
    # veRL's choice: sorted by input, shuffled with seed 42; the same rows at every validation
    assert val_generation_samples([["b", "o", 1.0], ["a", "o", 0.0], ["c", "o", 1.0]], 2) == \
        val_generation_samples([["c", "o", 1.0], ["b", "o", 1.0], ["a", "o", 0.0]], 2)
