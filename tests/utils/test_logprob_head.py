"""The fused log-prob / entropy head: same values and gradients as the plain path, and
autograd memory that does not grow with the vocabulary (issue 21 item 19)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from verl.utils import torch_functional as tf
from verl.utils.logprob_head import SavedTensorBytes, lm_head_computes_log_probs, log_probs_and_entropy

torch.set_num_threads(1)


def random_head(rows: int, hidden: int, vocab: int, dtype: torch.dtype = torch.float64, bias: bool = True,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden)).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, b, labels


def plain_head(h, w, b, labels, temperature):
    """The path the actor took before: lm_head -> / T -> chunked log-prob and entropy helpers
    (these compute in fp32 whatever the input dtype)."""
    logits = nn.functional.linear(h, w, b) / temperature
    return tf.logprobs_from_logits(logits, labels), tf.entropy_from_logits(logits)


def log_softmax_head(h, w, b, labels, temperature):
    """The textbook reference, in the inputs' dtype: full log_softmax over the vocabulary."""
    log_softmax = torch.log_softmax(nn.functional.linear(h, w, b) / temperature, dim=-1)
    return log_softmax.gather(-1, labels[:, None]).squeeze(-1), -(log_softmax.exp() * log_softmax).sum(-1)


@pytest.mark.parametrize("chunk_rows", [3, 1024])
@pytest.mark.parametrize("bias", [True, False])
def test_values_equal_log_softmax_reference(chunk_rows, bias):
    h, w, b, labels = random_head(10, 6, 13, bias=bias)
    log_probs, entropy = log_probs_and_entropy(h, w, b, labels, temperature=0.7, chunk_rows=chunk_rows)
    ref_lp, ref_ent = log_softmax_head(h, w, b, labels, 0.7)
    torch.testing.assert_close(log_probs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-12, rtol=0)
    only_lp, no_entropy = log_probs_and_entropy(h, w, b, labels, temperature=0.7, calculate_entropy=False)
    assert no_entropy is None
    torch.testing.assert_close(only_lp, log_probs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("calculate_entropy", [True, False])
@pytest.mark.parametrize("chunk_rows", [3, 1024])
def test_sum_pi_squared_equals_the_softmax_squares_and_leaves_the_other_columns(calculate_entropy, chunk_rows):
    h, w, b, labels = random_head(10, 6, 13)
    probs = torch.softmax(nn.functional.linear(h, w, b) / 0.7, dim=-1)
    head = nn.Linear(6, 13, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
        with lm_head_computes_log_probs(head, labels, 0.7, calculate_entropy, chunk_rows=chunk_rows,
                                        calculate_sum_pi_squared=True) as fused:
            out = head(h)
        log_probs, entropy = fused.read(out)
        sum_pi_squared = fused.sum_pi_squared(out)
    ref_lp, ref_ent = log_softmax_head(h, w, b, labels, 0.7)
    torch.testing.assert_close(sum_pi_squared, (probs * probs).sum(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(log_probs, ref_lp.detach(), atol=1e-12, rtol=0)
    if calculate_entropy:
        torch.testing.assert_close(entropy, ref_ent.detach(), atol=1e-12, rtol=0)
    else:
        assert entropy is None
    # a column with no gradient is refused where autograd would differentiate through it
    with pytest.raises(ValueError, match="computes sum_pi_squared without gradient"):
        with lm_head_computes_log_probs(head, labels, 0.7, calculate_entropy,
                                        calculate_sum_pi_squared=True):
            head(h)
    with lm_head_computes_log_probs(head, labels, 0.7, calculate_entropy) as plain, torch.no_grad():
        out = head(h)
    with pytest.raises(RuntimeError, match="without calculate_sum_pi_squared"):
        plain.sum_pi_squared(out)


@pytest.mark.parametrize("calculate_entropy", [True, False])
@pytest.mark.parametrize("chunk_rows", [3, 1024])
def test_gradients_pass_gradcheck_in_double(calculate_entropy, chunk_rows):
    h, w, b, labels = random_head(7, 5, 11)

    def head(h, w, b):
        log_probs, entropy = log_probs_and_entropy(h, w, b, labels, 1.3, calculate_entropy, chunk_rows)
        return (log_probs, entropy) if calculate_entropy else log_probs

    assert torch.autograd.gradcheck(head, (h, w, b))


def test_gradients_equal_the_plain_path_with_a_tied_embedding():
    """Both outputs weighted, several chunks, and the head's weight also used as an input
    embedding (tie_word_embeddings): its gradient sums both uses, as with the plain path."""
    torch.manual_seed(0)
    vocab, hidden, rows = 50, 8, 9
    weight = nn.Parameter(torch.randn(vocab, hidden, dtype=torch.float64) / 3)
    token_ids = torch.randint(0, vocab, (rows,))
    labels = torch.randint(0, vocab, (rows,))
    g_lp, g_ent = torch.randn(rows, dtype=torch.float64), torch.randn(rows, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        weight.grad = None
        hidden_states = torch.tanh(nn.functional.embedding(token_ids, weight) * 2)
        if fused:
            log_probs, entropy = log_probs_and_entropy(hidden_states, weight, None, labels, 0.6, chunk_rows=4)
        else:
            log_probs, entropy = log_softmax_head(hidden_states, weight, None, labels, 0.6)
        ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
        grads.append(weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=0)


def test_fp32_values_and_gradients_equal_the_previous_chunked_path():
    """The actor's previous head (logprobs_from_logits / entropy_from_logits on lm_head logits)
    and the fused one agree in fp32, over several chunks, with a bias."""
    h, w, b, labels = random_head(37, 16, 500, dtype=torch.float32, seed=5)
    h2, w2, b2 = (t.detach().clone().requires_grad_() for t in (h, w, b))
    g = torch.Generator().manual_seed(6)
    g_lp, g_ent = torch.randn(37, generator=g), torch.randn(37, generator=g)
    log_probs, entropy = log_probs_and_entropy(h, w, b, labels, 1.7, chunk_rows=8)
    ref_lp, ref_ent = plain_head(h2, w2, b2, labels, 1.7)
    # fp32 over a 500-way softmax: summation-order rounding, ~1e-6 on values of size < 10.
    torch.testing.assert_close(log_probs, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=0)
    ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    for mine, ref in ((h.grad, h2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(mine, ref, atol=1e-6 + 1e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("chunk_rows", [16, 1024])
def test_bf16_inputs_keep_dtypes_and_match_the_plain_bf16_path(chunk_rows):
    """Under FSDP mixed precision the hidden states and weight are bf16: the matmul runs in bf16
    as lm_head's does, the softmax in fp32, gradients come back in bf16."""
    h, w, _, labels = random_head(40, 16, 300, dtype=torch.bfloat16, bias=False, seed=3)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    log_probs, entropy = log_probs_and_entropy(h, w, None, labels, 0.9, chunk_rows=chunk_rows)
    ref_lp, ref_ent = plain_head(h2, w2, None, labels, 0.9)
    assert log_probs.dtype == entropy.dtype == torch.float32
    # The plain path divides bf16 logits by T in bf16 (one more rounding, ~4e-3 relative).
    torch.testing.assert_close(log_probs, ref_lp, atol=0.05, rtol=0.02)
    torch.testing.assert_close(entropy, ref_ent, atol=0.05, rtol=0.02)
    (log_probs.sum() - entropy.sum()).backward()
    (ref_lp.sum() - ref_ent.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    for mine, ref in ((h.grad, h2.grad), (w.grad, w2.grad)):
        error = float((mine.float() - ref.float()).norm() / ref.float().norm())
        assert error < 0.02, error   # bf16 rounding is ~0.4% per step; a wrong gradient is O(1)


def test_no_positions_give_empty_outputs_and_zero_gradients():
    h, w, b, labels = random_head(0, 4, 9)
    log_probs, entropy = log_probs_and_entropy(h, w, b, labels)
    assert log_probs.shape == entropy.shape == (0,)
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.count_nonzero(w.grad) == 0 and h.grad.shape == (0, 4)


def saved_bytes_per_token(rows: int, hidden: int, vocab: int, calculate_entropy: bool = True) -> float:
    h, w, _, labels = random_head(rows, hidden, vocab, dtype=torch.float32, bias=False)
    with SavedTensorBytes(exclude=[w]) as saved:
        log_probs, entropy = log_probs_and_entropy(h, w, None, labels, 0.8, calculate_entropy, chunk_rows=64)
        loss = log_probs.sum() + (entropy.sum() if entropy is not None else 0)
    loss.backward()
    return saved.nbytes / rows


@pytest.mark.parametrize("calculate_entropy", [True, False])
def test_saved_bytes_per_token_are_o_hidden_and_do_not_grow_with_vocab(calculate_entropy):
    """Parameters (the head's weight) are left out of the count: they are saved by reference.
    The plain path saves ~18 x V bytes per token here (measured: 73.9 KB at V=4096, 590 KB at
    V=32768, H=64); the fused head saves the hidden state (4 x H), the label (8) and two floats."""
    hidden = 64
    small = saved_bytes_per_token(256, hidden, 4096, calculate_entropy)
    large = saved_bytes_per_token(256, hidden, 32768, calculate_entropy)
    assert small < 4 * (hidden + 64) + 16
    assert large == pytest.approx(small, abs=1.0)


def test_saved_tensor_bytes_counts_a_storage_once_and_skips_excluded():
    w = nn.Parameter(torch.randn(100, 10))
    x = torch.randn(3, 10, requires_grad=True)
    with SavedTensorBytes(exclude=[w]) as saved:
        y = (x @ w.t()).sum() + (x * x).sum()
    y.backward()
    assert saved.nbytes == x.numel() * 4   # x saved by two ops, counted once; w left out


class SoftCapped(nn.Module):
    """A model that post-processes its lm_head output, as Gemma 2's soft-capping does."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(4, 9, bias=False)

    def forward(self, hidden):
        return 30 * torch.tanh(self.lm_head(hidden) / 30)


def test_lm_head_block_returns_log_probs_and_restores_the_module():
    head = nn.Linear(6, 13, dtype=torch.float64)
    h, _, _, labels = random_head(8, 6, 13)
    h_BRH, labels_BR = h.detach().reshape(2, 4, 6), labels.reshape(2, 4)
    with lm_head_computes_log_probs(head, labels_BR, 0.5, calculate_entropy=True) as call:
        out = head(h_BRH)
    log_probs, entropy = call.read(out)
    ref_lp, ref_ent = log_softmax_head(h.detach(), head.weight, head.bias, labels, 0.5)
    assert log_probs.shape == (2, 4)
    ref_lp, ref_ent = ref_lp.reshape(2, 4), ref_ent.reshape(2, 4)
    torch.testing.assert_close(log_probs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-12, rtol=0)
    assert "forward" not in vars(head) and head(h_BRH).shape == (2, 4, 13)


def test_lm_head_block_refuses_bad_input():
    model = SoftCapped()
    labels = torch.zeros(3, dtype=torch.long)
    with lm_head_computes_log_probs(model.lm_head, labels, 1.0, True) as call:
        out = model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="post-processes its logits"):
        call.read(out)
    with pytest.raises(ValueError, match=r"positions \(5,\) but labels have shape \(3,\)"):
        with lm_head_computes_log_probs(model.lm_head, labels, 1.0, True):
            model.lm_head(torch.randn(5, 4))
    assert "forward" not in vars(model.lm_head)
    with pytest.raises(TypeError, match="nn.Linear"):
        with lm_head_computes_log_probs(nn.Identity(), labels, 1.0, True):
            pass
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_and_entropy(torch.randn(3, 4), torch.randn(9, 4), None, labels, temperature=0.0)
