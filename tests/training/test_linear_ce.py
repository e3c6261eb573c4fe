"""The output layer + cross entropy as one autograd step (megatron/training/linear_ce.py).

Its Triton passes run under Triton's interpreter (TRITON_INTERPRET must be set before triton
is imported, so the outer test re-runs this file in a process that sets it, with
``SPARSEBALANCE_CE=triton``); the torch passes run here. Both are held to autograd through
``F.cross_entropy(h @ W^T)``: the loss per row and the gradients of ``h`` and ``W``, in fp32
and bf16, for a vocabulary that is not a multiple of the kernel's block and spans several,
chunks that do and do not divide the rows, labels at both ends of the vocabulary, and
logits large enough that an unshifted exponential would overflow. The driver's model path
(tied and untied weights, the masked loss and every parameter's gradient against
megatron-core's unchunked path) is in ``test_loss_chunks.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron.training import linear_ce

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CASES = {  # rows, hidden, vocab, chunk, dtype, logit scale
    "fp32-ragged-chunks": (13, 16, 5000, 5, torch.float32, 1.0),
    "fp32-one-chunk": (7, 8, 2049, 100, torch.float32, 1.0),
    "bf16": (9, 32, 4100, 4, torch.bfloat16, 1.0),
    "large-logits": (6, 8, 3000, 4, torch.float32, 400.0),
}


def _inputs(n, hid, V, dtype, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hid, generator=g) * scale ** 0.5).to(dtype)
    w = (torch.randn(V, hid, generator=g) * scale ** 0.5 / hid ** 0.5).to(dtype)
    lab = torch.randint(0, V, (n,), generator=g)
    lab[0], lab[-1] = 0, V - 1
    return h, w, lab


def _reference(h, w, lab, grad):
    """Autograd through megatron-core's recipe: logits in the model's dtype, the loss in fp32."""
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = F.cross_entropy((h @ w.t()).float(), lab, reduction="none")
    (loss * grad).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_equal_autograd(name):
    n, hid, V, chunk, dtype, scale = CASES[name]
    h, w, lab = _inputs(n, hid, V, dtype, scale)
    grad = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    grad[2] = 0.0  # a masked token: no gradient from it
    ref_loss, ref_h, ref_w = _reference(h, w, lab, grad)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = linear_ce.LinearCrossEntropy.apply(hh, ww, lab, chunk)
    (loss * grad).sum().backward()
    assert torch.isfinite(loss).all() and loss.dtype == torch.float32
    exact = dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5 if exact else 1e-2, atol=1e-4 if exact else 2e-2)
    for got, ref in ((hh.grad, ref_h), (ww.grad, ref_w)):
        assert got.dtype == dtype and ref.abs().max() > 0
        tol = 1e-5 if exact else 3e-2
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))


def test_model_layout_rows_follow_sequence_then_batch():
    """``[s, b, h]`` hidden states and ``[b, s]`` labels give ``[b, s]`` losses in place."""
    s, b, hid, V = 5, 3, 8, 300
    h, w, _ = _inputs(s * b, hid, V, torch.float32, 1.0)
    hidden = h.view(s, b, hid)
    labels = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(3))
    got = linear_ce.linear_cross_entropy(hidden, w, labels, chunk_tokens=2)
    ref = F.cross_entropy((hidden @ w.t()).permute(1, 2, 0), labels, reduction="none")  # [b, s]
    assert got.shape == (b, s)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^labels \(5, 3\) do not match hidden states \(5, 3, 8\)$"):
        linear_ce.linear_cross_entropy(hidden, w, labels.t(), 2)
    with pytest.raises(ValueError, match="^chunk_tokens must be > 0, got 0$"):
        linear_ce.linear_cross_entropy(hidden, w, labels, 0)


if INTERPRETED:

    def test_the_triton_passes_ran():
        assert linear_ce.use_kernels(torch.device("cpu"))  # SPARSEBALANCE_CE=triton, set by the outer test

else:

    def test_triton_passes_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1", SPARSEBALANCE_CE="triton")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, cwd=repo, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        passed = re.search(r"(\d+) passed", r.stdout)
        assert passed and int(passed.group(1)) == len(CASES) + 2, r.stdout[-2000:]

    @pytest.mark.parametrize("arch", [90, 80])
    def test_kernels_compile_without_a_gpu(arch):
        """Both passes compile to a cubin (H100 / H200, A100) for bf16 logits, int64 labels
        (megatron's) and the kernel's block, as training launches them."""
        triton = pytest.importorskip("triton")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        sig = {"x_ptr": "*bf16", "lab_ptr": "*i64", "lse_ptr": "*fp32", "V": "i32", "stride": "i32",
               "BLOCK": "constexpr"}
        for fn, extra in ((linear_ce._lse_kernel, {"loss_ptr": "*fp32"}), (linear_ce._grad_kernel, {"g_ptr": "*fp32"})):
            names = [n for n in fn.arg_names]
            full = {**sig, **extra}
            src = ASTSource(fn=fn, signature={n: full[n] for n in names}, constexprs={"BLOCK": linear_ce.BLOCK_V})
            out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            assert out.asm["cubin"], fn.fn.__name__

    def test_kernel_switch(monkeypatch):
        """``auto``: Triton on CUDA only; ``triton`` / ``torch`` forced; anything else refused."""
        monkeypatch.delenv("SPARSEBALANCE_CE", raising=False)
        assert not linear_ce.use_kernels(torch.device("cpu"))
        assert linear_ce.use_kernels(torch.device("cuda"))
        monkeypatch.setenv("SPARSEBALANCE_CE", "torch")
        assert not linear_ce.use_kernels(torch.device("cuda"))
        monkeypatch.setenv("SPARSEBALANCE_CE", "triton")
        assert linear_ce.use_kernels(torch.device("cpu"))
        monkeypatch.setenv("SPARSEBALANCE_CE", "Triton")
        with pytest.raises(ValueError, match="^SPARSEBALANCE_CE must be auto, triton or torch, got 'Triton'$"):
            linear_ce.use_kernels(torch.device("cpu"))
