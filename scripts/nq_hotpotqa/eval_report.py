"""evaluate.sh's report: EM, token F1 and (with a judge) judge accuracy per data source, and overall.

Validation (`+trainer.val_only=true`) logs `val/test_score/<source>` (EM), `val/test_f1/<source>`
and, when `reward_model.judge.url` is set, `val/test_judge/<source>` (the judge's accuracy over
the rows it gave a verdict for; exact matches count as correct without a call). The overall
figures weight each source by its number of rows in the evaluated parquet, so they are means
over all rows, as the paper reports per benchmark (nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa, musique, bamboogle: `data_source` of FlashRAG's test or dev split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

METRICS = {"val/test_score/": "overall", "val/test_f1/": "overall_f1", "val/test_judge/": "overall_judge"}


def summarize(history: Sequence[Mapping[str, float]], row_counts: Mapping[str, int]) -> dict[str, float]:
    """Per-source EM/F1/judge from the run's metric records, plus row-weighted overall figures.

    ValueError when validation logged no EM at all (nothing was evaluated)."""
    values = {key: float(value) for record in history for key, value in record.items()
              if any(key.startswith(prefix) for prefix in METRICS)}
    if not any(key.startswith("val/test_score/") for key in values):
        raise ValueError("validation produced no val/test_score/* metrics")
    report = dict(sorted(values.items()))
    for prefix, overall in METRICS.items():
        per_source = {key[len(prefix):]: value for key, value in values.items() if key.startswith(prefix)}
        if not per_source:
            continue
        unknown = sorted(set(per_source) - set(row_counts))
        if unknown:
            raise ValueError(f"sources {unknown} were scored but are not in the evaluated parquet")
        rows = sum(row_counts[source] for source in per_source)
        report[overall] = sum(per_source[source] * row_counts[source] for source in per_source) / rows
    return report
