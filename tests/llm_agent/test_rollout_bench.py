"""The rollout benchmark runs end to end and shows what the engine stop strings save."""

from __future__ import annotations

from scripts.bench.rollout import run_benchmark


def test_stop_strings_throw_away_under_five_percent_and_keep_the_same_tokens():
    result = run_benchmark(rows=4, max_turns=1, topk=2, model_hidden=32)
    on, off = result["stop_on"], result["stop_off"]
    assert on["thrown_away_fraction"] < 0.05
    assert off["thrown_away_fraction"] > 0.5  # the scripted model rambles past </search>
    assert result["same_kept_tokens"] and on["kept_tokens"] > 0
    assert on["searches"] == off["searches"] == 4 and on["search_failures"] == 0
    assert on["stop_reasons"]["answered"] == 4
    assert 0.0 <= on["retrieval_share"] <= 1.0 and on["retrieval_s"] > 0
