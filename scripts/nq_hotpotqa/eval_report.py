"""evaluate.sh's report: EM, token F1 and (with a judge) judge accuracy per data source, and overall.

Validation (`+trainer.val_only=true`) logs `val/test_score/<source>` (EM), `val/test_f1/<source>`
and, when `reward_model.judge.url` is set, `val/test_judge/<source>` (the judge's accuracy over
the rows it gave a verdict for; exact matches count as correct without a call). The overall
figures weight each source by its number of rows in the evaluated parquet, so they are means
over all rows, as the paper reports per benchmark (nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa, musique, bamboogle: `data_source` of FlashRAG's test or dev split).

With `evaluate.sh --n K` validation samples K responses per question (rollout.val_kwargs) and the report
adds ASearcher's figures per source: `avg@K/<source>`, the mean EM over the K samples (veRL's
val-core/<source>/reward/mean@K), and `pass@K/<source>`, the share of questions with a correct sample
among the K (val-aux/<source>/reward/pass@K); with a judge also `avg@K_judge/` and `pass@K_judge/`; each
with a row-weighted `overall_avg@K`, `overall_pass@K` (`_judge`). `val/test_score/<source>` is then the
mean over all samples, the same number as avg@K.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

METRICS = {"val/test_score/": "overall", "val/test_f1/": "overall_f1", "val/test_judge/": "overall_judge"}
# validation's per-prompt metrics over K samples -> (the report's name, its suffix for the judge's figures)
SAMPLED = re.compile(r"val-(?:core|aux)/(?P<source>[^/]+)/(?P<var>reward|judge)/(?P<kind>mean|pass)@(?P<k>\d+)")


def sampled_figures(values: Mapping[str, float]) -> dict[str, float]:
    """avg@K/<source>, pass@K/<source> (and _judge) from validation's metrics over K > 1 samples."""
    out = {}
    for key, value in values.items():
        match = SAMPLED.fullmatch(key)
        if match is None or int(match["k"]) < 2:
            continue
        name = ("avg" if match["kind"] == "mean" else "pass") + f"@{match['k']}"
        out[f"{name}{'_judge' if match['var'] == 'judge' else ''}/{match['source']}"] = float(value)
    return out


def summarize(history: Sequence[Mapping[str, float]], row_counts: Mapping[str, int]) -> dict[str, float]:
    """Per-source EM/F1/judge from the run's metric records, plus row-weighted overall figures.

    ValueError when validation logged no EM at all (nothing was evaluated)."""
    values = {key: float(value) for record in history for key, value in record.items()
              if any(key.startswith(prefix) for prefix in METRICS)}
    if not any(key.startswith("val/test_score/") for key in values):
        raise ValueError("validation produced no val/test_score/* metrics")
    sampled = sampled_figures({key: value for record in history for key, value in record.items()})
    values.update(sampled)
    report = dict(sorted(values.items()))
    prefixes = dict(METRICS)
    prefixes.update({key.rsplit("/", 1)[0] + "/": "overall_" + key.rsplit("/", 1)[0] for key in sampled})
    for prefix, overall in prefixes.items():
        per_source = {key[len(prefix):]: value for key, value in values.items() if key.startswith(prefix)}
        if not per_source:
            continue
        unknown = sorted(set(per_source) - set(row_counts))
        if unknown:
            raise ValueError(f"sources {unknown} were scored but are not in the evaluated parquet")
        rows = sum(row_counts[source] for source in per_source)
        report[overall] = sum(per_source[source] * row_counts[source] for source in per_source) / rows
    return report
