"""The actor's vocabulary head, fused: hidden states -> log-prob of the label and entropy.

The plain path (lm_head -> logits / T -> `logprobs_from_logits`, `entropy_from_logits`) is
chunked in its forward pass, but autograd keeps every chunk's fp32 copy, softmax and the
logits themselves for backward: ~18 bytes per position x vocabulary (~33 GB for 8 rows x
1.5k response tokens x 151,936 vocabulary). Here a custom autograd Function saves only the
hidden states, the labels and one float per row (the logsumexp, and E_p[z] for the
entropy); backward recomputes each chunk's logits. Saved bytes per token: H x dtype + 16,
whatever the vocabulary.

Under FSDP2 the lm_head weight is unsharded only inside the root module's forward, so the
actor does not call the Function on `model.lm_head.weight` from outside: it runs the model
with `lm_head_computes_log_probs`, which makes the model's own lm_head call return
[log-prob, entropy] per position instead of logits (the weight FSDP unsharded is used, and
the result is a root output, so FSDP's pre-backward hooks see it as they saw the logits).

    with lm_head_computes_log_probs(model.lm_head, labels_BR, temperature, True) as head:
        out = model(input_ids=..., logits_to_keep=keep)
    log_probs_BR, entropy_BR = head.read(out.logits)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Rows per chunk: bounds the forward/backward temporaries (the chunk's logits, their fp32
# copy and probabilities: ~14 bytes x rows x V) to about 2 GB at V = 152k.
HEAD_CHUNK_ROWS = 1024

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _chunk_logits(hidden_cH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                  temperature: float) -> torch.Tensor:
    """z = lm_head(hidden) / T, (c, V), in fp32 (fp64 for fp64 inputs): a fresh tensor the caller
    may overwrite. The matmul runs in the inputs' dtype, as the module's lm_head does; the
    softmax arithmetic after it in fp32."""
    logits_cV = F.linear(hidden_cH, weight_VH, bias_V)
    return logits_cV.to(torch.promote_types(logits_cV.dtype, torch.float32)).div_(temperature)


class _LogProbEntropyHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), bias (V,) | None, labels (M,)) -> (*lead, K) fp32 (fp64 for
    fp64 inputs), lead = the positions' shape (M in all): column 0 the log-prob of the label under
    softmax(z), then its entropy (with_entropy), then sum_v softmax(z)_v^2 (with_sum_pi_squared: the
    optimal token baseline's statistic, computed without gradient). The output is a fresh tensor,
    not a view, so a module may return it (FSDP2 warns about views among a root module's outputs).

    Autograd runs neither method with grad enabled, so the (c, V) temporaries are updated in place."""

    @staticmethod
    def forward(ctx: Any, hidden_MH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                labels_M: torch.Tensor, temperature: float, with_entropy: bool, chunk_rows: int,
                lead: tuple[int, ...], with_sum_pi_squared: bool = False) -> torch.Tensor:
        rows, dtype = hidden_MH.shape[0], torch.promote_types(hidden_MH.dtype, torch.float32)
        out = torch.empty(*lead, 1 + with_entropy + with_sum_pi_squared, dtype=dtype, device=hidden_MH.device)
        out_MK = out.view(rows, out.shape[-1])
        lse_M = torch.empty(rows, dtype=dtype, device=hidden_MH.device)
        mean_z_M = torch.empty(rows if with_entropy else 0, dtype=dtype, device=hidden_MH.device)
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            z_cV = _chunk_logits(hidden_MH[start:stop], weight_VH, bias_V, temperature)
            lse_c = torch.logsumexp(z_cV, dim=-1)
            lse_M[start:stop] = lse_c
            out_MK[start:stop, 0] = z_cV.gather(-1, labels_M[start:stop, None]).squeeze(-1) - lse_c
            if with_entropy or with_sum_pi_squared:
                p_cV = (z_cV - lse_c[:, None]).exp_()   # one (c, V) temporary beside z for both statistics
            if with_sum_pi_squared:   # a batched dot product: no second (c, V) tensor
                out_MK[start:stop, -1] = torch.bmm(p_cV[:, None, :], p_cV[:, :, None]).view(-1)
            if with_entropy:
                # H = lse - E_p[z]; E_p[z] is kept for the backward pass.
                mean_z_c = p_cV.mul_(z_cV).sum(dim=-1)
                mean_z_M[start:stop] = mean_z_c
                out_MK[start:stop, 1] = lse_c - mean_z_c
        ctx.save_for_backward(hidden_MH, weight_VH, bias_V, labels_M, lse_M, mean_z_M)
        ctx.temperature, ctx.with_entropy, ctx.chunk_rows = temperature, with_entropy, chunk_rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_MH, weight_VH, bias_V, labels_M, lse_M, mean_z_M = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        rows = hidden_MH.shape[0]
        grad_MK = grad_out.reshape(rows, grad_out.shape[-1]).to(lse_M.dtype)
        grad_hidden = torch.empty_like(hidden_MH) if need_hidden else None
        # Several chunks add into the weight's gradient: in fp32 when the weight is bf16/fp16,
        # so the sum is rounded once, as the plain path's single matmul rounds it.
        several = rows > chunk_rows
        acc_dtype = torch.float32 if several and weight_VH.dtype in _LOW_PRECISION else weight_VH.dtype
        grad_weight = torch.zeros(weight_VH.shape, dtype=acc_dtype, device=weight_VH.device) if need_weight else None
        grad_bias = torch.zeros(weight_VH.shape[0], dtype=lse_M.dtype, device=weight_VH.device) if need_bias else None
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            hidden_cH = hidden_MH[start:stop]
            z_cV = _chunk_logits(hidden_cH, weight_VH, bias_V, temperature)
            p_cV = (z_cV - lse_M[start:stop, None]).exp_()
            g_lp = grad_MK[start:stop, 0:1]
            # d logprob / dz_k = [k = label] - p_k;  d entropy / dz_k = -p_k (z_k - E_p[z]).
            if ctx.with_entropy:
                g_ent = grad_MK[start:stop, 1:2]
                dz_cV = z_cV.sub_(mean_z_M[start:stop, None]).mul_(-g_ent).sub_(g_lp).mul_(p_cV)
            else:
                dz_cV = p_cV.mul_(-g_lp)
            dz_cV.scatter_add_(-1, labels_M[start:stop, None], g_lp)
            del p_cV, z_cV
            # z = logits / T; the matmuls run in the weight's dtype, as lm_head's backward does.
            dlogits_cV = dz_cV.div_(temperature).to(weight_VH.dtype)
            del dz_cV
            if grad_hidden is not None:
                grad_hidden[start:stop] = dlogits_cV @ weight_VH
            if grad_weight is not None:
                if grad_weight.dtype == weight_VH.dtype:
                    grad_weight.addmm_(dlogits_cV.t(), hidden_cH)
                else:
                    grad_weight.add_(dlogits_cV.t() @ hidden_cH)
            if grad_bias is not None:
                grad_bias.add_(dlogits_cV.sum(dim=0, dtype=grad_bias.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias_V.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def log_probs_and_entropy(hidden_MH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                          labels_M: torch.Tensor, temperature: float = 1.0, calculate_entropy: bool = True,
                          chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z)[label] and entropy of softmax(z), z = (hidden @ weight.T + bias) / T.

    Returns fp32 (M,) log-probs and (M,) entropies (None unless `calculate_entropy`). Equal to
    the plain path's values; autograd saves O(M x H) bytes instead of O(M x V)."""
    if hidden_MH.dim() != 2 or labels_M.shape != hidden_MH.shape[:1]:
        raise ValueError(f"log_probs_and_entropy: hidden must be (M, H) and labels (M,); got hidden "
                         f"{tuple(hidden_MH.shape)}, labels {tuple(labels_M.shape)}")
    if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_MH.shape[1]:
        raise ValueError(f"log_probs_and_entropy: weight must be (V, H={hidden_MH.shape[1]}), "
                         f"got {tuple(weight_VH.shape)}")
    out_MK = _fused_head(hidden_MH, weight_VH, bias_V, labels_M, temperature, calculate_entropy, chunk_rows,
                         lead=(hidden_MH.shape[0],))
    return out_MK[:, 0], (out_MK[:, 1] if calculate_entropy else None)


def _fused_head(hidden_MH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                labels_M: torch.Tensor, temperature: float, calculate_entropy: bool,
                chunk_rows: int | None, lead: tuple[int, ...], calculate_sum_pi_squared: bool = False) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"log_probs_and_entropy: temperature must be > 0, got {temperature}")
    if calculate_sum_pi_squared and torch.is_grad_enabled() and (hidden_MH.requires_grad or weight_VH.requires_grad):
        # the backward gives this column no gradient; a loss built on it would be silently wrong
        raise ValueError("the fused log-prob head computes sum_pi_squared without gradient: call it under "
                         "torch.no_grad() (the old-log-prob pass)")
    rows = int(chunk_rows or HEAD_CHUNK_ROWS)
    return _LogProbEntropyHead.apply(hidden_MH, weight_VH, bias_V, labels_M.long(), float(temperature),
                                     bool(calculate_entropy), rows, tuple(lead), bool(calculate_sum_pi_squared))


@dataclass
class FusedHeadCall:
    """What the patched lm_head produced during one `lm_head_computes_log_probs` block."""

    calculate_entropy: bool
    outputs: list[torch.Tensor] = field(default_factory=list)
    calculate_sum_pi_squared: bool = False

    def read(self, model_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log_probs, entropy | None), shaped like the labels, from the model output's `logits`.

        Refuses a model that called its lm_head more than once or transformed the head's output
        (logit soft-capping, scaling): the columns would then not be log-probs."""
        if len(self.outputs) != 1 or model_logits is not self.outputs[0]:
            raise RuntimeError(
                f"the fused log-prob head needs a model whose output `logits` is its lm_head's output "
                f"unchanged, produced once (lm_head ran {len(self.outputs)} time(s)); this model "
                "post-processes its logits (e.g. soft-capping or a logit scale)")
        out = self.outputs[0]
        return out[..., 0], (out[..., 1] if self.calculate_entropy else None)

    def sum_pi_squared(self, model_logits: torch.Tensor) -> torch.Tensor:
        """sum_v pi_v^2 per position, shaped like the labels (`calculate_sum_pi_squared=True` only)."""
        if not self.calculate_sum_pi_squared:
            raise RuntimeError("the fused head ran without calculate_sum_pi_squared")
        self.read(model_logits)   # the same checks
        return self.outputs[0][..., -1]


@contextmanager
def lm_head_computes_log_probs(lm_head: nn.Module, labels: torch.Tensor, temperature: float,
                               calculate_entropy: bool, chunk_rows: int | None = None,
                               calculate_sum_pi_squared: bool = False) -> Iterator[FusedHeadCall]:
    """While active, `lm_head(hidden (*lead, H))` returns (*lead, 1 or 2) fp32 — the log-prob of
    `labels` (shape `lead`) and the entropy — instead of (*lead, V) logits.

    The weight is read from the module when it is called, i.e. inside the model's forward,
    where FSDP2 has unsharded it. Forward hooks on `lm_head` still run (they see the hidden
    states as their input)."""
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(f"the fused log-prob head needs an nn.Linear output embedding, got {type(lm_head).__name__}")
    if "forward" in vars(lm_head):
        raise RuntimeError("lm_head.forward is already overridden on this module (nested fused-head block?)")
    call = FusedHeadCall(calculate_entropy=calculate_entropy, calculate_sum_pi_squared=calculate_sum_pi_squared)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lead = hidden.shape[:-1]
        if lead != labels.shape:
            raise ValueError(f"fused log-prob head: lm_head got hidden states for positions {tuple(lead)} but "
                             f"labels have shape {tuple(labels.shape)}")
        out = _fused_head(hidden.reshape(-1, hidden.shape[-1]), lm_head.weight, lm_head.bias, labels.reshape(-1),
                          temperature, calculate_entropy, chunk_rows, lead=tuple(lead),
                          calculate_sum_pi_squared=calculate_sum_pi_squared)
        call.outputs.append(out)
        return out

    lm_head.forward = forward
    try:
        yield call
    finally:
        del lm_head.forward


class SavedTensorBytes:
    """Bytes autograd saves for backward inside the block: each saved tensor's whole storage
    (a saved view keeps its base alive), counted once per storage, leaving out the storages of
    `exclude` (parameters: they live anyway, saved by reference).

        with SavedTensorBytes(exclude=model.parameters()) as saved:
            loss = f(x); ...
        saved.nbytes
    """

    def __init__(self, exclude: Any = ()) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._seen: set[int] = set()
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.nbytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
