"""veRL's validation metrics over several samples per prompt (`actor_rollout_ref.rollout.val_kwargs.n`).

    metrics = validation_metrics(sources_B, uids_B, {"reward": scores_B, "f1": f1_B, "pred": answers_B})
    # val-core/nq/reward/mean@4, val-aux/nq/reward/std@4, val-core/nq/reward/best@4/mean,
    # val-aux/nq/reward/best@2/std, val-aux/nq/reward/worst@4/mean, val-core/nq/reward/maj@4/mean, ...

Per prompt (its `uid`, shared by its samples) and per numeric variable: mean@N and std@N over its N
samples; for k = 2, 4, 8, ... below N, and N: best@k and worst@k, the max and min over k samples drawn
with replacement, and maj@k, the value of the most frequent `pred` (the extracted answer) among k
samples (ties: the answer drawn first), each as the mean and std over 1000 bootstrap draws. Then the
mean over the prompts of each data source. The core variable (`acc` when the rows carry it, else
`reward`) at the largest k goes under val-core (mean, best and maj), everything else under val-aux:
veRL's names and numbers (verl/trainer/ppo/metric_utils.py there). A variable missing on a row (None:
no judge verdict) counts for the rows that have it.

Departure from veRL: its bootstrap reseeds numpy's global generator (np.random.seed) each call; here a
RandomState(seed) draws the same indices without touching the global generator, which the run's
checkpoint saves and restores.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
CORE_PREFIXES = ("mean", "maj", "best")


@cache
def _draws(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """(n_bootstrap, subset_size) indices into n_data items, as veRL draws them after np.random.seed(seed)."""
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


def bootstrap_metric(data: Sequence[Any], subset_size: int, reduce_fns: Sequence[Callable[[np.ndarray], float]],
                     n_bootstrap: int = N_BOOTSTRAP, seed: int = 42) -> list[tuple[float, float]]:
    """(mean, std) of each reduce_fn over n_bootstrap subsets of `subset_size` items drawn with replacement
    (veRL's signature; the draws are veRL's for the same seed)."""
    items = np.empty(len(data), dtype=object)
    items[:] = list(data)
    idx = _draws(len(items), subset_size, n_bootstrap, seed)
    out = []
    for fn in reduce_fns:
        values = np.array([fn(items[row]) for row in idx], dtype=np.float64)
        out.append((float(values.mean()), float(values.std())))
    return out


def calc_maj_val(data: Sequence[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """The `val_key` of the first item whose `vote_key` is the most frequent (ties: the one seen first)."""
    counts: dict[Any, int] = {}
    first: dict[Any, Any] = {}
    for item in data:
        vote = item[vote_key]
        counts[vote] = counts.get(vote, 0) + 1
        first.setdefault(vote, item[val_key])
    return first[max(counts, key=counts.__getitem__)]


def _sample_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below n, then n (none for a single sample)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _majority_values(values: np.ndarray, codes: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per bootstrap row of `idx` (B, k): the value of the first drawn sample whose answer code is the most
    frequent in the row; calc_maj_val on each row, vectorised."""
    drawn = codes[idx]                                                    # (B, k)
    counts = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)             # (B, k): frequency of each draw's code
    winner = np.argmax(counts == counts.max(axis=1, keepdims=True), axis=1)
    return values[idx[np.arange(idx.shape[0]), winner]]


def _prompt_metrics(values: np.ndarray, preds: list[Any] | None, seed: int) -> dict[str, float]:
    n = len(values)
    metric = {f"mean@{n}": float(values.mean())}
    if n == 1:
        return metric
    metric[f"std@{n}"] = float(values.std())
    codes = None
    if preds is not None:
        index: dict[Any, int] = {}
        codes = np.array([index.setdefault(p, len(index)) for p in preds])
    for k in _sample_sizes(n):
        idx = _draws(n, k, N_BOOTSTRAP, seed)
        best, worst = values[idx].max(axis=1), values[idx].min(axis=1)
        metric[f"best@{k}/mean"], metric[f"best@{k}/std"] = float(best.mean()), float(best.std())
        metric[f"worst@{k}/mean"], metric[f"worst@{k}/std"] = float(worst.mean()), float(worst.std())
        if codes is not None:
            maj = _majority_values(values, codes, idx)
            metric[f"maj@{k}/mean"], metric[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return metric


def process_validation_metrics(data_sources: Sequence[str], sample_uids: Sequence[str],
                               infos_dict: dict[str, Sequence[Any]], seed: int = 42
                               ) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {variable: {metric: value}}} (veRL's function and structure): the metrics of
    each prompt, averaged over the prompts of the source. `infos_dict` maps a variable to one value a
    row (None: missing on that row); `pred` holds the answers maj@k votes on; text variables are not
    measured."""
    n_rows = len(data_sources)
    for name, column in infos_dict.items():
        if len(column) != n_rows:
            raise ValueError(f"validation metrics: '{name}' has {len(column)} values for {n_rows} rows")
    if len(sample_uids) != n_rows:
        raise ValueError(f"validation metrics: {len(sample_uids)} uids for {n_rows} rows")
    rows_of: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=True)):
        rows_of[(str(source), str(uid))].append(row)
    preds = infos_dict.get("pred")
    per_prompt: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for (source, _), rows in rows_of.items():
        for name, column in infos_dict.items():
            kept = [r for r in rows if column[r] is not None]
            if not kept or isinstance(column[kept[0]], str):
                continue
            values = np.array([float(column[r]) for r in kept], dtype=np.float64)
            votes = [preds[r] for r in kept] if preds is not None else None
            for metric, value in _prompt_metrics(values, votes, seed).items():
                per_prompt[source][name][metric].append(value)
    return {source: {name: {metric: float(np.mean(v)) for metric, v in metrics.items()}
                     for name, metrics in variables.items()}
            for source, variables in per_prompt.items()}


def pass_at_n(data_sources: Sequence[str], sample_uids: Sequence[str], infos_dict: dict[str, Sequence[Any]]
              ) -> dict[str, float]:
    """val-aux/<source>/<variable>/pass@<n>: the best of each prompt's n samples (n > 1), exactly, averaged
    over the prompts; for 0/1 scores the share of prompts with a correct sample, ASearcher's pass@k. (veRL's
    best@n draws n with replacement, so it misses samples and is lower.)"""
    rows_of: dict[tuple[str, str], list[int]] = defaultdict(list)
    for row, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=True)):
        rows_of[(str(source), str(uid))].append(row)
    best: dict[str, list[float]] = defaultdict(list)
    for (source, _), rows in rows_of.items():
        for name, column in infos_dict.items():
            values = [column[r] for r in rows if column[r] is not None]
            if len(values) > 1 and not isinstance(values[0], str):
                best[f"val-aux/{source}/{name}/pass@{len(values)}"].append(max(float(v) for v in values))
    return {key: float(np.mean(values)) for key, values in best.items()}


def validation_metrics(data_sources: Sequence[str], sample_uids: Sequence[str], infos_dict: dict[str, Sequence[Any]],
                       seed: int = 42) -> dict[str, float]:
    """val-core/<source>/<variable>/<metric> and val-aux/... (veRL's `_val_metrics_update`), and pass@n."""
    out: dict[str, float] = pass_at_n(data_sources, sample_uids, infos_dict)
    for source, variables in process_validation_metrics(data_sources, sample_uids, infos_dict, seed).items():
        core = "acc" if "acc" in variables else "reward"
        for name, metrics in variables.items():
            n_max = max(int(metric.split("@")[1].split("/")[0]) for metric in metrics)
            for metric, value in metrics.items():
                k = int(metric.split("@")[1].split("/")[0])
                section = "val-core" if name == core and metric.startswith(CORE_PREFIXES) and k == n_max else "val-aux"
                out[f"{section}/{source}/{name}/{metric}"] = value
    return out


def rows_infos(scores_B: Sequence[float], row_metrics: Sequence[dict[str, float]],
               answers_B: Sequence[str | None]) -> dict[str, list[Any]]:
    """The variables of a validation pass: `reward` (each row's score), each per-row metric of the val
    reward (f1, judge; None on a row without it) and `pred`, the extracted answer normalised as EM
    compares answers (no answer: ""), when the reward reports answers."""
    from verl.utils.reward_score.qa_em import normalize_answer

    infos: dict[str, list[Any]] = {"reward": [float(s) for s in scores_B]}
    for name in dict.fromkeys(name for row in row_metrics for name in row):
        infos[name] = [row.get(name) for row in row_metrics]
    if any(answer is not None for answer in answers_B):
        infos["pred"] = [normalize_answer(a) if a is not None else "" for a in answers_B]
    return infos
