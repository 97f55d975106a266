"""scripts/bench/packing.py and scripts/gpu_checks/packing_throughput.py (issue 35 item 4): the demo's
length distribution, the useful-FLOPs count, and one tiny CPU run of the GPU check's path whose padded
and packed results agree (timings are not asserted: the figures are in docs/packing.md)."""

from __future__ import annotations

import pytest
import torch

from scripts.bench import packing
from scripts.gpu_checks import packing_throughput
from verl.utils import batch_keys as K


def test_demo_lengths_follow_the_measured_distribution():
    prompts, responses = packing.demo_lengths(2000, seed=0)
    d = packing.DEMO_LENGTHS
    assert d["prompt_min"] <= int(prompts.min()) and int(prompts.max()) <= d["prompt_max"]
    assert d["response_min"] <= int(responses.min()) and int(responses.max()) <= d["response_max"]
    assert abs(float(responses.float().mean()) - d["response_mean"]) < 5     # measured: ~70
    scaled_prompts, _ = packing.demo_lengths(2000, seed=0, scale=4.0)
    assert torch.allclose(scaled_prompts.float(), (prompts.float() * 4).round())


def test_demo_batch_is_a_left_and_right_padded_rollout_with_an_observation_masked():
    t = packing.demo_batch(vocab_size=50, rows=6, seed=1)
    mask, responses = t[K.ATTENTION_MASK], t[K.RESPONSES]
    r = responses.shape[1]
    prompt_lens, response_lens = packing.demo_lengths(6, seed=1)
    assert torch.equal(mask[:, :-r].sum(-1), prompt_lens) and torch.equal(mask[:, -r:].sum(-1), response_lens)
    assert bool((mask[:, 0] == 0).any()) and bool((mask[:, -1] == 0).any())   # left and right padding
    assert torch.equal(t[K.POSITION_IDS][mask.bool()].reshape(-1)[:1], torch.tensor([0]))
    long_rows = response_lens > 20
    assert bool((t[K.RESPONSE_MASK][long_rows, 8:20] == 0).all())
    assert torch.equal(t[K.RESPONSE_MASK][:, :8], mask[:, -r:][:, :8])


def test_pass_flops_count_the_head_only_at_the_positions_it_runs():
    from scripts.gpu_checks.actor_throughput import pass_flops

    lengths = torch.tensor([3, 5])
    # body at every real token, the head at 4 kept positions, attention as useful_flops
    assert pass_flops("log_prob", 6, 4, 2, 4, lengths, 4) == 2 * (6 * 8 + 4 * 4) + 4 * 2 * 4 * (9 + 25)
    assert packing.useful_flops("log_prob", 10, 2, 4, lengths) - pass_flops("log_prob", 6, 4, 2, 4, lengths, 4) \
        == 2 * 4 * (8 - 4)


def test_useful_flops_count_real_tokens_and_pairs_within_sequences():
    lengths = torch.tensor([3, 5])
    # 2N per token + 4 L h per token pair within a sequence (log-prob pass); 3x for an update
    assert packing.useful_flops("log_prob", 10, 2, 4, lengths) == 2 * 10 * 8 + 4 * 2 * 4 * (9 + 25)
    assert packing.useful_flops("update", 10, 2, 4, lengths) == 3 * packing.useful_flops("log_prob", 10, 2, 4, lengths)


def test_gpu_check_runs_padded_and_packed_with_equal_results_on_cpu(tmp_path):
    out = tmp_path / "packing.json"
    report = packing_throughput.main(["--device", "cpu", "--tiny", "--only", "0.5b", "--length-scale", "0.25",
                                      "--repeats", "1", "--out", str(out)])
    run = report["0.5b"]
    assert run["padded"]["attn_implementation"] == "sdpa"
    assert run["packed"]["attn_implementation"] == "search_r1_varlen"
    assert run["packed_by_tokens"]["attn_implementation"] == "search_r1_varlen"
    # by tokens: micro-batches filled up to a padded micro-batch's tokens, so fewer of them
    micro = run["batch"]["micro_batches"]
    assert run["batch"]["by_tokens_budget"] == 2 * run["batch"]["padded_row_length"]
    assert 1 <= micro["by_tokens"] <= micro["fixed"] == 2
    for mode in ("padded", "packed", "packed_by_tokens"):
        for kind in ("log_prob", "update"):
            assert run[mode][kind]["tokens_per_s"] > 0 and run[mode][kind]["mfu"] > 0
    # fp32 on CPU: the same forward up to summation order (~1e-6 on log-probs of size < 10)
    assert run["equal_results"]["max_abs_log_prob_diff"] < 1e-4
    assert run["equal_results"]["grad_norm_rel_diff"] < 1e-4
    assert run["batch"]["real_tokens"] < run["batch"]["padded_tokens"]
    assert out.is_file()
    with pytest.raises(SystemExit, match="not one of"):
        packing_throughput.main(["--device", "cpu", "--only", "7b"])


def test_each_mode_frees_its_actor_before_the_next_builds_and_the_padded_one_also_times_full_rows(monkeypatch):
    """At 3B an actor holds ~46 GiB: one left alive puts the next mode's build out of an H100's memory. The
    padded actor is also timed on full rows (actor_throughput's measurement, the baseline's shape), and
    each pass reports mfu_useful below mfu (the head counted only where it runs)."""
    import gc
    import weakref

    from scripts.gpu_checks import memory_plan_vs_allocated as check

    built: list[weakref.ref] = []
    real_build = check.build_actor

    def tracking_build(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in built), "an earlier mode's actor is still alive"
        actor = real_build(*args, **kwargs)
        built.append(weakref.ref(actor.module))
        return actor

    monkeypatch.setattr(check, "build_actor", tracking_build)
    full = check.BatchShape(4, 2, 16, 8)
    run = packing.run_bench(check.TINY, 4, 2, "cpu", [], repeats=1, scale=0.25, full_rows=full)
    assert len(built) == 3
    rows = run["padded"]["full_rows"]
    assert (rows["rows"], rows["prompt_length"], rows["response_length"]) == (4, 16, 8)
    assert rows["update"]["tokens_per_s"] > 0 and "full_rows" not in run["packed"]
    for mode in ("padded", "packed", "packed_by_tokens"):
        for kind in ("log_prob", "update"):
            assert 0 < run[mode][kind]["mfu_useful"] < run[mode][kind]["mfu"], (mode, kind)
