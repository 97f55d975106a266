"""Masked statistics, log-probs, masks, padding, loss aggregation and LR schedules."""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils import torch_functional as tf


def test_masked_statistics_ignore_masked_out_entries():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # kept: 1, 2, 3, 4 -> sum 10, mean 2.5, unbiased var = (2.25+0.25+0.25+2.25)/3 = 5/3
    assert tf.masked_sum(values, mask).item() == pytest.approx(10.0)
    assert tf.masked_mean(values, mask).item() == pytest.approx(2.5)
    assert tf.masked_var(values, mask).item() == pytest.approx(5.0 / 3.0)
    assert tf.masked_var(values, mask, unbiased=False).item() == pytest.approx(1.25)
    # per row: row 0 -> (1+2)/2 = 1.5; row 1 -> (3+4)/2 = 3.5
    assert tf.masked_mean(values, mask, axis=-1).tolist() == pytest.approx([1.5, 3.5])


def test_masked_whiten_has_zero_mean_unit_variance_on_mask():
    values = torch.tensor([[1.0, 2.0, 100.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    whitened = tf.masked_whiten(values, mask)
    # Small-integer inputs: fp32 mean and variance are exact to a few ulps; 1e-6 / 1e-5 are ample.
    assert tf.masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert tf.masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-5)
    # shift_mean=False keeps the original mean (2.5)
    assert tf.masked_mean(tf.masked_whiten(values, mask, shift_mean=False), mask).item() == pytest.approx(2.5)


def test_logprobs_match_log_softmax_even_when_chunked(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    # gather - logsumexp vs log_softmax over 11 fp32 values of size ~1: results of size < 5 agree
    # to a few ulps (~1e-7); 1e-6 is ten times that on any CPU.
    assert torch.allclose(tf.logprobs_from_logits(logits, labels), expected, atol=1e-6)
    monkeypatch.setattr(tf, "_LOGPROB_CHUNK_ROWS", 4)  # 15 rows -> 4 chunks
    assert torch.allclose(tf.logprobs_from_logits(logits, labels), expected, atol=1e-6)


def test_entropy_is_the_same_chunked_or_not(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(4, 3, 13) * 3
    probs = torch.softmax(logits, -1)
    expected = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    monkeypatch.setattr(tf, "_LOGPROB_CHUNK_ROWS", 5)   # 12 rows -> 3 chunks
    # Entropies of 13 classes are < log(13) ~ 2.6; the two fp32 formulas agree to ~1e-6.
    torch.testing.assert_close(tf.entropy_from_logits(logits), expected, atol=1e-5, rtol=0)


def test_micro_batch_share_is_the_token_share_for_token_mean():
    micro = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert tf.micro_batch_share(micro, 8.0, 2, 6, "token-mean") == 4 / 8
    assert tf.micro_batch_share(micro, 8.0, 2, 6, "seq-mean-token-mean") == 2 / 6
    assert tf.micro_batch_share(micro, 8.0, 2, 6, "seq-mean-token-sum") == 2 / 6


def test_entropy_of_uniform_and_peaked_logits():
    uniform = torch.zeros(1, 4)
    assert tf.entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert tf.entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_clip_by_value_with_tensor_bounds():
    x = torch.tensor([-5.0, 0.5, 5.0])
    assert tf.clip_by_value(x, torch.tensor([-1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 2.0])).tolist() == [-1.0, 0.5, 2.0]


def test_response_mask_includes_first_eos_only():
    eos = 9
    ids = torch.tensor([[5, 6, eos, 7, eos], [5, 6, 7, 8, 1], [eos, 1, 1, 1, 1]])
    assert tf.get_response_mask(ids, eos, torch.long).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_position_ids_follow_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert tf.compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_padding_helpers():
    padded = tf.pad_2d_list_to_length([[1, 2, 3], [4]], pad_token_id=0, max_length=5)
    assert padded.tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]]
    t = torch.tensor([[1, 2]])
    assert tf.pad_sequence_to_length(t, 4, 0).tolist() == [[1, 2, 0, 0]]
    assert tf.pad_sequence_to_length(t, 4, 0, left_pad=True).tolist() == [[0, 0, 1, 2]]
    assert tf.pad_sequence_to_length(t, 1, 0) is t


def test_agg_loss_modes_weigh_rows_differently():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # token-mean: (1+1+1+1+4)/5 = 1.6
    assert tf.agg_loss(loss, mask, "token-mean").item() == pytest.approx(1.6)
    # seq-mean-token-sum: (4 + 4)/2 = 4
    assert tf.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(4.0)
    # seq-mean-token-mean: (1 + 4)/2 = 2.5
    assert tf.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="token-median"):
        tf.agg_loss(loss, mask, "token-median")


def test_seq_mean_losses_leave_out_rows_with_no_token_in_the_loss():
    # row 1 lost every token (rollout-correction rejection): it is not a row of the mean
    loss = torch.tensor([[1.0, 3.0, 0.0], [7.0, 7.0, 7.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert tf.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((4.0 + 2.0) / 2)
    assert tf.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 2.0) / 2)
    assert tf.agg_loss(loss, mask, "token-mean").item() == pytest.approx(6.0 / 3)
    assert tf.rows_with_tokens(mask) == 2
    # no row left: 0, not NaN
    for mode in tf.LOSS_AGG_MODES:
        assert tf.agg_loss(loss, torch.zeros(3, 3), mode).item() == 0.0


def test_masked_statistics_and_losses_are_blind_to_nan_and_inf_outside_the_mask():
    values = torch.tensor([[1.0, float("nan"), 3.0], [float("-inf"), 2.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    assert tf.masked_sum(values, mask).item() == 6.0
    assert tf.masked_mean(values, mask, axis=-1).tolist() == [2.0, 2.0]
    for mode in tf.LOSS_AGG_MODES:
        loss = tf.agg_loss(values, mask, mode)
        assert torch.isfinite(loss), mode
        (grad,) = torch.autograd.grad(loss, values)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all(), mode


def test_micro_batch_share_of_seq_mean_counts_rows_with_a_loss_token():
    # the caller passes rows_with_tokens of the micro-batch and of the mini-batch (over all ranks)
    micro = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert tf.micro_batch_share(micro, 5.0, tf.rows_with_tokens(micro), 3, "seq-mean-token-sum") == 1 / 3
    assert tf.micro_batch_share(micro, 5.0, tf.rows_with_tokens(micro), 3, "seq-mean-token-sum", dp_size=2) == 2 / 3
    # a mini-batch rejected whole: share 0, not a division by zero
    empty = torch.zeros(2, 3)
    assert tf.micro_batch_share(empty, 0.0, tf.rows_with_tokens(empty), 0, "seq-mean-token-mean") == 0.0
    assert tf.micro_batch_share(empty, 0.0, 0, 0, "token-mean") == 0.0


def _lrs(scheduler, optimizer, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_constant_schedule_warms_up_linearly():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = tf.get_constant_schedule_with_warmup(opt, num_warmup_steps=2)
    assert _lrs(sched, opt, 4) == pytest.approx([0.0, 0.5, 1.0, 1.0])


def test_cosine_schedule_decays_to_min_ratio():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = tf.get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=5, min_lr_ratio=0.1)
    lrs = _lrs(sched, opt, 6)
    # step 1: start of decay -> 1.0; step 3: halfway -> 0.1 + 0.9*0.5 = 0.55; step 5: 0.1
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(1.0)
    assert lrs[3] == pytest.approx(0.55)
    assert lrs[5] == pytest.approx(0.1)


def test_logprobs_gradient_matches_log_softmax(monkeypatch):
    monkeypatch.setattr(tf, "_LOGPROB_CHUNK_ROWS", 2)
    torch.manual_seed(1)
    logits = torch.randn(5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (5,))
    tf.logprobs_from_logits(logits, labels).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, labels[:, None]).sum().backward()
    # Gradients are onehot - softmax, entries in [-1, 1]: two fp32 formulas agree to ~1e-7.
    assert torch.allclose(ours, logits.grad, atol=1e-6)
