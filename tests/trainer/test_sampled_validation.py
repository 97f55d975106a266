"""Sampled validation (issue 46 item 4): actor_rollout_ref.rollout.val_kwargs and veRL's val-core / val-aux
metrics: names and values against a hand-computed example and veRL's own function, the sampling settings
reaching the engines in both protocols and both rollout modes, a validation pass with n=2, and a real
run_ppo validation with the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from scripts.bench.toy_task import TOY_DATA_SOURCE, ContainsTokenReward, toy_overrides, write_toy_parquets
from verl.trainer.main_ppo import compose_config
from verl.trainer.ppo.rollout_setup import ValKwargs
from verl.trainer.ppo.validation_metrics import (
    bootstrap_metric,
    calc_maj_val,
    process_validation_metrics,
    rows_infos,
    validation_metrics,
)
from verl.utils import batch_keys as K

REPO = Path(__file__).resolve().parents[2]

# nq: prompt a scores [1, 0] (answers paris, london), b [1, 1]; hotpotqa: c [0, 1, 1] (x, y, y)
SOURCES = ["nq"] * 4 + ["hotpotqa"] * 3
UIDS = ["a", "a", "b", "b", "c", "c", "c"]
INFOS = {"reward": [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0], "pred": ["paris", "london", "rome", "rome", "x", "y", "y"]}
# veRL's process_validation_metrics (verl/trainer/ppo/metric_utils.py at b178a3c) on this input, seed 42
VERL = {
    "nq": {"mean@2": 0.75, "std@2": 0.25, "best@2/mean": 0.885, "best@2/std": 0.21041625412500814,
           "worst@2/mean": 0.623, "worst@2/std": 0.21533926720410282, "maj@2/mean": 0.7565,
           "maj@2/std": 0.24991548571467118},
    "hotpotqa": {"mean@3": 2 / 3, "std@3": 0.4714045207910317, "best@2/mean": 0.885, "best@2/std": 0.31902194281898544,
                 "worst@2/mean": 0.426, "worst@2/std": 0.4944936804449578, "maj@2/mean": 0.644,
                 "maj@2/std": 0.4788152044369519, "best@3/mean": 0.964, "best@3/std": 0.18629009635512025,
                 "worst@3/mean": 0.284, "worst@3/std": 0.45093680266751346, "maj@3/mean": 0.716,
                 "maj@3/std": 0.45093680266751346},
}


def test_mean_std_best_worst_maj_by_hand() -> None:
    got = process_validation_metrics(SOURCES, UIDS, INFOS)
    nq, hotpot = got["nq"]["reward"], got["hotpotqa"]["reward"]
    # exact: the mean over prompts of each prompt's mean / population std
    assert nq["mean@2"] == 0.75 and nq["std@2"] == 0.25
    assert hotpot["mean@3"] == pytest.approx(2 / 3) and hotpot["std@3"] == pytest.approx(math.sqrt(2) / 3)
    # bootstrap (1000 draws): a's best of 2 is 1 unless both draws are the 0 (P = 1/4), b's is always 1;
    # a's worst is 1 only when both draws are the 1; a's majority is the first draw's answer (a tie), so its
    # score: 1/2; b's always 1. Tolerance: 4 standard errors of a 1000-draw mean, halved by the prompt mean.
    tol = 4 * math.sqrt(0.25 / 1000) / 2
    assert nq["best@2/mean"] == pytest.approx((0.75 + 1) / 2, abs=tol)
    assert nq["worst@2/mean"] == pytest.approx((0.25 + 1) / 2, abs=tol)
    assert nq["maj@2/mean"] == pytest.approx((0.5 + 1) / 2, abs=tol)
    # c: the majority of 3 draws from {x: 0, y: 1, y: 1} is x when x is drawn twice or more, P = 7/27 (no ties
    # with 3 draws of 2 answers); the best of 3 is 0 only when all three are x, P = 1/27
    assert hotpot["maj@3/mean"] == pytest.approx(1 - 7 / 27, abs=4 * math.sqrt(0.25 / 1000))
    assert hotpot["best@3/mean"] == pytest.approx(1 - 1 / 27, abs=4 * math.sqrt(0.25 / 1000))


def test_values_are_veRL_s_for_the_same_seed() -> None:
    got = process_validation_metrics(SOURCES, UIDS, INFOS)
    for source, expected in VERL.items():
        assert got[source]["reward"] == pytest.approx(expected, abs=1e-12), source


def test_metric_names_split_core_and_aux_as_veRL() -> None:
    metrics = validation_metrics(SOURCES, UIDS, INFOS)
    core = {k for k in metrics if k.startswith("val-core/")}
    assert core == {"val-core/nq/reward/mean@2", "val-core/nq/reward/best@2/mean", "val-core/nq/reward/best@2/std",
                    "val-core/nq/reward/maj@2/mean", "val-core/nq/reward/maj@2/std",
                    "val-core/hotpotqa/reward/mean@3", "val-core/hotpotqa/reward/best@3/mean",
                    "val-core/hotpotqa/reward/best@3/std", "val-core/hotpotqa/reward/maj@3/mean",
                    "val-core/hotpotqa/reward/maj@3/std"}
    assert metrics["val-aux/nq/reward/worst@2/mean"] == VERL["nq"]["worst@2/mean"]
    assert metrics["val-aux/hotpotqa/reward/best@2/mean"] == VERL["hotpotqa"]["best@2/mean"]   # k below n: aux
    # and pass@n, exact: a prompt counts when one of its samples scored 1 (a: yes, b: yes; c: yes)
    assert metrics["val-aux/nq/reward/pass@2"] == 1.0 and metrics["val-aux/hotpotqa/reward/pass@3"] == 1.0
    assert len(metrics) == len(VERL["nq"]) + len(VERL["hotpotqa"]) + 2
    zeros = validation_metrics(["nq"] * 4, ["a", "a", "b", "b"], {"reward": [0.0, 1.0, 0.0, 0.0]})
    assert zeros["val-aux/nq/reward/pass@2"] == 0.5 and zeros["val-core/nq/reward/mean@2"] == 0.25


def test_greedy_single_sample_logs_mean_at_1_and_acc_is_the_core_variable() -> None:
    metrics = validation_metrics(["nq", "nq"], ["a", "b"], {"reward": [1.0, 0.0], "acc": [1.0, 1.0],
                                                             "f1": [0.5, None]})
    assert metrics == {"val-aux/nq/reward/mean@1": 0.5, "val-core/nq/acc/mean@1": 1.0, "val-aux/nq/f1/mean@1": 0.5}


def test_bootstrap_helpers_keep_veRL_s_contract_and_the_global_numpy_generator() -> None:
    np.random.seed(123)
    expected_next = np.random.rand()
    np.random.seed(123)
    [(best, _), (worst, _)] = bootstrap_metric([1.0, 0.0], 2, [np.max, np.min], seed=42)
    assert np.random.rand() == expected_next   # veRL reseeds the global generator; this does not
    assert (best, worst) == (0.77, 0.246)      # the draws np.random.seed(42) gives veRL
    assert calc_maj_val([{"p": "A", "v": 0.9}, {"p": "B", "v": 0.8}, {"p": "A", "v": 0.7}], "p", "v") == 0.9
    assert calc_maj_val([{"p": "B", "v": 0.2}, {"p": "A", "v": 0.9}], "p", "v") == 0.2   # a tie: the first seen


def test_rows_infos_votes_on_normalised_answers() -> None:
    infos = rows_infos([1.0, 0.0, 1.0], [{"f1": 1.0}, {"f1": 0.0, "judge": 1.0}, {}], ["The Paris.", None, "paris"])
    assert infos == {"reward": [1.0, 0.0, 1.0], "f1": [1.0, 0.0, None], "judge": [None, 1.0, None],
                     "pred": ["paris", "", "paris"]}


# --- the config path: both protocols, both rollout modes -----------------------------------------------------


def _trainer_for(cfg):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)   # _gen_meta reads config, tokenizer and the EOS set only
    trainer.config, trainer._eos_token_ids = cfg, (2,)
    trainer.tokenizer = type("Tok", (), {"pad_token_id": 0})()
    return trainer


@pytest.mark.parametrize("protocol", ["tag", "tool"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_val_kwargs_reach_the_validation_rollout_in_both_protocols_and_modes(protocol: str, mode: str) -> None:
    from verl.trainer.config_check import config_errors

    extra = [f"actor_rollout_ref.rollout.mode={mode}", "actor_rollout_ref.rollout.val_kwargs.n=4",
             "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
             "actor_rollout_ref.rollout.val_kwargs.top_p=0.95", "actor_rollout_ref.rollout.val_kwargs.top_k=20"]
    if protocol == "tool":
        extra += ["actor_rollout_ref.rollout.multi_turn.enable=true",
                  "actor_rollout_ref.rollout.multi_turn.tool_config_path="
                  f"{REPO}/example/tool_recipe/config/tool_config/search_tool_config.yaml"]
    cfg = compose_config(extra)
    assert not [e for e in config_errors(cfg) if "val_kwargs" in e]
    trainer = _trainer_for(cfg)
    val, train = trainer._gen_meta(validation=True), trainer._gen_meta(validation=False)
    assert {k: val[k] for k in (K.META_VALIDATE, K.META_DO_SAMPLE, K.META_TEMPERATURE, K.META_TOP_P, K.META_TOP_K)} == {
        K.META_VALIDATE: True, K.META_DO_SAMPLE: True, K.META_TEMPERATURE: 0.6, K.META_TOP_P: 0.95, K.META_TOP_K: 20}
    assert K.META_VALIDATE not in train and train[K.META_TEMPERATURE] == 1.0 and K.META_TOP_P not in train
    assert ValKwargs.from_config(cfg.actor_rollout_ref.rollout).n == 4


def test_default_val_kwargs_keep_validation_greedy_and_remax_baselines_ignore_them() -> None:
    cfg = compose_config(["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"])
    trainer = _trainer_for(cfg)
    val = trainer._gen_meta(validation=True)
    assert val[K.META_DO_SAMPLE] is False and val[K.META_TEMPERATURE] == 1.0 and K.META_TOP_P not in val
    cfg = compose_config(["actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    greedy = _trainer_for(cfg)._gen_meta(validation=False, greedy=True)
    assert greedy[K.META_DO_SAMPLE] is False and K.META_VALIDATE not in greedy


@pytest.mark.parametrize("key, value, message", [
    ("n", 0, "val_kwargs.n=0 must be an int >= 1"), ("top_p", 0.0, "val_kwargs.top_p=0.0 must be in (0, 1]"),
    ("top_k", -2, "val_kwargs.top_k=-2 must be an int >= -1"), ("temperature", -1.0, "temperature=-1.0 must be"),
    ("do_sample", "yes", "val_kwargs.do_sample='yes' must be true or false")])
def test_bad_val_kwargs_are_refused_at_start_up_naming_the_key(key: str, value, message: str) -> None:
    from verl.trainer.config_check import config_errors

    cfg = compose_config([])
    OmegaConf.update(cfg, f"actor_rollout_ref.rollout.val_kwargs.{key}", value)
    assert any(message in e and "actor_rollout_ref.rollout.val_kwargs" in e for e in config_errors(cfg))


def test_the_engines_read_the_validation_sampling_from_the_call(tiny_model_dir: str) -> None:
    """Sync (generate_sequences) and async (step_engine) calls of both engines build their parameters with
    sampling_params_from(rollout config, the call's meta_info): the meta's sampling wins."""
    from verl.workers.rollout.sampling import sampling_params_from

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout_cfg = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": 8}
    meta = {K.META_RESPONSE_LENGTH: 8, **ValKwargs(n=2, do_sample=True, temperature=0.6, top_p=0.9,
                                                  top_k=5).sampling_meta()}
    params = sampling_params_from(rollout_cfg, meta, tok)
    assert (params.do_sample, params.temperature, params.top_p, params.top_k) == (True, 0.6, 0.9, 5)
    greedy = sampling_params_from(rollout_cfg, {K.META_RESPONSE_LENGTH: 8, **ValKwargs().sampling_meta()}, tok)
    assert greedy.do_sample is False


@pytest.mark.parametrize("validate, do_sample, sampled", [(True, True, True), (True, False, False),
                                                          (False, True, False)])
def test_the_generation_manager_samples_validation_only_when_the_trainer_asks(
        tiny_model_dir: str, validate: bool, do_sample: bool, sampled: bool) -> None:
    """A validation manager stays greedy whatever a batch says, unless the batch is the trainer's validation
    rollout (meta 'validate'): then val_kwargs.do_sample decides. Real HF engine on the tiny model: two
    copies of one prompt sample differently, greedy copies are the same."""
    import torch

    from search_r1.llm_agent.generation import GenerationConfig, LLMGenerationManager
    from tests.llm_agent.helpers import make_gen_batch
    from verl.utils.tiny_model import build_tiny_qwen2
    from verl.workers.rollout.hf_rollout import HFRollout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    engine = HFRollout(build_tiny_qwen2(tok, hidden_size=32, num_layers=1), {"micro_batch_size": 8}, tok)
    meta = {K.META_DO_SAMPLE: do_sample, K.META_TEMPERATURE: 1.0, **({K.META_VALIDATE: True} if validate else {})}
    gen_batch, prompts = make_gen_batch(tok, ["q1"] * 4, **meta)
    config = GenerationConfig(max_turns=1, max_start_length=256, max_prompt_length=1024, max_response_length=16,
                              max_obs_length=256, search_url="http://127.0.0.1:9/retrieve", topk=1)
    out = LLMGenerationManager(tok, engine, config, is_validation=True).run_llm_loop(gen_batch, prompts)
    rows = {tuple(r) for r in out.batch[K.RESPONSES].tolist()}
    assert (len(rows) > 1) == sampled


# --- the validation pass --------------------------------------------------------------------------------------


def test_validation_with_n_2_repeats_each_prompt_and_logs_veRL_metrics(tiny_model_dir: str, tmp_path: Path) -> None:
    from tests.trainer.test_main_ppo import _scripted_trainer

    trainer = _scripted_trainer(tiny_model_dir, tmp_path, n_val=7, extra=(
        "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7"))
    val = trainer._validate()
    calls = trainer.actor_rollout_wg.generate_calls
    assert [len(c) for c in calls] == [8, 6]   # 7 prompts, batches of 4 and 3, each prompt twice
    assert all(c.meta_info[K.META_DO_SAMPLE] is True and c.meta_info[K.META_TEMPERATURE] == 0.7 for c in calls)
    src = TOY_DATA_SOURCE
    # the scripted engine always answers with the target token: score 1 on every sample
    assert val[f"val/test_score/{src}"] == 1.0
    assert val[f"val-core/{src}/reward/mean@2"] == 1.0 and val[f"val-aux/{src}/reward/std@2"] == 0.0
    assert val[f"val-core/{src}/reward/best@2/mean"] == 1.0 and val[f"val-aux/{src}/reward/worst@2/mean"] == 1.0


@pytest.mark.slow   # ~100 s on 2 shared cores: Ray workers, FSDP init, then the sampled validation pass
def test_run_ppo_validates_with_two_samples_per_prompt(ray_cluster, tiny_model_dir: str, tmp_path: Path) -> None:
    """A real validation pass through run_ppo (Ray workers, HF rollout on the tiny model): 2 sampled
    responses per validation prompt, scored and reported under veRL's names."""
    from verl.trainer.main_ppo import run_ppo

    paths = write_toy_parquets(tmp_path / "data", n_train=8, n_val=3)
    cfg = compose_config(toy_overrides(tiny_model_dir, paths, str(tmp_path / "ckpt"), val_before_train=True,
                                       n_workers=1) + [   # one worker: the driver scores and reports the samples
        "+trainer.val_only=true", "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (val,) = run_ppo(cfg, reward_fn=ContainsTokenReward(tok), val_reward_fn=ContainsTokenReward(tok))
    src = TOY_DATA_SOURCE
    mean, best, worst = (val[f"val-core/{src}/reward/mean@2"], val[f"val-core/{src}/reward/best@2/mean"],
                         val[f"val-aux/{src}/reward/worst@2/mean"])
    assert mean == pytest.approx(val[f"val/test_score/{src}"])   # every prompt has 2 samples: the same mean
    assert 0.0 <= worst <= mean <= best <= 1.0
    assert mean * 6 == pytest.approx(round(mean * 6))            # 6 rows scored 0 or 1
