"""Reward-manager registry, custom reward functions (veRL's signature) and the token-F1 metric."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.trainer.test_reward import _batch, _row
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.metric_utils import row_metrics_by_data_source
from verl.utils.reward_score.qa_f1 import compute_score_f1, f1_check
from verl.utils.tiny_model import train_bpe_tokenizer
from verl.workers.reward_manager import (
    REWARD_MANAGER_REGISTRY,
    build_reward_managers,
    get_reward_manager_cls,
    register,
)
from verl.workers.reward_manager.managers import BatchRewardManager, NaiveRewardManager


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def _answers_batch(tok, answers: list[str], golds: list[list[str]], sources: list[str] | None = None):
    rows = [_row(tok, [(f"<think>ok</think><answer> {a} </answer>", True)]) for a in answers]
    return _batch(tok, rows, sources or ["nq"] * len(answers), golds)


def _row_scores(scores: torch.Tensor) -> list[float]:
    return [round(v, 6) for v in scores.sum(-1).tolist()]


# ---------------------------------------------------------------- token F1 (FlashRAG's)
def test_f1_matches_flashrag_token_level_scores():
    assert f1_check("the Eiffel Tower!", ["eiffel tower"]) == pytest.approx(1.0)
    # pred {eiffel, tower, paris} vs gold {eiffel, tower}: p=2/3, r=1 -> 0.8
    assert f1_check("Eiffel Tower, Paris", ["eiffel tower"]) == pytest.approx(0.8)
    assert f1_check("Eiffel Tower, Paris", ["London", "tower"]) == pytest.approx(0.5)   # max over golds
    assert f1_check("yes", ["no"]) == 0.0 and f1_check("yes it is", ["yes"]) == 0.0    # yes/no only exact
    assert f1_check("No.", ["no"]) == 1.0
    assert f1_check("a the an", ["the"]) == 0.0      # nothing left after normalisation
    assert compute_score_f1("no tags here", {"target": ["x"]}) == 0.0
    assert compute_score_f1("<answer>x y</answer>", {"target": ["x"]}) == pytest.approx(2 / 3)


# ---------------------------------------------------------------- registry
def test_registry_has_verl_names_and_refuses_prime_and_dapo_with_reasons():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert get_reward_manager_cls("batch") is BatchRewardManager
    with pytest.raises(ValueError, match=r"reward_model.reward_manager='prime' is not supported: .*process pool"):
        get_reward_manager_cls("prime")
    with pytest.raises(ValueError, match=r"'dapo' is not supported: .*overlong"):
        get_reward_manager_cls("dapo")
    with pytest.raises(ValueError, match=r"reward_model.reward_manager='nope' .*known: \['batch', 'naive'"):
        get_reward_manager_cls("nope")


def test_register_adds_a_manager_and_refuses_a_clash():
    @register("test_double")
    class Double(NaiveRewardManager):
        pass

    try:
        assert get_reward_manager_cls("test_double") is Double
        with pytest.raises(ValueError, match="already registered"):
            register("test_double")(BatchRewardManager)
    finally:
        REWARD_MANAGER_REGISTRY.pop("test_double")


# ---------------------------------------------------------------- built-in metrics through the config
def test_metric_f1_and_subem_from_config_and_val_reports_f1_per_source(tok):
    data = _answers_batch(tok, ["Eiffel Tower Paris", "London", "nothing"], [["eiffel tower"], ["london"], ["x"]],
                          sources=["nq", "nq", "hotpotqa"])
    train, val = build_reward_managers(compose_config(["reward_model.metric=f1"]), tok)
    assert _row_scores(train(data)) == [0.8, 1.0, 0.0]
    assert train.last_metrics["reward/f1"] == pytest.approx(0.6)
    assert _row_scores(val(data)) == [0.0, 1.0, 0.0]      # validation reports EM ...
    per_source = row_metrics_by_data_source(val.last_row_metrics, ["nq", "nq", "hotpotqa"])
    assert per_source == {"val/test_f1/hotpotqa": 0.0, "val/test_f1/nq": pytest.approx(0.9)}   # ... and F1
    train, _ = build_reward_managers(compose_config(["reward_model.metric=subem"]), tok)
    assert _row_scores(train(data)) == [1.0, 1.0, 0.0]


def test_default_config_scores_exactly_as_the_em_manager(tok):
    from verl.trainer.ppo.reward import RewardManager

    data = _answers_batch(tok, ["Paris", "paris!", "Lyon"], [["Paris"], ["Paris"], ["Paris"]])
    train, _ = build_reward_managers(compose_config([]), tok)
    assert type(train) is NaiveRewardManager
    assert torch.equal(train(data), RewardManager(tok, num_examine=0)(data))


def test_metric_and_format_reward_together_refused(tok):
    with pytest.raises(ValueError, match=r"reward_model.metric='f1' cannot be combined with the format reward"):
        build_reward_managers(compose_config(["reward_model.metric=f1",
                                              "reward_model.structure_format_score=0.2"]), tok)
    with pytest.raises(ValueError, match=r"reward_model.metric='bleu' must be one of"):
        build_reward_managers(compose_config(["reward_model.metric=bleu"]), tok)
    with pytest.raises(ValueError, match=r"metric=judge needs reward_model.judge.url"):
        build_reward_managers(compose_config(["reward_model.metric=judge"]), tok)


# ---------------------------------------------------------------- custom reward functions
CUSTOM = textwrap.dedent('''
    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        CALLS.append((data_source, extra_info))
        # veRL's signature; a dict with "score" and an extra metric
        return {"score": float("Paris" in solution_str) + bonus, "length": float(len(solution_str))}

    def batched(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        CALLS.append(len(solution_strs))
        return [0.5 * ("Paris" in s) + bonus for s in solution_strs]

    def bad(data_source, solution_str, ground_truth, extra_info=None):
        return "high"

    NOT_A_FUNCTION = 3
''')


@pytest.fixture()
def custom_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def test_custom_reward_function_from_file_through_the_config(tok, custom_file):
    data = _answers_batch(tok, ["Paris", "Lyon"], [["x"], ["x"]], sources=["my_own_source", "my_own_source"])
    data.non_tensor_batch["extra_info"] = __import__("numpy").array([{"index": 0}, {"index": 1}], dtype=object)
    cfg = compose_config([f"custom_reward_function.path={custom_file}",
                          "+custom_reward_function.reward_kwargs.bonus=0.25"])
    train, val = build_reward_managers(cfg, tok)
    scores = train(data)
    assert _row_scores(scores) == [1.25, 0.25]      # an unknown data_source is fine for a custom function
    assert train.last_metrics["reward/length"] > 0
    import sys
    module = next(m for name, m in sys.modules.items() if name.startswith("search_r1_custom_reward_"))
    assert module.CALLS[-2:] == [("my_own_source", {"index": 0}), ("my_own_source", {"index": 1})]
    assert _row_scores(val(data)) == [1.25, 0.25]    # validation uses the custom function too (as veRL)


def test_batch_manager_calls_the_function_once_per_batch(tok, custom_file):
    data = _answers_batch(tok, ["Paris", "Lyon", "Paris"], [["x"]] * 3)
    cfg = compose_config(["reward_model.reward_manager=batch", f"custom_reward_function.path={custom_file}",
                          "custom_reward_function.name=batched"])
    train, _ = build_reward_managers(cfg, tok)
    assert type(train) is BatchRewardManager
    assert _row_scores(train(data)) == [0.5, 0.0, 0.5]
    with pytest.raises(ValueError, match=r"reward_manager=batch calls a batched function: set custom_reward_function"):
        build_reward_managers(compose_config(["reward_model.reward_manager=batch"]), tok)


def test_custom_function_errors_name_the_key_and_file(tok, custom_file, tmp_path):
    def build(*overrides):
        return build_reward_managers(compose_config(list(overrides)), tok)

    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path: no file .*missing.py"):
        build(f"custom_reward_function.path={tmp_path / 'missing.py'}")
    with pytest.raises(AttributeError, match=r"custom_reward_function.name: .*my_reward.py' defines no 'nope'"):
        build(f"custom_reward_function.path={custom_file}", "custom_reward_function.name=nope")
    with pytest.raises(TypeError, match=r"'NOT_A_FUNCTION' .* is a int, not a function"):
        build(f"custom_reward_function.path={custom_file}", "custom_reward_function.name=NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match=r"custom_reward_function.path: importing .*broken.py' failed: ModuleNotF"):
        build(f"custom_reward_function.path={broken}")
    train, _ = build(f"custom_reward_function.path={custom_file}", "custom_reward_function.name=bad")
    with pytest.raises(TypeError, match=r"custom_reward_function \(row 0, data_source 'nq'\) returned str"):
        train(_answers_batch(tok, ["Paris"], [["x"]]))


def test_config_check_lists_reward_problems_naming_keys(tmp_path):
    from verl.trainer.config_check import config_errors

    def errors(*overrides):
        return "\n".join(config_errors(compose_config(list(overrides))))

    assert "reward_model" not in errors() and "custom_reward_function" not in errors()
    found = errors("reward_model.reward_manager=prime", "reward_model.metric=bleu",
                   f"custom_reward_function.path={tmp_path / 'gone.py'}", "reward_model.judge.url=http://x")
    assert "reward_model.reward_manager='prime' is not supported" in found
    assert "reward_model.metric='bleu' must be one of" in found
    assert "custom_reward_function.path: no file" in found
    assert "reward_model.judge.model must name the served model" in found
    found = errors("reward_model.reward_manager=batch", "reward_model.metric=judge")
    assert "reward_manager=batch needs custom_reward_function.path" in found
    assert "reward_model.metric=judge needs reward_model.judge.url" in found


def test_validation_reports_row_metrics_per_source_and_sums_judge_counters(tiny_model_dir: str, tmp_path):
    from scripts.bench.toy_task import TOY_DATA_SOURCE, ContainsTokenReward
    from tests.trainer.test_main_ppo import _scripted_trainer

    class WithRowMetrics(ContainsTokenReward):
        def __call__(self, data):
            scores = super().__call__(data)
            self.last_row_metrics = [{"f1": 0.5, "judge": float(i % 2)} for i in range(len(data))]
            self.last_metrics = {"reward/judge_calls": 2.0, "reward/judge_cache_hits": 1.0, "reward/mean_score": 1.0}
            return scores

    trainer = _scripted_trainer(tiny_model_dir, tmp_path, n_val=7)   # batches of 4 and 3
    trainer.val_reward_fn = WithRowMetrics(trainer.tokenizer)
    val = trainer._validate()
    assert val.pop(f"val-aux/{TOY_DATA_SOURCE}/f1/mean@1") == 0.5   # veRL's names too (test_sampled_validation.py)
    assert {k for k in val if k.startswith("val-")} == {f"val-core/{TOY_DATA_SOURCE}/reward/mean@1",
                                                        f"val-aux/{TOY_DATA_SOURCE}/judge/mean@1"}
    val = {k: v for k, v in val.items() if not k.startswith("val-")}
    assert val == {f"val/test_score/{TOY_DATA_SOURCE}": 1.0, f"val/test_f1/{TOY_DATA_SOURCE}": 0.5,
                   f"val/test_judge/{TOY_DATA_SOURCE}": pytest.approx(3 / 7),    # rows 1, 3 of 4; row 1 of 3
                   "val/reward/judge_calls": 4.0, "val/reward/judge_cache_hits": 2.0}
