"""The built-in reward managers `naive` and `batch`, and the custom reward function's loader.

Both extend `verl.trainer.ppo.reward.RewardManager`, which still decodes the rows (policy text
only, DESIGN §4.6), puts each score on its row's last policy token and counts the metrics: they
score the whole batch first (`_score_rows`), then hand the base class those scores row by row
through `_score`. So whatever the base class does around a score applies to every manager.

Per row the managers also keep `last_row_metrics` (token F1 of the extracted answer, and the
judge's verdict when a judge is set), which validation reports per data source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from verl.protocol import DataProto
from verl.trainer.ppo.reward import RewardManager
from verl.utils import batch_keys as K
from verl.utils.reward_score import FormatScoreConfig, RewardBreakdown, validate_data_sources
from verl.utils.reward_score.llm_judge import JudgeConfig, LLMJudge
from verl.utils.reward_score.qa_em import em_check, extract_solution, golden_answers_of, subem_check
from verl.utils.reward_score.qa_f1 import f1_check
from verl.utils.user_file import import_user_file
from verl.workers.reward_manager.registry import METRICS, register, registered_class

CUSTOM_KEY = "custom_reward_function"


def load_custom_reward_fn(node: Any) -> Callable[..., Any] | None:
    """The function `custom_reward_function.name` of the file `custom_reward_function.path` (None: no path)."""
    if node is None or not node.get("path"):
        return None
    file = Path(str(node.get("path"))).expanduser().resolve()
    name = str(node.get("name") or "compute_score")
    module = import_user_file(file, f"{CUSTOM_KEY}.path", "search_r1_custom_reward_")
    fn = getattr(module, name, None)
    if fn is None:
        raise AttributeError(f"{CUSTOM_KEY}.name: {str(file)!r} defines no {name!r}")
    if not callable(fn):
        raise TypeError(f"{CUSTOM_KEY}.name: {name!r} in {str(file)!r} is a {type(fn).__name__}, not a function")
    return fn


# What a rollout leaves on a row (batch_keys.AGENT_KEYS) -> the extra_info key veRL's reward loop gives it.
ROLLOUT_FIELDS = {K.TOOL_REWARDS: "tool_rewards", K.TURN_SCORES: "turn_scores",
                  K.REWARD_SCORES: "rollout_reward_scores", K.NUM_TURNS: "num_turns"}


def with_rollout_fields(extra_info: Any, data: DataProto, row: int) -> dict:
    """A row's extra_info as a custom reward function sees it, as veRL passes it: a copy with the rollout's
    step rewards (`tool_rewards`, in call order), each tool's `calc_reward` (`rollout_reward_scores`), an
    interaction's scores (`turn_scores`) and `num_turns` added, those the batch carries."""
    info = dict(extra_info) if isinstance(extra_info, dict) else {}
    for key, name in ROLLOUT_FIELDS.items():
        column = data.non_tensor_batch.get(key)
        if column is not None:
            value = column[row]
            info[name] = int(value) if key == K.NUM_TURNS else (dict(value) if isinstance(value, dict) else list(value))
    return info


def _as_score(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """(score, extra numeric entries) from a custom function's float or {"score": ..., ...}."""
    if isinstance(value, dict):
        if "score" not in value:
            raise KeyError(f"{where} returned a dict without 'score' (keys: {sorted(value)})")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}
        return float(value["score"]), extras
    try:
        return float(value), {}
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where} returned {type(value).__name__}; expected a float or a dict with 'score'") from exc


class _ScoringManager(RewardManager):
    """Scores every row of a batch up front; the base class places the scores."""

    def __init__(self, tokenizer: Any, num_examine: int, format_score_cfg: FormatScoreConfig | None = None,
                 compute_score: Callable[..., Any] | None = None, reward_kwargs: dict[str, Any] | None = None,
                 metric: str = "em", judge: LLMJudge | None = None) -> None:
        super().__init__(tokenizer, num_examine=num_examine, format_score_cfg=format_score_cfg)
        if metric not in METRICS:
            raise ValueError(f"reward_model.metric={metric!r} must be one of {list(METRICS)}")
        if metric == "judge" and judge is None:
            raise ValueError("reward_model.metric=judge needs reward_model.judge.url and .model")
        if metric != "em" and format_score_cfg is not None:
            raise ValueError(f"reward_model.metric={metric!r} cannot be combined with the format reward "
                             "(reward_model.*_score weights), which is defined on EM; use metric=em")
        self.compute_score = compute_score
        self.reward_kwargs = dict(reward_kwargs or {})
        self.metric = metric
        self.judge = judge
        self.last_row_metrics: list[dict[str, float]] = []
        self._pending: Iterator[tuple[str, RewardBreakdown]] | None = None
        self._texts: list[str] = []
        self._extra_metrics: dict[str, float] = {}

    # ---- the batch pass
    def _rows(self, data: DataProto) -> tuple[list[str], list[str], list[str], list[Any], list[Any]]:
        responses, policy_mask, real_tokens = self._masks(data)
        for key in (K.DATA_SOURCE, K.REWARD_MODEL):
            if key not in data.non_tensor_batch:
                raise KeyError(f"{type(self).__name__} needs non-tensor key '{key}'")
        sources = [str(s) for s in data.non_tensor_batch[K.DATA_SOURCE]]
        if self.compute_score is None:
            validate_data_sources(sources)
        policy_texts, response_texts, ground_truths = [], [], []
        for row in range(responses.shape[0]):
            policy_text, response_text = self.decode_row(responses[row], policy_mask[row], real_tokens[row])
            policy_texts.append(policy_text)
            response_texts.append(response_text)
            reward_model = data.non_tensor_batch[K.REWARD_MODEL][row]
            if "ground_truth" not in reward_model:
                raise KeyError(f"row {row}: non-tensor '{K.REWARD_MODEL}' has no 'ground_truth' key")
            ground_truths.append(reward_model["ground_truth"])
        infos = data.non_tensor_batch.get(K.EXTRA_INFO)
        extra_infos = [with_rollout_fields(info if infos is not None else {}, data, row)
                       for row, info in enumerate(infos if infos is not None else sources)]
        return sources, policy_texts, response_texts, ground_truths, extra_infos

    def _custom_scores(self, sources: list[str], texts: list[str], ground_truths: list[Any],
                       extra_infos: list[Any]) -> list[Any]:
        assert self.compute_score is not None
        return [self.compute_score(data_source=s, solution_str=t, ground_truth=g, extra_info=e, **self.reward_kwargs)
                for s, t, g, e in zip(sources, texts, ground_truths, extra_infos, strict=True)]

    def _questions(self, data: DataProto, extra_infos: list[Any]) -> list[str]:
        """The question of each row: extra_info.question (tool format), else the decoded prompt."""
        prompts = data.batch[K.PROMPTS].cpu() if data.batch is not None and K.PROMPTS in data.batch.keys() else None
        questions = []
        for row, info in enumerate(extra_infos):
            if info.get("question"):
                questions.append(str(info["question"]))
            elif prompts is not None:
                ids = prompts[row]
                ids = ids[ids != self.tokenizer.pad_token_id] if self.tokenizer.pad_token_id is not None else ids
                questions.append(self.tokenizer.decode(ids.tolist(), skip_special_tokens=True))
            else:
                questions.append("")
        return questions

    def _score_rows(self, data: DataProto) -> list[RewardBreakdown]:
        sources, texts, responses, ground_truths, extra_infos = self._rows(data)
        self._texts = texts
        answers = [extract_solution(text) for text in texts]
        golds = []
        for gt in ground_truths:
            try:
                golds.append(golden_answers_of(gt))
            except (KeyError, TypeError):
                golds.append(None)   # a custom function's own ground-truth format
        ems = [em_check(a, g) if a is not None and g is not None else 0 for a, g in zip(answers, golds, strict=True)]
        rows: list[dict[str, float]] = [{} for _ in texts]
        for row, (answer, gold) in enumerate(zip(answers, golds, strict=True)):
            if gold is not None:
                rows[row]["f1"] = f1_check(answer, gold) if answer is not None else 0.0
        metrics: dict[str, float] = {}
        verdicts: list[bool | None] = [None] * len(texts)
        if self.judge is not None:
            verdicts, metrics = self._judge_rows(data, answers, golds, ems, extra_infos)
            for row, verdict in enumerate(verdicts):
                if verdict is not None:
                    rows[row]["judge"] = float(verdict)

        breakdowns = []
        extras: dict[str, list[float]] = {}
        if self.compute_score is not None:
            results = self._custom_scores(sources, texts, ground_truths, extra_infos)
            if len(results) != len(texts):
                raise ValueError(f"{CUSTOM_KEY} returned {len(results)} scores for {len(texts)} rows")
            for row, result in enumerate(results):
                score, extra = _as_score(result, f"{CUSTOM_KEY} (row {row}, data_source {sources[row]!r})")
                for key, value in extra.items():
                    extras.setdefault(key, []).append(value)
                breakdowns.append(RewardBreakdown(score=score, em=ems[row], answer=answers[row], format_valid=None))
        else:
            for row, source in enumerate(sources):
                if self.metric == "em":
                    breakdowns.append(RewardManager._score(self, source, texts[row], responses[row], ground_truths[row]))
                    continue
                answer = answers[row]
                if answer is None:
                    score = 0.0
                elif self.metric == "subem":
                    score = float(subem_check(answer, golds[row]))
                elif self.metric == "f1":
                    score = rows[row]["f1"]
                else:   # judge: an exact match needs no call; a failed call falls back to EM (counted)
                    score = float(verdicts[row]) if verdicts[row] is not None else float(ems[row])
                breakdowns.append(RewardBreakdown(score=score, em=ems[row], answer=answer, format_valid=None))
        metrics.update({f"reward/{key}": float(np.mean(values)) for key, values in extras.items()})
        if rows and any("f1" in r for r in rows):
            metrics["reward/f1"] = float(np.mean([r["f1"] for r in rows if "f1" in r]))
        self.last_row_metrics = rows
        self._extra_metrics = metrics
        return breakdowns

    def _judge_rows(self, data: DataProto, answers: list[str | None], golds: list[list[str] | None],
                    ems: list[int], extra_infos: list[Any]) -> tuple[list[bool | None], dict[str, float]]:
        """Verdicts for rows with an answer that is not an exact match (EM rows: True; no answer: False)."""
        assert self.judge is not None
        verdicts: list[bool | None] = [bool(em) if a is None or em else None for a, em in zip(answers, ems, strict=True)]
        ask = [row for row, verdict in enumerate(verdicts) if verdict is None and golds[row] is not None]
        questions = self._questions(data, extra_infos)
        items = [(questions[row], str(answers[row]), " / ".join(golds[row] or [])) for row in ask]
        results = self.judge.judge(items) if items else []
        for row, verdict in zip(ask, results, strict=True):
            verdicts[row] = verdict
        failed = sum(verdict is None for verdict in results)
        metrics = self.judge.last_stats.metrics()
        metrics["reward/judge_fallback_rows"] = float(failed)
        self.judge.check_failure_bound(failed, len(items))
        return verdicts, metrics

    # ---- the base class's hooks
    def validate_sources(self, sources: Any) -> None:
        if self.compute_score is None:
            validate_data_sources(sources)

    def _score(self, data_source: str, policy_text: str, response_text: str, ground_truth: Any) -> RewardBreakdown:
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}._score called outside __call__")
        expected_text, breakdown = next(self._pending)
        if expected_text != policy_text:
            raise RuntimeError("reward manager: rows scored out of order (policy text differs)")
        return breakdown

    def __call__(self, data: DataProto, return_breakdown: bool = False) -> Any:
        breakdowns = self._score_rows(data)
        self._pending = iter(list(zip(self._texts, breakdowns, strict=True)))
        try:
            result = super().__call__(data, return_breakdown=return_breakdown)
        finally:
            self._pending = None
        self.last_metrics.update(self._extra_metrics)
        return result


@register("naive")
class NaiveRewardManager(_ScoringManager):
    """One score per row: the built-in rule (`reward_model.metric`) or the custom function, row by row."""


@register("batch")
class BatchRewardManager(_ScoringManager):
    """The custom function once over the whole batch (veRL's batch manager)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.compute_score is None:
            raise ValueError("reward_model.reward_manager=batch calls a batched function: set "
                             f"{CUSTOM_KEY}.path (and .name) to a compute_score(data_sources, solution_strs, "
                             "ground_truths, extra_infos, **kwargs) returning one score per row")

    def _custom_scores(self, sources: list[str], texts: list[str], ground_truths: list[Any],
                       extra_infos: list[Any]) -> list[Any]:
        assert self.compute_score is not None
        results = self.compute_score(data_sources=sources, solution_strs=texts, ground_truths=ground_truths,
                                     extra_infos=extra_infos, **self.reward_kwargs)
        return list(results)


def build_reward_managers(config: Any, tokenizer: Any) -> tuple[RewardManager, RewardManager]:
    """(training reward, validation reward).

    Training: `reward_model.reward_manager` with the custom function if one is set, else the built-in
    rule `reward_model.metric` (the format-aware EM when a `reward_model.*_score` weight is set).
    Validation: the custom function if set, else plain EM; it reports token F1 per row too, and
    the judge's verdict whenever `reward_model.judge.url` is set.
    """
    rm_cfg = config.get("reward_model", {})
    custom_cfg = config.get(CUSTOM_KEY, None)
    compute_score = load_custom_reward_fn(custom_cfg)
    reward_kwargs = dict(custom_cfg.get("reward_kwargs", None) or {}) if custom_cfg is not None else {}
    num_examine = int(rm_cfg.get("num_examine", 1))
    metric = str(rm_cfg.get("metric", "em") or "em")
    judge_cfg = JudgeConfig.from_config(rm_cfg.get("judge", None))
    judge = LLMJudge(judge_cfg) if judge_cfg is not None else None
    format_cfg = FormatScoreConfig.from_config(rm_cfg)
    use_format = any(value != 0.0 for value in (format_cfg.structure_format_score,
                                               format_cfg.final_format_score, format_cfg.retrieval_score))

    cls = registered_class(str(rm_cfg.get("reward_manager", "naive")))
    train = cls(tokenizer, num_examine=num_examine, format_score_cfg=format_cfg if use_format else None,
                compute_score=compute_score, reward_kwargs=reward_kwargs, metric=metric,
                judge=judge if metric == "judge" else None)
    val = cls(tokenizer, num_examine=num_examine, format_score_cfg=None, compute_score=compute_score,
              reward_kwargs=reward_kwargs, metric="em", judge=judge)
    return train, val
