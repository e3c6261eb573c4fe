"""The output layer and cross entropy as one autograd step, the logits never kept (TP = 1).

:mod:`megatron.training.loss_chunks` runs megatron-core's output layer and vocab-parallel
cross entropy a chunk of tokens at a time under activation checkpointing. That keeps memory
down, but the cross entropy works on an fp32 copy of the logits in several elementwise
passes, and backward recomputes all of them: at 128K tokens on the Qwen2.5-0.5B preset
(vocab 151,936), Run 7's profiled steps spent ~1 s of a ~4 s sparse step in fp32 multiply,
copy, divide and add kernels over logits, in both arms.

Here, per chunk of rows, forward computes the logits (``h @ W^T``, the model's dtype),
then one pass over them gives each row's log-sum-exp and loss; only ``lse`` (fp32, one per
row) is kept. Backward computes the chunk's logits again, one pass turns them in place into
``(softmax - onehot) * grad``, and two matmuls give the input's and the weight's gradients
(the weight's summed over chunks in fp32). The passes are Triton kernels on CUDA
(:func:`_lse_kernel`, :func:`_grad_kernel`) and torch ops elsewhere; both read the logits in
their own dtype and compute in fp32, as megatron-core's cross entropy does after its
``.float()``.

Tensor parallelism (a vocabulary split over ranks, its collectives) and sequence
parallelism stay on :mod:`~megatron.training.loss_chunks`' path: :func:`supported` says
when this one applies.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - the pinned environments have triton
    HAS_TRITON = False

BLOCK_V = 2048
"""Vocabulary entries a Triton program handles at once."""


def use_kernels(device: torch.device) -> bool:
    """The Triton passes on CUDA; on other devices only when ``$SPARSEBALANCE_CE`` is
    ``triton`` (tests, under Triton's interpreter); ``torch`` forces the torch ops."""
    mode = os.environ.get("SPARSEBALANCE_CE") or "auto"
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"SPARSEBALANCE_CE must be auto, triton or torch, got {mode!r}")
    if mode == "torch" or not HAS_TRITON:
        return False
    return mode == "triton" or device.type == "cuda"


if HAS_TRITON:

    @triton.jit
    def _lse_kernel(x_ptr, lab_ptr, lse_ptr, loss_ptr, V, stride, BLOCK: tl.constexpr):
        """Row ``r``: the log-sum-exp of ``x[r, :V]`` (fp32, streamed in blocks, running
        max) and the loss ``lse - x[r, label]``."""
        r = tl.program_id(0).to(tl.int64)
        row = x_ptr + r * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # lanes still at -inf (past V, or no entry yet) add nothing
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
            m = m_new
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        target = tl.load(row + tl.load(lab_ptr + r)).to(tl.float32)
        tl.store(lse_ptr + r, lse)
        tl.store(loss_ptr + r, lse - target)

    @triton.jit
    def _grad_kernel(x_ptr, lab_ptr, lse_ptr, g_ptr, V, stride, BLOCK: tl.constexpr):
        """``x[r, c] <- (exp(x[r, c] - lse[r]) - [c == label[r]]) * g[r]`` for the columns of
        program ``(r, c // BLOCK)``, in place, in ``x``'s dtype."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        ptr = x_ptr + r * stride + cols
        x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse_ptr + r))
        p = tl.where(cols == tl.load(lab_ptr + r), p - 1.0, p)
        tl.store(ptr, (p * tl.load(g_ptr + r)).to(x_ptr.dtype.element_ty), mask=ok)


def row_lse_loss(logits: torch.Tensor, labels: torch.Tensor):
    """``(lse, loss)``, fp32 ``[n]`` each, of ``logits [n, V]`` and ``labels [n]`` (int)."""
    n, V = logits.shape
    if use_kernels(logits.device) and n:
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        loss = torch.empty_like(lse)
        _lse_kernel[(n,)](logits, labels, lse, loss, V, logits.stride(0), BLOCK=BLOCK_V)
        return lse, loss
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    return lse, lse - x.gather(1, labels.view(-1, 1).long()).squeeze(1)


def logits_to_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``logits`` turned in place into the gradient of ``sum(grad * loss)`` with respect to
    them: ``(softmax - onehot(labels)) * grad[:, None]``; returns ``logits``."""
    n, V = logits.shape
    if use_kernels(logits.device) and n:
        grad = grad.float().contiguous()
        _grad_kernel[(n, triton.cdiv(V, BLOCK_V))](logits, labels, lse, grad, V, logits.stride(0), BLOCK=BLOCK_V)
        return logits
    p = torch.exp(logits.float() - lse[:, None])
    p.scatter_add_(1, labels.view(-1, 1).long(), torch.full((n, 1), -1.0, device=p.device))
    return logits.copy_(p * grad.float()[:, None])


class LinearCrossEntropy(torch.autograd.Function):
    """``loss[i] = logsumexp(h[i] @ W^T) - (h[i] @ W^T)[labels[i]]`` over rows of
    ``h [n, hidden]``, ``chunk`` rows at a time; keeps ``h``, ``W``, ``labels`` and one fp32
    log-sum-exp per row."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        n = h.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        loss = torch.empty(n, dtype=torch.float32, device=h.device)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            lse[a:b], loss[a:b] = row_lse_loss(h[a:b] @ weight.t(), labels[a:b])
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        h, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a in range(0, h.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, h.shape[0])
            g = logits_to_grad_(h[a:b] @ weight.t(), labels[a:b], lse[a:b], grad_loss[a:b])
            if need_h:
                torch.mm(g, weight, out=grad_h[a:b])
            if need_w:
                grad_w += (g.t() @ h[a:b]).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def supported(model) -> Optional[str]:
    """None when :func:`linear_cross_entropy` can stand for ``model``'s output layer and loss,
    else why not (it then runs in checkpointed chunks): one tensor-parallel rank, no bias."""
    layer = model.output_layer
    if model.config.tensor_model_parallel_size != 1:
        return "tensor parallelism (the vocabulary split over ranks)"
    if getattr(layer, "bias", None) is not None:
        return "an output layer with a bias"
    return None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """The loss per token ``[b, s]`` (fp32) of hidden states ``[s, b, h]``, an output weight
    ``[V, h]`` and labels ``[b, s]``, as megatron-core's output layer and cross entropy
    give it at TP = 1; ``chunk_tokens`` sequence positions (times ``b`` rows) at a time."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    s, b = hidden.shape[:2]
    if labels.shape != (b, s):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}")
    rows = hidden.reshape(s * b, hidden.shape[2])  # row i = position i // b of sequence i % b
    lab = labels.t().contiguous().view(-1)
    loss = LinearCrossEntropy.apply(rows, weight, lab, chunk_tokens * b)
    return loss.view(s, b).t()
