"""Public API: argument validation (ValueError naming the argument) and the backend registry."""

import subprocess
import sys

import pytest
import torch
from _cases import make_inputs

from sparsebalance import ops
from sparsebalance.ops import override_backend, resolve_backend, sparse_attention


def _good():
    q, k, v, cu, _ = make_inputs([40, 30], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens=cu)


def _call(**over):
    a = _good()
    kw = dict(topk=over.pop("topk", 1), block_size=over.pop("block_size", 16),
              softmax_scale=over.pop("softmax_scale", None), backend=over.pop("backend", "reference"))
    a.update(over)
    return sparse_attention(a["q"], a["k"], a["v"], a["cu_seqlens"], **kw)


BAD = {
    "q 2-D": (dict(q=torch.randn(70, 16)), "q must"),
    "k heads": (dict(k=torch.randn(70, 3, 16), v=torch.randn(70, 3, 16)), "k heads"),
    "k/v shapes": (dict(v=torch.randn(70, 1, 16)), "k and v"),
    "T mismatch": (dict(k=torch.randn(71, 2, 16), v=torch.randn(71, 2, 16)), "k must"),
    "D mismatch": (dict(k=torch.randn(70, 2, 8), v=torch.randn(70, 2, 8)), "k must"),
    "dtype": (dict(q=torch.randn(70, 4, 16, dtype=torch.float64)), "q must be float32"),
    "mixed dtype": (dict(k=torch.randn(70, 2, 16).bfloat16()), "k and v must have q's dtype"),
    "cu float": (dict(cu_seqlens=torch.tensor([0.0, 70.0])), "cu_seqlens"),
    "cu start": (dict(cu_seqlens=torch.tensor([1, 70], dtype=torch.int32)), "cu_seqlens"),
    "cu end": (dict(cu_seqlens=torch.tensor([0, 69], dtype=torch.int32)), "cu_seqlens"),
    "cu decreasing": (dict(cu_seqlens=torch.tensor([0, 50, 40, 70], dtype=torch.int32)), "cu_seqlens"),
    "cu 2-D": (dict(cu_seqlens=torch.tensor([[0, 70]], dtype=torch.int32)), "cu_seqlens"),
    "topk negative": (dict(topk=-1), "topk"),
    "topk float": (dict(topk=1.5), "topk"),
    "topk tensor negative": (dict(topk=torch.tensor([1, -1])), "topk"),
    "topk tensor length": (dict(topk=torch.tensor([1, 1, 1])), "topk"),
    "topk tensor float": (dict(topk=torch.tensor([1.0, 2.0])), "topk"),
    "block_size zero": (dict(block_size=0), "block_size"),
    "block_size float": (dict(block_size=16.0), "block_size"),
    "scale": (dict(softmax_scale=-1.0), "softmax_scale"),
    "unknown backend": (dict(backend="flash9000"), "backend"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_value_error_naming_argument(case):
    over, msg = BAD[case]
    with pytest.raises(ValueError, match=msg):
        _call(**over)


def test_good_input_passes_validation():
    assert _call().shape == (70, 4, 16)  # guards the BAD table against a broken baseline


def test_empty_documents_allowed():
    q, k, v, _, _ = make_inputs([40], 2, 2, 16)
    cu = torch.tensor([0, 0, 40, 40], dtype=torch.int32)
    out = sparse_attention(q, k, v, cu, topk=0, block_size=16, backend="reference")
    ref = sparse_attention(q, k, v, cu[1:3] - 0, topk=0, block_size=16, backend="reference")
    torch.testing.assert_close(out, ref)


def test_registry_and_override_hook():
    assert set(ops.BACKENDS) == {"reference", "cpu", "triton", "cuda", "flex", "fa4"}
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == ("cpu" if ops.HAS_CPU_EXT else "reference")
    with override_backend("reference"):
        assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("auto", cpu) == ("cpu" if ops.HAS_CPU_EXT else "reference")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("nope", cpu)
    with pytest.raises(ValueError, match="backend"):
        with override_backend("nope"):
            pass
    if not ops.HAS_CUDA_EXT:
        with pytest.raises(ValueError, match="not available"):
            resolve_backend("cuda", cpu)


def test_package_imports_without_extension_and_says_so_once():
    # Hide the compiled module: the package must import, fall back, and log one warning.
    code = (
        "import sys, logging, io\n"
        "buf = io.StringIO(); logging.basicConfig(stream=buf)\n"
        "sys.modules['sparsebalance._C'] = None\n"
        "import sparsebalance.ops as o\n"
        "import importlib; importlib.reload(o)\n"
        "assert not o.HAS_CPU_EXT\n"
        "import torch\n"
        "assert o.resolve_backend('auto', torch.device('cpu')) == 'reference'\n"
        "print(buf.getvalue().count('sparsebalance._C not available'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


def test_per_token_routing_reference_runs_and_differs_from_block_routing():
    from sparsebalance.ops.reference import reference_sparse_attention

    q, k, v, cu, _ = make_inputs([300], 2, 2, 16, seed=2)
    block, kb = reference_sparse_attention(q, k, v, cu, 1, 32, 0.25, return_kept_pairs=True)
    tok, kt = reference_sparse_attention(q, k, v, cu, 1, 32, 0.25, query_block_size=1,
                                         return_kept_pairs=True)
    full, kf = reference_sparse_attention(q, k, v, cu, 100, 32, 0.25, query_block_size=1,
                                          return_kept_pairs=True)
    assert kb == kt < kf == 2 * 300 * 301 // 2  # same budget, same pair count
    assert not torch.allclose(block, tok)
    dense = reference_sparse_attention(q, k, v, cu, 100, 32, 0.25, return_kept_pairs=False)
    torch.testing.assert_close(full, dense)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_empty_batch(backend):
    q = torch.zeros(0, 2, 16, requires_grad=True)
    out, dens = sparse_attention(q, q, q, torch.tensor([0, 0], dtype=torch.int32), topk=1,
                                 block_size=16, backend=backend, return_density=True)
    out.sum().backward()
    assert out.shape == (0, 2, 16) and dens == 1.0 and q.grad.shape == q.shape
