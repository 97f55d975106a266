"""scripts/gpu_checks/actor_throughput.py: its model-FLOPs count reproduces the MFU the H200 run of
2026-11-26 reported (tests/utils/gpu_measurements/actor_throughput_*.json) from the same timings, and the
peak is chosen by the device's name. Its CPU path runs in tests/scripts/gpu_checks/test_run_all.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.gpu_checks.actor_throughput import model_flops, param_split, pass_flops, peak_tflops
from scripts.gpu_checks.memory_plan_vs_allocated import QWEN2_5_0_5B

REPO = Path(__file__).resolve().parents[3]
MEASURED = REPO / "tests" / "utils" / "gpu_measurements"


@pytest.mark.parametrize("size", ["0.5b", "3b_gc"])
def test_mfu_and_tokens_per_second_reproduce_the_h200_report(size: str) -> None:
    run = json.loads((MEASURED / f"actor_throughput_{size}.json").read_text())
    model = QWEN2_5_0_5B if run["config"] == "0.5b" else json.loads((REPO / run["config"]).read_text())
    row = run["prompt"] + run["response"]
    peak = peak_tflops(run["device"])
    assert peak == 989.0
    for kind in ("update", "log_prob"):
        flops = model_flops(kind, run["params"], model["num_hidden_layers"], model["hidden_size"], run["rows"], row)
        seconds = run[kind]["s"]                 # stored to 4 decimals: equal within that rounding
        assert flops / seconds / (peak * 1e12) == pytest.approx(run[kind]["mfu"], rel=1e-3), kind
        assert run["rows"] * row / seconds == pytest.approx(run[kind]["tokens_per_s"], rel=1e-3)
    # an update is 3x a pass's parameter FLOPs (forward + backward), attention 3x too
    assert model_flops("update", 10, 2, 4, 1, 8) == 3 * model_flops("log_prob", 10, 2, 4, 1, 8)


@pytest.mark.parametrize(("size", "update_mfu_useful"), [("0.5b", 0.1038), ("3b_gc", 0.3259)])
def test_the_baseline_counted_with_the_head_only_where_it_runs(size: str, update_mfu_useful: float) -> None:
    """mfu_useful of the same H200 timings: the tied head (V x h) only at the rows x response positions that
    predict a response token (the actor's logits_to_keep), not at every token: the 3B update's 35.1 % is
    32.6 % of the work it needed, the 0.5B's 12.4 % is 10.4 %."""
    run = json.loads((MEASURED / f"actor_throughput_{size}.json").read_text())
    model = QWEN2_5_0_5B if run["config"] == "0.5b" else json.loads((REPO / run["config"]).read_text())
    assert model["tie_word_embeddings"]
    head = model["vocab_size"] * model["hidden_size"]
    rows, row = run["rows"], run["prompt"] + run["response"]
    lengths = torch.full((rows,), row)
    needed = pass_flops("update", run["params"] - head, head, model["num_hidden_layers"], model["hidden_size"],
                        lengths, rows * run["response"])
    counted = model_flops("update", run["params"], model["num_hidden_layers"], model["hidden_size"], rows, row)
    assert counted - needed == pytest.approx(6 * head * rows * run["prompt"], rel=1e-9)   # the prompt positions
    assert needed / run["update"]["s"] / 989e12 == pytest.approx(update_mfu_useful, abs=5e-4)


def test_param_split_counts_a_tied_head_once_and_an_untied_embedding_not_at_all() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tied in (True, False):
        config = Qwen2Config(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(config)
        total = sum(p.numel() for p in model.parameters())
        body, head = param_split(model)
        assert head == 50 * 8 and body == total - head - (0 if tied else 50 * 8)


def test_the_peak_is_chosen_by_device_name() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Some Future GPU") is None
